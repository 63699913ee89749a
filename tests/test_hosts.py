"""One command per host: a frontend host and hosts that --join it, each started by
launch/start_cluster.sh with its own --name-prefix and node counts (here all on
this machine's loopback)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from frontend.client import AsyncClient, Client
from tests.cluster_util import ROOT, free_base_port, python_children_of, wait_for
from tests.conftest import clear_prompts


class Launcher:
    def __init__(self, tiny_model, log_path, *args: str):
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(["bash", str(ROOT / "launch/start_cluster.sh"), "--model", str(tiny_model),
                                      "--kv-cache-memory", "8MiB", "--no-http", *args],
                                     stdout=subprocess.PIPE, stderr=self.log, cwd=ROOT, start_new_session=True)

    def first_line(self) -> str:
        return self.proc.stdout.readline().decode().strip()

    def stop(self) -> int:
        children = python_children_of(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(60)
        self.log.close()
        wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") and
                                 open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"
                                 for pid in children), 15, "no process left behind")
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def test_hosts_join_a_frontend_host_and_serve_exactly(tiny_model, tmp_path):
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "launch.keys", str(keys), "--nodes", "a-prefill-0,b-decode-0,c-decode-0"],
                   check=True, cwd=ROOT, capture_output=True)
    base_a, base_b, base_c = free_base_port(3), free_base_port(3), free_base_port(3)
    join = f"tcp://127.0.0.1:{base_a + 1}"
    launchers = []
    try:
        # The frontend host: its frontend and prefill node, ready without any decode node.
        a = Launcher(tiny_model, tmp_path / "a.log", "--keys", str(keys), "--name-prefix", "a-",
                     "--num-prefill", "1", "--num-decode", "0", "--base-port", str(base_a))
        launchers.append(a)
        line = a.first_line()
        assert line == f"PDSERVE_ENDPOINT=tcp://127.0.0.1:{base_a}", line
        endpoint = line.split("=", 1)[1]
        with Client(endpoint) as c:
            assert set(c.stats().nodes) == {"a-prefill-0"} and not c.stats().is_ready
        for prefix, base in (("b-", base_b), ("c-", base_c)):
            h = Launcher(tiny_model, tmp_path / f"{prefix}log", "--keys", str(keys), "--name-prefix", prefix,
                         "--join", join, "--num-prefill", "0", "--num-decode", "1", "--base-port", str(base))
            launchers.append(h)
            assert h.first_line() == f"PDSERVE_JOINED={join}"
        with Client(endpoint) as c:
            stats = c.wait_ready(30, num_nodes=3)
        assert set(stats.nodes) == {"a-prefill-0", "b-decode-0", "c-decode-0"}
        assert stats.nodes["b-decode-0"]["kv_transfer"] == "auto"

        candidates = [[(11 * i + j) % 500 + 1 for j in range(5 + i)] for i in range(16)]
        prompts, expected = clear_prompts(tiny_model, candidates, 12, 8)

        async def run():
            async with AsyncClient(endpoint) as client:
                return await asyncio.gather(*[client.complete(prompt_token_ids=p, max_tokens=12, ignore_eos=True)
                                              for p in prompts])
        for r, ref in zip(asyncio.run(run()), expected):
            assert r.error is None and r.token_ids == ref
        with Client(endpoint) as c:
            nodes = c.stats().nodes
        assert nodes["b-decode-0"]["num_routed"] >= 3 and nodes["c-decode-0"]["num_routed"] >= 3

        # A host leaves: its launcher drains its node and stops, leaving nothing behind.
        assert launchers[1].stop() == 143
        wait_for(lambda: not Client(endpoint).stats().nodes["b-decode-0"]["is_alive"], 15, "b to be gone")
        with Client(endpoint) as c:
            r = c.complete(prompt_token_ids=prompts[0], max_tokens=12, ignore_eos=True)
        assert r.error is None and r.token_ids == expected[0]
    finally:
        for h in launchers:
            h.kill()


def test_a_joining_host_without_its_key_says_so_in_one_line(tiny_model, tmp_path):
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "launch.keys", str(keys), "--nodes", "a-prefill-0"],
                   check=True, cwd=ROOT, capture_output=True)
    out = subprocess.run(["bash", str(ROOT / "launch/start_cluster.sh"), "--model", str(tiny_model),
                          "--keys", str(keys), "--name-prefix", "b-", "--join", "tcp://127.0.0.1:1",
                          "--num-prefill", "0", "--num-decode", "1"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines()[-1:] == [
        f"start_cluster: {keys} has no b-decode-0.key_secret: make the keys once for every node name "
        f"(pdserve keys KEYS --nodes ...) and copy the directory to each host"]
    out = subprocess.run(["bash", str(ROOT / "launch/start_cluster.sh"), "--join", "tcp://127.0.0.1:1",
                          "--num-prefill", "0", "--num-decode", "1"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "--join needs --keys DIR" in out.stderr
