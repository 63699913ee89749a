"""Start pdserve processes for tests and make sure none outlives them. Every cluster runs
with --kv-verify: a handoff whose blocks do not hold what was written fails loudly."""

from __future__ import annotations

import asyncio
import atexit
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from frontend.client import Client

ROOT = Path(__file__).resolve().parents[1]
# A grammar (a JSON schema) whose state a resumed matcher must keep, and what it lets
# through cut anywhere (ignore_eos: EOS tokens, not shown, after its end).
INT_ARRAY = '{"type": "array", "items": {"type": "integer"}}'
_INT = r"-?(0|[1-9][0-9]*)"
INT_ARRAY_PREFIX = rf"\[(-|{_INT}(, ?{_INT})*(, ?-?)?)?\]?"  # xgrammar's separator is ", "


def free_base_port(count: int = 3) -> int:
    """A port p with p .. p+count-1 free on 127.0.0.1.

    NOTE: chosen below the kernel's ephemeral range: a port from that range can be
    taken between this check and the bind by any outbound connection (the tests'
    own ZeroMQ links make many), while ports below it are only ever bound explicitly."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, max(low - count, 10001))
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def endpoints(base: int) -> tuple[str, str, str]:
    return (f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}", f"tcp://127.0.0.1:{base + 2}")


def children_of(pid: int) -> list[int]:
    """Every live descendant of pid, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    parents.setdefault(ppid, []).append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def python_children_of(pid: int) -> list[int]:
    """The Python processes among pid's descendants (a launcher's shell utilities come and go)."""
    out = []
    for child in children_of(pid):
        try:
            if b"python" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
        except OSError:
            continue
    return out


def is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(cond, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def start_streams(client, n: int, max_tokens: int) -> list[asyncio.Task]:
    """n requests (distinct prompts, ignore_eos) through an AsyncClient, returned once
    every one has streamed a token: a condition to act on (kill, stop, drain), not a
    sleep. Each task gives (its outputs, the monotonic time its stream ended)."""
    started = [asyncio.Event() for _ in range(n)]

    async def one(i):
        outs = []
        async for out in client.generate(
            prompt_token_ids=[i + 1] * 9, max_tokens=max_tokens, ignore_eos=True
        ):
            started[i].set()
            outs.append(out)
        return outs, time.monotonic()

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    return tasks


def spawn(module: str, *args: str, log_path: Path | None = None) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "TOKENIZERS_PARALLELISM": "false",
    }
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


class Processes:
    """The three processes started directly (no launcher), so one can be killed and restarted."""

    def __init__(self, model: Path, base: int, log_dir: Path, **extra: list[str]):
        """extra: role -> further arguments (frontend=[...], prefill=[...], decode=[...])."""
        self.model, self.log_dir = model, log_dir
        self.clients, self.nodes, self.kv = endpoints(base)
        self.extra = extra
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, role: str, name: str | None = None, kv: str | None = None) -> subprocess.Popen:
        """role: frontend, prefill or decode; a further decode node needs its own name and kv."""
        log = self.log_dir / f"{name or role}.log"
        extra = self.extra.get(role, []) + (["--name", name] if name else [])
        if role == "frontend":
            p = spawn(
                "frontend",
                "--model",
                str(self.model),
                "--clients",
                self.clients,
                "--nodes",
                self.nodes,
                "--dead-after",
                "2",
                "--drain-timeout",
                "1",
                *extra,
                log_path=log,
            )
        elif role == "prefill":
            p = spawn(
                "prefill_node",
                "--model",
                str(self.model),
                "--frontend",
                self.nodes,
                "--kv-cache-memory",
                "4MiB",
                "--kv-verify",
                "--handoff-lease",
                "3",
                "--token-budget",
                "64",
                *extra,
                log_path=log,
            )
        else:
            p = spawn(
                "decode_node",
                "--model",
                str(self.model),
                "--frontend",
                self.nodes,
                "--kv-bind",
                kv or self.kv,
                "--kv-cache-memory",
                "4MiB",
                "--kv-verify",
                "--max-batch-size",
                "16",
                *extra,
                log_path=log,
            )
        self.procs[name or role] = p
        return p

    def decode_node_here(self):
        """A decode node made in this process (its loop run on a thread by the test), on
        these endpoints: 4 MiB of KV cache in shared memory (the ipc transfer), batch of 16."""
        from common.base.config import DecodeConfig, WorkerConfig
        from decode_node.node import DecodeNode

        worker = WorkerConfig(
            model=str(self.model),
            kv_cache_memory=4 * 2**20,
            max_batch_size=16,
            is_cache_in_shm=True,
        )
        return DecodeNode(
            DecodeConfig(worker=worker, frontend_endpoint=self.nodes, kv_endpoint=self.kv)
        )

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Cluster:
    """A cluster started by launch/start_cluster.sh, HTTP included."""

    def __init__(self, model, log_path, *extra):
        # Ports: clients, nodes, one KV port per decode node (up to 3), HTTP.
        self.base = free_base_port(6)
        self.endpoint = f"tcp://127.0.0.1:{self.base}"
        self.http = f"http://127.0.0.1:{self.base + 5}"
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [
                "bash",
                str(ROOT / "launch/start_cluster.sh"),
                "--model",
                str(model),
                "--base-port",
                str(self.base),
                "--http-port",
                str(self.base + 5),
                "--kv-cache-memory",
                "8MiB",
                "--kv-verify",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=ROOT,
            start_new_session=True,
        )
        # NOTE: a test that fails before stop() must not leave a launcher that restarts
        # its nodes forever: whatever is still running at exit is stopped.
        atexit.register(self._kill)
        line = self.proc.stdout.readline().decode()
        assert line.startswith("PDSERVE_ENDPOINT="), f"cluster did not start: {line!r}"
        self.children = python_children_of(self.proc.pid)

    def _kill(self) -> None:
        if self.proc.poll() is None:
            # the launcher's group (its nodes, in sessions of their own, die with it)
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stats(self) -> dict:
        with Client(self.endpoint) as c:
            return c.stats().nodes

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.log.close()


def post_json(url: str, body, method: str = "POST") -> tuple[int, dict]:
    """(status, decoded JSON body) of an HTTP call; body: JSON-ready, or raw bytes."""
    import json
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
