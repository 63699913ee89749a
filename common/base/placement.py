"""Where a process runs, as its heartbeat says it (frontend/paths.py reads it): the machine,
the launcher that started it, the CPUs it may run on and the threads it computes on. Nodes
of one launcher are given their cores by its plan (a decode node's steps come first:
common/engine/cores.py). Nodes of two launchers (or started by hand) on one machine, whose
CPUs overlap and whose threads outnumber those CPUs, compete for cores nothing shares out:
every thread of one takes a core the other counted on."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass

from common.base.env import LAUNCHER_ENV

MAX_CPUS = 8192  # Linux's largest CPU count: a CPU list past it is not a machine's
MAX_CPUS_TEXT = 4096  # a heartbeat's strings are at most this long (common/wire/node.py)


@dataclass(frozen=True)
class Placement:
    """A node's place, as read from its heartbeat (frontend side)."""

    machine: str
    launcher: str
    cpus: frozenset[int]
    num_threads: int  # threads computing on the host's cores (0: the device is not the host)


def parse_cpus(text: str) -> frozenset[int]:
    """ "0-2,5" -> {0, 1, 2, 5}; a ValueError for anything else, or for ranges that name
    more than MAX_CPUS CPUs in all (repeats counted: the work is bounded, not just the
    result)."""
    if not isinstance(text, str) or len(text) > 8 * MAX_CPUS:
        raise ValueError(f"not a CPU list: {str(text)[:64]!r}")
    out: set[int] = set()
    num_named = 0
    for part in text.split(","):
        lo, _, hi = (s.strip() for s in part.partition("-"))
        if not (_is_number(lo) and (_is_number(hi) or not hi)):  # "1-": 1, as it always was
            raise ValueError(f"{part.strip()[:64]!r} is not a CPU number or range")
        a, b = int(lo), int(hi or lo)
        if a > b:
            raise ValueError(f"the range {a}-{b} names no CPU")
        num_named += b - a + 1
        if b >= MAX_CPUS or num_named > MAX_CPUS:
            raise ValueError(f"a CPU list names at most {MAX_CPUS} CPUs, below {MAX_CPUS}")
        out.update(range(a, b + 1))
    return frozenset(out)


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def format_cpus(cpus) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _machine_id() -> str:
    """The same for every process of one running kernel, containers and network
    namespaces included (its boot id); the host name where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()[:64] or socket.gethostname()
    except OSError:
        return socket.gethostname()


def placement() -> dict:
    """This process's figures for its heartbeat (its worker's stats add num_host_threads).
    Its launcher: the id start_cluster.sh gives the nodes it plans (LAUNCHER_ENV), else one
    of its own (started by hand: nothing shares its cores out with another's)."""
    try:
        cpus = format_cpus(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = ""
    if len(cpus) > MAX_CPUS_TEXT:  # NOTE: a longer string and the whole beat is refused
        cpus = ""
    launcher = os.environ.get(LAUNCHER_ENV, "")[:64] or f"self-{secrets.token_hex(8)}"
    return {
        "machine": _machine_id(),
        "launcher": launcher,
        "cpus": cpus,
    }


def placement_key(stats: dict) -> tuple:
    """The figures read_placement reads, to compare beats by."""
    return tuple(stats.get(k) for k in ("machine", "launcher", "cpus", "num_host_threads"))


def read_placement(stats: dict) -> Placement | None:
    """A heartbeat's placement figures (hostile: None where any is missing or bad)."""
    machine, launcher, cpus, threads = placement_key(stats)
    if not (isinstance(machine, str) and machine and isinstance(launcher, str) and launcher):
        return None
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        return None
    try:
        return Placement(machine, launcher, parse_cpus(cpus), threads)
    except ValueError:
        return None


def is_core_shared(a: Placement | None, b: Placement | None) -> bool:
    """Whether two nodes compete for cores that no launcher shares out between them: one
    machine, two launchers, CPUs in common, and more threads than their CPUs in all."""
    if a is None or b is None or a.machine != b.machine or a.launcher == b.launcher:
        return False
    if not (a.num_threads and b.num_threads and a.cpus & b.cpus):
        return False
    return a.num_threads + b.num_threads > len(a.cpus | b.cpus)
