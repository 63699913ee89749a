"""The cluster launcher (launch/start_cluster.sh runs it; `--help` for its flags): it
starts the frontend and this host's nodes (launch/cluster_plan.py decides which, with
what), says ready once each node is registered, restarts a node that dies with
backoff, and on SIGTERM/SIGINT drains and stops everything, leaving no process, key or
file behind. Its decisions (Backoff, the stop order, readiness) are methods a test
drives on a fake clock with stand-in processes (tests/test_supervisor.py).

Each process gets a session of its own, so a terminal's Ctrl-C reaches the launcher
alone and the cluster drains in order; every child also dies with the launcher
(PR_SET_PDEATHSIG, set by each process itself).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from common.base.env import read_env
from common.base.model_dir import check_model_dir
from launch import cluster_plan
from launch.cluster_plan import Node, Plan, PlanError
from launch.default_model import make_default
from launch.leftovers import remove_leftovers

MAX_BACKOFF_S = 30
STABLE_S = 60  # a node that ran this long starts its backoff over
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
                        f"the frontend at {self.plan.node_link} did not accept every node here within "
                        f"{timeout_s:.0f}s (unreachable, or other keys?); stopping"
                    )
                return f"not ready after {timeout_s:.0f}s; stopping"
            self.sleep(0.1)
        return None

    # ---- serve ----------------------------------------------------------------

    def turn(self) -> int | None:
        """One look at every process: an exit code to stop with, or None to go on."""
        if self.frontend is not None and self.frontend.poll() is not None:
            say(
                f"the frontend (pid {self.frontend.pid}) exited with code {self.frontend.returncode}; "
                f"stopping the cluster"
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
                    f"{node.name} (pid {p.pid}) exited with code {p.returncode}; stopping the cluster"
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
    return subprocess.Popen(
        [sys.executable, *argv], env={**os.environ, **env}, start_new_session=True
    )


def _remove_core_tables(plan: Plan) -> None:
    """Ours, once every node is gone (a node killed leaves its row, and the table)."""
    for pool in set(plan.core_pools.values()):
        Path("/dev/shm", pool.partition(":")[0]).unlink(missing_ok=True)


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


def _check_ports(host: str, ports: list[int]) -> str | None:
    """Every port this cluster binds must be free now: a port in use means another
    cluster, which must not answer our readiness check or receive our nodes."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in ports:
        with socket.socket(family) as s:
            # As ZeroMQ binds: past connections lingering in TIME_WAIT do not hold the port.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                return (
                    f"port {port} on {host} is in use ({e.strerror}): another cluster? choose another "
                    f"--base-port (or --http-port)"
                )
    return None


def _memory_refusal(plan: Plan) -> str | None:
    """Why this host's memory cannot hold its CPU nodes (each loads the weights and its
    KV cache), or None. Accelerator nodes check their own device as they start."""
    cpu = [n for n in plan.nodes if n.device == "cpu"]
    if not cpu:
        return None
    # NOTE: here, not above: these import torch, which a bad --model need not wait for
    from common.base.config import DTYPES, WorkerConfig, parse_bytes, parse_dtype
    from launch import memory_check

    a = plan.opts
    dtype = parse_dtype(a.dtype or "auto") or "float32"
    if dtype not in DTYPES:
        return None  # the node says what is wrong with it
    kv = parse_bytes(a.kv_cache_memory or None) or WorkerConfig.cpu_kv_cache_memory
    need = {
        f"the weights in {dtype}, x{len(cpu)} cpu nodes": len(cpu)
        * memory_check.checkpoint_bytes(plan.model, dtype),
        f"a KV cache of {memory_check.gib(kv)} each": len(cpu) * kv,
    }
    return memory_check.refusal(
        f"{len(cpu)} cpu node(s) of {plan.model}",
        need,
        "start fewer cpu nodes (--num-prefill, --num-decode), give --dtype "
        "bfloat16 or a smaller --kv-cache-memory, or put nodes on an "
        "accelerator",
    )


def _role_warnings(plan: Plan) -> list[str]:
    """A cluster whose frontend is here but which cannot serve a request yet."""
    if plan.is_joining:
        return []  # this host adds nodes to a cluster: the others may be elsewhere
    roles = {n.role for n in plan.nodes}
    return [
        f"no {role} node (--num-{role} 0): every request is refused until one joins from "
        f"another host (start_cluster.sh --join {plan.node_link})"
        for role in ("prefill", "decode")
        if role not in roles
    ]


def _threads(num: int) -> str:
    """As each node's ready line counts them (common/runtime/process.py: describe_threads)."""
    return f"{num} thread{'s' * (num > 1)}"


