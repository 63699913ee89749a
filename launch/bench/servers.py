"""The servers `pdserve bench vs` compares, each an OpenAI API on one port: pdserve's
cluster (this checkout's or another's) and vLLM's server, each started alone as a process
group, waited on until it answers, and stopped whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            if r.status != 200:
                return False
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
            return bool(json.loads(r.read())["data"])
    except (OSError, ValueError, KeyError):
        return False


class Server:
    """One server process group, started alone and stopped whole."""

    def __init__(self, name: str, cmd: list[str], url: str, env: dict, log_path: Path):
        self.name, self.url = name, url
        self.log_file = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"bench_vs: {self.name} exited with code {self.proc.returncode} "
                    f"while starting; see {self.log_file.name}"
                )
            if is_healthy(self.url):
                return
            time.sleep(0.5)
        self.stop()
        raise SystemExit(
            f"bench_vs: {self.name} not ready after {timeout_s:.0f}s; see {self.log_file.name}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # anything the group left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log_file.close()


def kv_space_gib() -> str:
    """The KV cache each server gets: vLLM's VLLM_CPU_KVCACHE_SPACE (GiB; 1 here unless set)."""
    return os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")


def start_pdserve(a, model: str, logs: Path, root: Path = ROOT, name: str = "pdserve") -> Server:
    # NOTE: the same KV budget as vLLM's, per node, unless given (pdserve's CPU default is 256 MiB)
    kv = (
        []
        if "--kv-cache-memory" in a.pdserve_arg
        else ["--kv-cache-memory", f"{kv_space_gib()}GiB"]
    )
    cmd = [
        "bash",
        str(root / "launch" / "start_cluster.sh"),
        "--model",
        model,
        *a.server_args,
        "--base-port",
        str(a.base_port),
        "--http-port",
        str(a.port),
        *kv,
        *a.pdserve_arg,
        *(a.against_arg if name != "pdserve" else []),
    ]
    env = {**os.environ, "PDSERVE_VENV": sys.prefix}  # the other checkout: this environment
    return Server(
        name, cmd, f"http://127.0.0.1:{a.port}", env, logs / f"{name.replace('/', '_')}.log"
    )


def start_vllm(a, model: str, logs: Path) -> Server:
    # NOTE: `vllm serve` looks up a distribution named vllm, which the CPU build is not.
    cmd = [
        a.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        *a.server_args,
        "--host",
        "127.0.0.1",
        "--port",
        str(a.port),
        *a.vllm_arg,
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": kv_space_gib()}
    env.pop("PYTHONPATH", None)
    return Server("vllm", cmd, f"http://127.0.0.1:{a.port}", env, logs / "vllm.log")
