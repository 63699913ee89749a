"""One command per host: a frontend host and hosts that --join it, each started by
launch/start_cluster.sh with its own --name-prefix and node counts (here all on
this machine's loopback)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from common import transfer
from frontend.client import AsyncClient, Client
from tests.cluster_util import ROOT, free_base_port, is_alive, python_children_of, wait_for
from tests.conftest import clear_prompts


class Launcher:
    def __init__(self, tiny_model, log_path, *args: str):
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [
                "bash",
                str(ROOT / "launch/start_cluster.sh"),
                "--model",
                str(tiny_model),
                "--kv-cache-memory",
                "8MiB",
                "--no-http",
                "--kv-verify",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=ROOT,
            start_new_session=True,
        )

    def first_line(self) -> str:
        return self.proc.stdout.readline().decode().strip()

    def stop(self) -> int:
        children = python_children_of(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(60)
        self.log.close()
        wait_for(lambda: not any(map(is_alive, children)), 15, "no process left behind")
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.mark.cluster
def test_hosts_join_a_frontend_host_and_serve_exactly(tiny_model, tmp_path):
    keys = tmp_path / "keys"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.keys",
            str(keys),
            "--nodes",
            "a-prefill-0,b-decode-0,c-decode-0",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    base_a, base_b, base_c = free_base_port(3), free_base_port(3), free_base_port(3)
    join = f"tcp://127.0.0.1:{base_a + 1}"
    launchers = []
    try:
        # The frontend host: its frontend and prefill node, ready without any decode node.
        a = Launcher(
            tiny_model,
            tmp_path / "a.log",
            "--keys",
            str(keys),
            "--name-prefix",
            "a-",
            "--num-prefill",
            "1",
            "--num-decode",
            "0",
            "--base-port",
            str(base_a),
        )
        launchers.append(a)
        line = a.first_line()
        assert line == f"PDSERVE_ENDPOINT=tcp://127.0.0.1:{base_a}", line
        endpoint = line.split("=", 1)[1]
        with Client(endpoint) as c:
            assert set(c.stats().nodes) == {"a-prefill-0"} and not c.stats().is_ready
        for prefix, base in (("b-", base_b), ("c-", base_c)):
            h = Launcher(
                tiny_model,
                tmp_path / f"{prefix}log",
                "--keys",
                str(keys),
                "--name-prefix",
                prefix,
                "--join",
                join,
                "--num-prefill",
                "0",
                "--num-decode",
                "1",
                "--base-port",
                str(base),
            )
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
                return await asyncio.gather(
                    *[
                        client.complete(prompt_token_ids=p, max_tokens=12, ignore_eos=True)
                        for p in prompts
                    ]
                )

        for r, ref in zip(asyncio.run(run()), expected):
            assert r.error is None and r.token_ids == ref
        with Client(endpoint) as c:
            nodes = c.stats().nodes
        assert nodes["b-decode-0"]["num_routed"] >= 3 and nodes["c-decode-0"]["num_routed"] >= 3

        # A host leaves: its launcher drains its node and stops, leaving nothing behind.
        assert launchers[1].stop() == 143
        wait_for(
            lambda: not Client(endpoint).stats().nodes["b-decode-0"]["is_alive"], 15, "b to be gone"
        )
        with Client(endpoint) as c:
            r = c.complete(prompt_token_ids=prompts[0], max_tokens=12, ignore_eos=True)
        assert r.error is None and r.token_ids == expected[0]
    finally:
        for h in launchers:
            h.kill()


@pytest.mark.cluster
def test_a_joining_host_without_its_key_says_so_in_one_line(tiny_model, tmp_path):
    keys = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "launch.keys", str(keys), "--nodes", "a-prefill-0"],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    out = subprocess.run(
        [
            "bash",
            str(ROOT / "launch/start_cluster.sh"),
            "--model",
            str(tiny_model),
            "--keys",
            str(keys),
            "--name-prefix",
            "b-",
            "--join",
            "tcp://127.0.0.1:1",
            "--num-prefill",
            "0",
            "--num-decode",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines()[-1:] == [
        f"start_cluster: {keys} has no b-decode-0.key_secret: make the keys once for every "
        "node name (pdserve keys KEYS --nodes ...) and copy the directory to each host"
    ]
    out = subprocess.run(
        [
            "bash",
            str(ROOT / "launch/start_cluster.sh"),
            "--join",
            "tcp://127.0.0.1:1",
            "--num-prefill",
            "0",
            "--num-decode",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "--join needs --keys DIR" in out.stderr


def _client(hosts, endpoint: str, *args: str, timeout_s: float = 120) -> dict:
    out = hosts.run(
        "a",
        [sys.executable, "-m", "tests.netns_client", endpoint, *args],
        timeout_s=timeout_s,
        cwd=ROOT,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env() -> dict:
    # NOTE: UCX sees one machine behind the namespaces and would pick shared memory
    # transports between them; across real hosts it picks tcp (or RDMA) by itself.
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TOKENIZERS_PARALLELISM": "false",
        "UCX_TLS": "tcp",
    }


@pytest.mark.hosts
@pytest.mark.parametrize("backend", ["nixl", "tcp"])
def test_three_simulated_hosts_serve_exactly_and_survive_a_host_cut_off(
    tiny_model, tmp_path, backend
):
    """Host a: the frontend and a prefill node; hosts b and c: a decode node each, by
    the one-command-per-host contract, each host its own network namespace, hostname
    and /dev/shm. Exact tokens over both decode hosts, KV over the backend asked for
    (never ipc across hosts); then b is cut off mid-stream: its requests move to c and
    finish, b is declared dead, nothing stays held on a or c, and b serves again once back."""
    from launch.tools import netns as netns_util

    why = netns_util.why_not() or transfer.backend(backend).why_unusable(torch.device("cpu"))
    if why:
        pytest.skip(why)
    keys = tmp_path / "keys"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.keys",
            str(keys),
            "--nodes",
            "a-prefill-0,b-decode-0,c-decode-0",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    candidates = [[(13 * i + j) % 500 + 1 for j in range(6 + i)] for i in range(16)]
    prompts, expected = clear_prompts(tiny_model, candidates, 12, 8)
    with netns_util.Hosts(["a", "b", "c"]) as hosts:
        common = [
            "bash",
            str(ROOT / "launch/start_cluster.sh"),
            "--model",
            str(tiny_model),
            "--keys",
            str(keys),
            "--kv-cache-memory",
            "8MiB",
            "--no-http",
            "--kv-verify",
            "--base-port",
            "5600",
            "--kv-transfer",
            backend,
        ]
        a = hosts.popen(
            "a",
            [
                *common,
                "--host",
                hosts.addr("a"),
                "--name-prefix",
                "a-",
                "--num-prefill",
                "1",
                "--num-decode",
                "0",
            ],
            stdout=subprocess.PIPE,
            stderr=open(tmp_path / "a.log", "wb"),
            cwd=ROOT,
            env=_env(),
        )
        endpoint = f"tcp://{hosts.addr('a')}:5600"
        assert a.stdout.readline().decode().strip() == f"PDSERVE_ENDPOINT={endpoint}"
        join = f"tcp://{hosts.addr('a')}:5601"
        for name in ("b", "c"):
            h = hosts.popen(
                name,
                [
                    *common,
                    "--host",
                    hosts.addr(name),
                    "--name-prefix",
                    f"{name}-",
                    "--join",
                    join,
                    "--num-prefill",
                    "0",
                    "--num-decode",
                    "1",
                ],
                stdout=subprocess.PIPE,
                stderr=open(tmp_path / f"{name}.log", "wb"),
                cwd=ROOT,
                env=_env(),
            )
            assert h.stdout.readline().decode().strip() == f"PDSERVE_JOINED={join}"

        results = _client(hosts, endpoint, "complete", json.dumps(prompts), "12")["results"]
        assert [r["tokens"] for r in results] == expected and all(
            r["error"] is None for r in results
        )
        deadline = time.monotonic() + 20
        while (nodes := _client(hosts, endpoint, "stats")["nodes"])["a-prefill-0"].get(
            "kv_links"
        ) != {"b-decode-0": backend, "c-decode-0": backend}:
            assert time.monotonic() < deadline, nodes["a-prefill-0"].get("kv_links")
            time.sleep(0.5)
        assert nodes["b-decode-0"]["num_routed"] >= 2 and nodes["c-decode-0"]["num_routed"] >= 2

        # Host b cut off mid-stream: silence, no reset.
        streams = hosts.popen(
            "a",
            [
                sys.executable,
                "-m",
                "tests.netns_client",
                endpoint,
                "streams",
                json.dumps([[i + 1] * 9 for i in range(8)]),
                "800",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=_env(),
        )
        assert json.loads(streams.stdout.readline())["started"]
        cut_at = time.monotonic()
        hosts.cut("b")
        out, err = streams.communicate(timeout=120)
        rows = json.loads(out.strip().splitlines()[-1])["results"]
        for r in rows:
            assert r["ended_at"] - cut_at < 20 + 8, r  # ended (or moved and finished) in time
            assert r["reason"] == "length" and len(r["tokens"]) == 800, r
        assert sum(r["num_migrations"] for r in rows) >= 1, "b held some of them"
        stats = _client(hosts, endpoint, "stats")
        assert not stats["nodes"]["b-decode-0"]["is_alive"]
        results = _client(hosts, endpoint, "complete", json.dumps(prompts), "12")["results"]
        assert [r["tokens"] for r in results] == expected

        def idle() -> bool:
            n = _client(hosts, endpoint, "stats")["nodes"]
            return all(
                n[x]["num_free_blocks"] == n[x]["num_usable_blocks"]
                and not n[x].get("num_reserved_blocks")
                for x in ("a-prefill-0", "c-decode-0")
            )

        wait_for(idle, 20, "nothing held on the hosts still up")

        hosts.restore("b")
        wait_for(
            lambda: _client(hosts, endpoint, "stats")["nodes"]["b-decode-0"]["is_alive"],
            30,
            "b back",
        )
    assert not netns_util.leftover_namespaces()


@pytest.mark.cluster
def test_a_script_terminated_leaves_no_host_behind():
    """SIGTERM to a script inside `with Hosts(...)` (a timeout, a closed terminal) stops what
    runs on its hosts and removes their namespaces."""
    from launch.tools import netns as netns_util

    why = netns_util.why_not()
    if why:
        pytest.skip(why)
    script = (
        "import time\nfrom launch.tools import netns\nwith netns.Hosts(['a']) as hosts:\n"
        "    p = hosts.popen('a', ['sleep', '300'])\n    print(hosts.tag, p.pid, flush=True)\n"
        "    time.sleep(300)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=ROOT, text=True
    )
    tag, pid = proc.stdout.readline().split()
    assert any(tag in ns for ns in netns_util.leftover_namespaces())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    assert not any(tag in ns for ns in netns_util.leftover_namespaces())
    assert not is_alive(int(pid))
