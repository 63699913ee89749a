"""Simulated hosts for tests and benchmarks: each a network namespace with its own hostname and
/dev/shm (unshare --uts --mount and a tmpfs), one address from 198.18.0.0/15
(the range set aside for benchmarking), all joined by a bridge that lives in a
namespace of its own. Nothing touches this machine's own network namespace, and
close() removes every namespace, also after a failure. Needs root; where
namespaces cannot be made, why_not() says why (the tests skip with it)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import threading
from pathlib import Path

SUBNET_PREFIX = "198.18.0."


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def why_not() -> str | None:
    """Why simulated hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"simulated hosts need the {tool} command"
    probe = f"pds-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"cannot make a network namespace: {e.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class Hosts:
    """Hosts named names[i] at 198.18.0.(i + 1)."""

    def __init__(self, names: list[str]):
        self.tag = secrets.token_hex(3)
        self.bridge = f"pds-{self.tag}-br"
        self.names = list(names)
        self.procs: list[subprocess.Popen] = []
        self.namespaces: list[str] = []
        try:
            self._make()
        except Exception:
            self.close()
            raise

    def ns(self, name: str) -> str:
        return f"pds-{self.tag}-{name}"

    def addr(self, name: str) -> str:
        return f"{SUBNET_PREFIX}{self.names.index(name) + 1}"

    def _port(self, name: str) -> str:
        return f"p{self.names.index(name)}"  # the bridge's end of that host's link

    def _make(self) -> None:
        _ip("netns", "add", self.bridge)
        self.namespaces.append(self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        for name in self.names:
            ns = self.ns(name)
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            # The veth pair is made inside the bridge's namespace, one end moved to the host.
            _ip(
                "-n",
                self.bridge,
                "link",
                "add",
                self._port(name),
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _ip("-n", self.bridge, "link", "set", self._port(name), "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(name)}/15", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def prefix(self, name: str) -> list[str]:
        """What runs a command on host name: its network, hostname and /dev/shm."""
        shell = 'hostname "$0" && mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.ns(name),
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            shell,
            f"host-{name}",
        ]

    def popen(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        """argv run on host name, in a session of its own (close() stops the whole group)."""
        p = subprocess.Popen([*self.prefix(name), *argv], start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def run(
        self, name: str, argv: list[str], timeout_s: float = 120, **kw
    ) -> subprocess.CompletedProcess:
        p = self.popen(name, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        out, err = p.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(argv, p.returncode, out, err)

    def cut(self, name: str) -> None:
        """The host's link goes down at the bridge: silence, no reset."""
        _ip("-n", self.bridge, "link", "set", self._port(name), "down")

    def restore(self, name: str) -> None:
        _ip("-n", self.bridge, "link", "set", self._port(name), "up")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in reversed(self.namespaces):
            # NOTE: a namespace's processes must be gone first, or its network outlives it.
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()

    def __enter__(self) -> "Hosts":
        # NOTE: a SIGTERM or SIGHUP (a timeout, a closed terminal) ends the with block like an
        # error: its hosts' processes stop and their namespaces go, none left behind.
        self._handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._handlers[sig] = signal.signal(sig, _exit_on)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            for sig, old in self._handlers.items():
                signal.signal(sig, old)


def _exit_on(signum, frame) -> None:
    raise SystemExit(128 + signum)


def leftover_namespaces() -> list[str]:
    """Namespaces these helpers made and did not remove (a test checks none are left)."""
    run = Path("/run/netns")
    return (
        sorted(p.name for p in run.iterdir() if p.name.startswith("pds-")) if run.exists() else []
    )
