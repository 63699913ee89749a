"""The supervisor of one host's processes: it starts the frontend and this host's nodes
(launch/cluster/plan.py says which, with what), says ready once each node is registered,
restarts a node that dies with backoff, and stops everything in order: the frontend drains
first. Its decisions (Backoff, the stop order, readiness) are methods a test drives on a fake
clock with stand-in processes (tests/unit/test_supervisor.py); launch/start_cluster.py runs it.

Each process gets a session of its own, so a terminal's Ctrl-C reaches the launcher
alone and the cluster drains in order; every child also dies with the launcher
(PR_SET_PDEATHSIG, set by each process itself before its imports, which also ends
at once if this launcher is gone by then: common/base/lifetime.py).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from common.base.env import LAUNCHER_ENV, PARENT_PID_ENV
from launch.cluster import plan as cluster_plan
from launch.cluster.plan import Node, Plan

MAX_BACKOFF_S = 30
STABLE_S = 60  # a node that ran this long starts its backoff over
LAUNCH_ID = secrets.token_hex(8)  # this launcher's, in each node's env (LAUNCHER_ENV)
STOP_GRACE_S = 10  # after the drain: SIGTERM, then SIGKILL this much later


def say(line: str) -> None:
    print(f"[pdserve] {line}", file=sys.stderr, flush=True)


class Backoff:
    """A node's restart delay: 1 s, doubling to MAX_BACKOFF_S; over again once it has run
    for STABLE_S."""

    def __init__(self):
        self.delay_s = 1

    def after_exit(self, ran_s: float) -> int:
        """The delay before restarting a node that ran ran_s seconds."""
        if ran_s >= STABLE_S:
            self.delay_s = 1
        delay, self.delay_s = self.delay_s, min(self.delay_s * 2, MAX_BACKOFF_S)
        return delay


class Supervisor:
    """spawn(argv, env) -> a Popen-like process (poll, pid, send_signal, kill, wait)."""

    def __init__(
        self,
        plan: Plan,
        ready_dir: Path,
        spawn: Callable | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        ask_frontend: Callable[[Plan, int], bool] | None = None,
    ):
        self.plan, self.ready_dir = plan, ready_dir
        self.spawn, self.ask_frontend = spawn or _spawn, ask_frontend or _frontend_has
        self.signal: int | None = None  # set by the signal handler: stop now
        self.clock, self.sleep = clock, sleep
        self.frontend = None
        self.procs: dict[str, object] = {}  # node name -> its process
        self.started_at: dict[str, float] = {}
        self.backoff = {n.name: Backoff() for n in plan.nodes}
        self.restart_at: dict[str, float] = {}  # node name -> when it starts again
        self.temp_keys = ""

    # ---- start ----------------------------------------------------------------

    def start_frontend(self) -> None:
        env = {"PDSERVE_TEMP_KEYS": self.temp_keys}
        self.frontend = self.spawn(cluster_plan.frontend_argv(self.plan), env)

    def start_node(self, node: Node) -> None:
        ready = self.ready_dir / node.name
        ready.unlink(missing_ok=True)
        self.procs[node.name] = self.spawn(
            cluster_plan.node_argv(self.plan, node), {"PDSERVE_READY_FILE": str(ready)}
        )
        self.started_at[node.name] = self.clock()

    def dead(self) -> str | None:
        """'NAME (pid P) exited with code C' for a process that exited, frontend first."""
        for name, p in ([("the frontend", self.frontend)] if self.frontend else []) + list(
            self.procs.items()
        ):
            if p is not None and p.poll() is not None and name not in self.restart_at:
                return f"{name} (pid {p.pid}) exited with code {p.returncode}"
        return None

    def is_ready(self) -> bool:
        """Every node here registered (each writes a file once the frontend accepted it),
        and, with our frontend here, it says so itself: a handshake, not a sleep."""
        if not all((self.ready_dir / n.name).exists() for n in self.plan.nodes):
            return False
        return self.frontend is None or self.ask_frontend(self.plan, self.frontend.pid)

    def wait_ready(self, timeout_s: float) -> str | None:
        """None once ready; else why not (a process exited, or the time ran out)."""
        deadline = self.clock() + timeout_s
        while not self.is_ready():
            if self.signal is not None:
                return "stopping before ready"
            why = self.dead()
            if why:
                return f"{why} during start-up (its error is above); stopping"
            if self.clock() >= deadline:
                if self.plan.is_joining:
                    return (
                        f"the frontend at {self.plan.node_link} did not accept every node here "
                        f"within {timeout_s:.0f}s (unreachable, or other keys?); stopping"
                    )
                return f"not ready after {timeout_s:.0f}s; stopping"
            self.sleep(0.1)
        return None

    # ---- serve ----------------------------------------------------------------

    def turn(self) -> int | None:
        """One look at every process: an exit code to stop with, or None to go on."""
        if self.frontend is not None and self.frontend.poll() is not None:
            say(
                f"the frontend (pid {self.frontend.pid}) exited with code "
                f"{self.frontend.returncode}; stopping the cluster"
            )
            return 1
        now = self.clock()
        for node in self.plan.nodes:
            if node.name in self.restart_at:
                if now >= self.restart_at[node.name]:
                    say(f"restarting {node.name}")
                    del self.restart_at[node.name]
                    self.start_node(node)
                continue
            p = self.procs[node.name]
            if p.poll() is None:
                continue
            if self.plan.opts.no_restart:
                say(
                    f"{node.name} (pid {p.pid}) exited with code {p.returncode}; "
                    f"stopping the cluster"
                )
                return 1
            delay = self.backoff[node.name].after_exit(now - self.started_at[node.name])
            say(
                f"{node.name} (pid {p.pid}) exited with code {p.returncode}; restarting in {delay}s"
            )
            self.restart_at[node.name] = now + delay
        return None

    # ---- stop -----------------------------------------------------------------

    def stop(self, drain_s: float) -> None:
        """The frontend drains first (up to drain_s and STOP_GRACE_S more), then every
        process gets SIGTERM, and SIGKILL STOP_GRACE_S later."""
        procs = [p for p in [self.frontend, *self.procs.values()] if p is not None]
        if self.frontend is not None and self.frontend.poll() is None:
            self.frontend.send_signal(signal.SIGTERM)
            self._wait_all([self.frontend], drain_s + STOP_GRACE_S)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        self._wait_all(procs, STOP_GRACE_S)
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()

    def _wait_all(self, procs: list, timeout_s: float) -> None:
        deadline = self.clock() + timeout_s
        while any(p.poll() is None for p in procs) and self.clock() < deadline:
            self.sleep(0.1)


def _spawn(argv: list[str], env: dict[str, str]):
    # NOTE: a session of its own, with no terminal: neither its reads nor its writes
    # (`stty tostop`) can stop it as a background job of the launcher's terminal would be
    return subprocess.Popen(
        [sys.executable, *argv],
        # see die_with_parent; LAUNCHER_ENV: its nodes share cores by this launcher's plan
        env={**os.environ, **env, PARENT_PID_ENV: str(os.getpid()), LAUNCHER_ENV: LAUNCH_ID},
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _frontend_has(plan: Plan, frontend_pid: int) -> bool:
    """Our frontend (its pid: not another cluster's on the port) has every node here."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "frontend.cli",
            "--endpoint",
            plan.clients,
            "--wait-ready",
            "2",
            "--wait-names",
            ",".join(n.name for n in plan.nodes),
            "--frontend-pid",
            str(frontend_pid),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return done.returncode == 0