def _keys(plan: Plan) -> tuple[list[str], str, str]:
    """(--keys args, how links are secured, a temporary key directory to remove or "")."""
    a = plan.opts
    if a.no_keys:
        return [], "open node links", ""
    if a.join:  # the frontend's host made them: use, never make
        for file in ["frontend.key", *(f"{n.name}.key_secret" for n in plan.nodes)]:
            if not (Path(a.keys) / file).is_file():
                raise PlanError(
                    f"{a.keys} has no {file}: make the keys once for every node name "
                    f"(pdserve keys KEYS --nodes ...) and copy the directory to each host"
                )
        return ["--keys", a.keys], f"CURVE keys in {a.keys}", ""
    # NOTE: made for this cluster alone, the frontend removes them as it exits (also when this
    # launcher was killed); a launch removes those of launchers killed with their frontend.
    temp = "" if a.keys else tempfile.mkdtemp(prefix=f"pdserve-keys-{os.getpid()}-")
    keys = a.keys or temp
    subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.keys",
            keys,
            "--nodes",
            ",".join(n.name for n in plan.nodes),
        ],
        stdout=subprocess.DEVNULL,
        check=True,
    )
    return ["--keys", keys], f"CURVE keys in {keys}", temp


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--ray" in argv:  # Ray places and supervises the processes (launch/ray_cluster.py)
        from launch.ray_cluster import serve

        return serve(argv)
    try:
        a = cluster_plan.parse(argv)
        if a.help:
            print(cluster_plan.USAGE)
            return 0
        plan = cluster_plan.make_plan(a, cluster_plan.num_cores(), read_env().home)
    except PlanError as e:
        print(f"start_cluster: {e}", file=sys.stderr)
        return 2
    try:  # NOTE: before any process starts: a bad model or a host too small is one line
        if a.model:
            check_model_dir(plan.model, needs_tokenizer=not a.join)
        else:
            make_default(plan.model, say)
        why = _memory_refusal(plan)
    except ValueError as e:
        print(f"start_cluster: {e}", file=sys.stderr)
        return 2
    if why:
        print(f"start_cluster: {why}", file=sys.stderr)
        return 1
    for warning in _role_warnings(plan):
        say(f"warning: {warning}")
    why = _check_ports(a.host, plan.ports)
    if why:
        print(f"start_cluster: {why}", file=sys.stderr)
        return 1
    cores = cluster_plan.num_cores()
    per = {
        role: next(
            (plan.threads[n.name] for n in plan.nodes if n.role == role and n.device == "cpu"), 1
        )
        for role in ("prefill", "decode")
    }
    shared = (
        " (shared: each up to that, owed its split; --no-core-sharing: fixed)"
        if plan.core_pools
        else ""
    )
    frontend = "no frontend here" if a.join else "the frontend 1 thread"
    say(
        f"{cores} cores: each cpu prefill node {_threads(per['prefill'])} (low priority), each cpu "
        f"decode node {_threads(per['decode'])}{shared}, {frontend}"
    )
    remove_leftovers()
    try:
        plan.key_args, links, temp_keys = _keys(plan)
    except PlanError as e:
        print(f"start_cluster: {e}", file=sys.stderr)
        return 2
    ready_dir = Path(tempfile.mkdtemp(prefix=f"pdserve-ready-{os.getpid()}-"))
    sup = Supervisor(plan, ready_dir)
    sup.temp_keys = temp_keys

    def on_signal(signum, _frame) -> None:
        sup.signal = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        return _run(sup, plan, links)
    finally:
        shutil.rmtree(ready_dir, ignore_errors=True)
        if temp_keys:
            shutil.rmtree(temp_keys, ignore_errors=True)
        _remove_core_tables(plan)


def _run(sup: Supervisor, plan: Plan, links: str) -> int:
    a = plan.opts
    drain_s = float(a.drain_timeout)

    def stop(rc: int) -> int:
        # NOTE: a second signal while stopping ends the launcher at once (its children die with it).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if sup.signal is not None:
            say(f"stopping (draining for up to {a.drain_timeout}s)")
            rc = 128 + sup.signal
        sup.stop(drain_s)
        return rc

    if not a.join:
        sup.start_frontend()
    for node in plan.nodes:
        sup.start_node(node)
    why = sup.wait_ready(float(a.ready_timeout))
    if why:
        if sup.signal is None:
            say(why)
        return stop(1)
    pids = " ".join(str(sup.procs[n.name].pid) for n in plan.nodes)
    if a.join:
        say(
            f"joined the frontend at {a.join}: {' '.join(n.name for n in plan.nodes)} registered (node pids {pids}; "
            f"KV at {plan.clients.rsplit(':', 1)[0].removeprefix('tcp://')} from port {int(a.base_port) + 2}; {links})"
        )
        print(f"PDSERVE_JOINED={a.join}", flush=True)
    else:
        http = (
            ""
            if a.no_http
            else f", OpenAI API at http://{plan.clients.rsplit(':', 1)[0].removeprefix('tcp://')}"
            f":{a.http_port}/v1"
        )
        num = {role: sum(n.role == role for n in plan.nodes) for role in ("prefill", "decode")}
        say(
            f"ready: {num['prefill']} prefill + {num['decode']} decode nodes; clients connect to {plan.clients}{http} "
            f"(frontend pid {sup.frontend.pid}, node pids {pids}; {links})"
        )
        print(f"PDSERVE_ENDPOINT={plan.clients}", flush=True)
    if a.demo:
        rc = 0
        for extra in (
            [
                "--max-tokens",
                "24",
                "--ignore-eos",
                "--prompt",
                "The prefill node computes the prompt",
                "--prompt",
                "Hello, world! How are you?",
                "--prompt",
                "café naïve résumé",
            ],
            [
                "--max-tokens",
                "24",
                "--temperature",
                "0.8",
                "--seed",
                "7",
                "--prompt",
                "A streamed, sampled answer:",
            ],
        ):
            rc = (
                subprocess.run(
                    [sys.executable, "-m", "frontend.cli", "--endpoint", plan.clients, *extra]
                ).returncode
                or rc
            )
        say("demo done; stopping")
        return stop(rc)
    # Serve until a signal arrives or the frontend exits; a node that exits starts again
    # after its backoff.
    while True:
        if sup.signal is not None:
            return stop(0)
        rc = sup.turn()
        if rc is not None:
            return stop(rc)
        sup.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
