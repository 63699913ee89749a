"""Where a process runs, as its heartbeat says it (frontend/paths.py reads it): the machine,
the launcher that started it and the CPUs it may run on. Two nodes on one machine whose
CPUs overlap compete for those cores; started by one launcher, they share them by its plan
(a decode node's steps come first: common/engine/cores.py); started by two, nothing
arranges it, and every thread of one takes cores the other counted on."""

from __future__ import annotations

import os
import socket


def _machine_id() -> str:
    """The same for every process of one running kernel, containers and network
    namespaces included (its boot id); the host name where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def _launcher_id() -> str:
    """The parent process, named by pid and start time (pids repeat across containers)."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/stat") as f:
            # NOTE: field 2 (the name) may hold spaces and parentheses: split after its ")".
            start = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        start = "?"
    return f"{ppid}@{start}"


def _cpus() -> str:
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return ""
    return format_cpus(cpus)


def format_cpus(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_cpus(text, limit: int = 65_536) -> frozenset[int]:
    """ "0-2,5" -> {0, 1, 2, 5}; empty for anything else (a heartbeat's figure is hostile:
    bad text, or ranges past limit CPUs, read as unknown)."""
    out: set[int] = set()
    if not isinstance(text, str) or len(text) > 4096:
        return frozenset()
    try:
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            a, b = int(lo), int(hi or lo)
            if not 0 <= a <= b < limit or len(out) + b - a >= limit:
                return frozenset()
            out.update(range(a, b + 1))
    except ValueError:
        return frozenset()
    return frozenset(out)


def placement() -> dict[str, str]:
    """This process's figures for its heartbeat."""
    return {"machine": _machine_id(), "launcher": _launcher_id(), "cpus": _cpus()}


def is_core_shared(a: dict, b: dict) -> bool:
    """Whether two nodes' heartbeats (a, b) say they run on one machine, on CPUs they both
    may use, started by different launchers: nothing shares those cores out between them."""
    machine, launcher = a.get("machine"), a.get("launcher")
    if not isinstance(machine, str) or not machine or machine != b.get("machine"):
        return False
    if not isinstance(launcher, str) or launcher == b.get("launcher"):
        return False
    return bool(parse_cpus(a.get("cpus")) & parse_cpus(b.get("cpus")))
