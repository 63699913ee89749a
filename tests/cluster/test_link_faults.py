"""Faults that kill no process: connections reset or stalled by a middlebox between
hosts (tests/tcp_proxy.py stands in the node and KV links of a joined decode host),
a prefill node lost with reservations held, and clients whose requests would make
the frontend's loop stop. Nothing may hang, be lost, be decoded wrong or stay held."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from frontend.client import AsyncClient, Client
from tests.cluster_util import ROOT, Cluster, Processes, free_base_port, wait_for
from tests.conftest import clear_prompts
from tests.tcp_proxy import Proxy

pytestmark = pytest.mark.cluster  # every test here starts processes


def _launcher(tiny_model, log, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
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
        stderr=open(log, "wb"),
        cwd=ROOT,
        start_new_session=True,
    )


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _idle(nodes: dict, names) -> bool:
    """Every block back on these nodes (from their last heartbeat)."""
    return all(
        nodes[n].get("num_free_blocks") == nodes[n].get("num_usable_blocks")
        and not nodes[n].get("num_reserved_blocks")
        and not nodes[n].get("num_reservations")
        for n in names
    )


async def _stream(client: AsyncClient, prompt: list[int], max_tokens: int, started: asyncio.Event):
    outs = []
    async for out in client.generate(
        prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True
    ):
        started.set()
        outs.append(out)
    return outs


@pytest.mark.parametrize("is_keyed", [True, False], ids=["keys", "open"])
def test_a_joined_decode_hosts_links_reset_mid_stream_and_mid_write_lose_nothing(
    tiny_model, tmp_path, is_keyed
):
    """A frontend host and a decode host that joins it through a middlebox: its node link
    (requests, tokens, heartbeats) and its KV link each pass a proxy, the KV link slowed
    so that writes take a while. Every connection of the decode host is reset while 8
    greedy streams run, and again while 8 more are being handed off: all 16 finish with
    the undisturbed tokens, with no error, and every block comes back. With keys a
    reconnected peer has a new routing id; on open links, the same one."""
    keys = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "launch.keys", str(keys), "--nodes", "a-prefill-0,b-decode-0"],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    link_args = ["--keys", str(keys)] if is_keyed else ["--no-keys"]
    base_a, base_b = free_base_port(3), free_base_port(3)
    max_tokens = 40
    candidates = [[(7 * i + 3 * j) % 400 + 1 for j in range(160 + 9 * i)] for i in range(28)]
    prompts, expected = clear_prompts(tiny_model, candidates, max_tokens, 16)
    # NOTE: tcp, as between hosts (on one host auto would pick ipc, which sends no KV on the link).
    a = _launcher(
        tiny_model,
        tmp_path / "a.log",
        *link_args,
        "--name-prefix",
        "a-",
        "--num-prefill",
        "1",
        "--num-decode",
        "0",
        "--base-port",
        str(base_a),
        "--kv-transfer",
        "tcp",
    )
    b = None
    with Proxy(base_a + 1) as node_link, Proxy(base_b + 2, rate_bytes_s=400e3) as kv_link:
        try:
            endpoint = a.stdout.readline().decode().strip().split("=", 1)[1]
            b = _launcher(
                tiny_model,
                tmp_path / "b.log",
                *link_args,
                "--name-prefix",
                "b-",
                "--join",
                node_link.endpoint,
                "--num-prefill",
                "0",
                "--num-decode",
                "1",
                "--base-port",
                str(base_b),
                "--kv-transfer",
                "tcp",
                "--decode-arg",
                "--kv-advertise",
                "--decode-arg",
                kv_link.endpoint,
            )
            assert b.stdout.readline().decode().strip() == f"PDSERVE_JOINED={node_link.endpoint}"
            with Client(endpoint) as c:
                c.wait_ready(60, num_nodes=2)

            async def run():
                async with AsyncClient(endpoint, idle_timeout_s=120) as client:
                    started = [asyncio.Event() for _ in prompts]
                    tasks = [
                        asyncio.create_task(_stream(client, p, max_tokens, e))
                        for p, e in zip(prompts[:8], started)
                    ]
                    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started[:8])), 60)
                    num_connections = node_link.num_connections + kv_link.num_connections
                    resets = [node_link.reset() + kv_link.reset()]  # mid-stream
                    deadline = time.monotonic() + 30
                    while (
                        node_link.num_connections + kv_link.num_connections
                        < num_connections + resets[0]
                    ):
                        assert time.monotonic() < deadline, "the decode host did not connect again"
                        await asyncio.sleep(0.05)
                    written = (await client.stats()).nodes["a-prefill-0"]["num_kv_bytes_written"]
                    tasks += [
                        asyncio.create_task(_stream(client, p, max_tokens, e))
                        for p, e in zip(prompts[8:], started[8:])
                    ]
                    # Their KV on its way: written (queued on the link, which the proxy slows) and
                    # not yet committed.
                    while not (
                        (n := (await client.stats()).nodes["a-prefill-0"])["num_kv_bytes_written"]
                        > written
                        and n["num_pending_handoffs"]
                    ):
                        assert time.monotonic() < deadline, "no KV write was seen under way"
                        await asyncio.sleep(0.05)
                    resets.append(node_link.reset() + kv_link.reset())  # mid-write
                    return resets, await asyncio.wait_for(asyncio.gather(*tasks), 240)

            resets, results = asyncio.run(run())
            assert all(n >= 2 for n in resets), (
                resets
            )  # node, heartbeat and KV connections were reset
            for outs, ref in zip(results, expected):
                last = outs[-1]
                assert last.error is None and last.finish_reason == "length", last.error
                assert [t for o in outs for t in o.token_ids] == ref
            with Client(endpoint) as c:
                wait_for(
                    lambda: _idle(c.stats().nodes, ("a-prefill-0", "b-decode-0")),
                    30,
                    "every block back",
                )
                stats = c.stats()
            decode, prefill = stats.nodes["b-decode-0"], stats.nodes["a-prefill-0"]
            assert decode["num_link_resets"] >= 1 and prefill["num_link_resets"] >= 1
            assert decode["num_kv_verify_failures"] == 0
            assert stats.frontend["migrations"]["failed"] == 0
        finally:
            _stop(*(p for p in (a, b) if p is not None))


@pytest.mark.parametrize("backend", ["tcp", "dist"])
def test_a_decode_node_silent_mid_write_frees_the_prefill_side_in_time(
    tiny_model, tmp_path, backend
):
    """The decode node's KV link goes silent (a stalled middlebox: connections open,
    nothing passes) after it granted reservations and before the writes into them end:
    the prefill node holds none of its blocks past the reservation lease and a margin."""
    base = free_base_port(4)
    lease_s = 6.0
    with Proxy(base + 2) as kv_link:
        # NOTE: no moves: a request that fails here would come back to the same silent link,
        # and what is measured is what the handoffs under way at the stall hold.
        p = Processes(
            tiny_model,
            base,
            tmp_path,
            frontend=["--max-migrations", "0"],
            prefill=["--kv-transfer", backend, "--token-budget", "16"],
            decode=[
                "--kv-transfer",
                backend,
                "--reservation-lease",
                str(lease_s),
                "--kv-advertise",
                kv_link.endpoint,
            ],
        )
        try:
            for role in ("frontend", "prefill", "decode"):
                p.start(role)
            with Client(p.clients) as c:
                c.wait_ready(120, num_nodes=2)
                assert (
                    c.complete(prompt_token_ids=[5] * 30, max_tokens=4).error is None
                )  # links made

            def nodes() -> dict:
                with Client(p.clients) as c:
                    return c.stats().nodes

            def prefill_holds() -> bool:
                n = nodes()["prefill-0"]
                return n.get("num_free_blocks") != n.get("num_usable_blocks") or bool(
                    n.get("num_pending_handoffs")
                )

            async def run():
                async with AsyncClient(p.clients, idle_timeout_s=120) as client:
                    # Granted at once; prefilled one after another (16 tokens a pass), then written.
                    kv_link.stall_on(b"kv_transfer")
                    jobs = [
                        asyncio.create_task(
                            client.complete(
                                prompt_token_ids=[i + 2] * 900, max_tokens=8, ignore_eos=True
                            )
                        )
                        for i in range(6)
                    ]
                    deadline = time.monotonic() + 30
                    while (
                        not kv_link.is_stalled
                    ):  # stalls as the first write goes (open links: readable)
                        assert time.monotonic() < deadline, "no write began"
                        await asyncio.sleep(0.01)
                    stalled_at = time.monotonic()
                    while not await asyncio.to_thread(
                        prefill_holds
                    ):  # its heartbeat says so within 0.5 s
                        assert time.monotonic() - stalled_at < 3, (
                            "the prefill node held nothing when it stalled"
                        )
                        await asyncio.sleep(0.05)
                    while await asyncio.to_thread(prefill_holds):
                        assert time.monotonic() - stalled_at < lease_s + 6, (
                            f"the prefill node still holds: {nodes()['prefill-0']}"
                        )
                        await asyncio.sleep(0.2)
                    freed_after = time.monotonic() - stalled_at
                    kv_link.resume()
                    return freed_after, await asyncio.wait_for(asyncio.gather(*jobs), 120)

            freed_after, results = asyncio.run(run())
            assert all(r.finish_reason in ("length", "error") for r in results)  # ended, none hangs
            with Client(p.clients) as c:
                r = c.complete(prompt_token_ids=[9] * 40, max_tokens=4, ignore_eos=True)
                assert r.error is None and len(r.token_ids) == 4
                wait_for(
                    lambda: _idle(c.stats().nodes, ("prefill-0", "decode-0")),
                    lease_s + 10,
                    "every block back",
                )
        finally:
            p.stop()


def test_a_lost_prefill_nodes_reservations_are_freed_at_once(tiny_model, tmp_path):
    """SIGKILL of the only prefill node with prompts queued: its reservations on the decode
    node go when its successor registers, not when their 30 s lease ends."""
    c = Cluster(
        tiny_model, tmp_path / "c.log", "--token-budget", "16"
    )  # prompts granted long before done
    try:

        async def run():
            async with AsyncClient(c.endpoint, idle_timeout_s=120) as client:
                jobs = [
                    asyncio.create_task(
                        client.complete(
                            prompt_token_ids=[i % 300 + 1] * 500, max_tokens=16, ignore_eos=True
                        )
                    )
                    for i in range(24)
                ]
                deadline = time.monotonic() + 30
                while (await client.stats()).nodes["decode-0"].get("num_reservations", 0) < 3:
                    assert time.monotonic() < deadline, "no reservations held"
                    await asyncio.sleep(0.05)
                old = (await client.stats()).nodes["prefill-0"]["pid"]
                os.kill(old, signal.SIGKILL)
                killed_at = time.monotonic()
                while (n := (await client.stats()).nodes["prefill-0"])["pid"] == old or not n[
                    "is_alive"
                ]:
                    assert time.monotonic() - killed_at < 30, "the prefill node was not restarted"
                    await asyncio.sleep(0.1)
                return killed_at, await asyncio.wait_for(asyncio.gather(*jobs), 240)

        killed_at, results = asyncio.run(run())
        assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
        # NOTE: one heartbeat's figures, both read from it: a later read may be another beat.
        seen = wait_for(
            lambda: (
                (s := c.stats())["decode-0"].get("num_peer_drops", 0) >= 1
                and _idle(s, ("prefill-0", "decode-0"))
                and s
            ),
            10,
            "every block back, freed as the node was lost",
        )
        assert time.monotonic() - killed_at < 30 - 5  # well before the lease could have freed them
        assert seen["decode-0"]["num_expired_reservations"] == 0, seen["decode-0"]
    finally:
        c.stop()


ATTACKER = r"""
import json, sys, time
import zmq, msgpack
endpoint, vocab = sys.argv[1], int(sys.argv[2])
attacks = [("ids", {"prompt_token_ids": [i % vocab for i in range(4_000_000)]}),
           ("text", {"prompt": "lorem ipsum dolor sit amet " * 310_000}),
           ("stops", {"prompt": "hello", "stop": [f"stop string {i} " * 8 for i in range(20_000)]}),
           # 8 KB of JSON schema nested 300 deep: seconds of compiling
           ("grammar", {"prompt": "hello",
                        "structured": {"kind": "json_schema",
                                       "spec": '{"type": "array", "items": ' * 300
                                               + '{"type": "integer"}' + "}" * 300}})]
frames = [(name, msgpack.packb({"v": 2, "type": "generate", "request_id": name,
                                "max_tokens": 4, **body}))
          for name, body in attacks]   # made before the first goes: only sending is timed
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.connect(endpoint)
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
out = {}
for name, frame in frames:
    t0 = time.monotonic()
    s.send(frame)
    assert s.poll(120_000), name
    reply = msgpack.unpackb(s.recv(), raw=False)
    out[name] = {"error": reply.get("error"), "s": round(time.monotonic() - t0, 3)}
print(json.dumps(out), flush=True)
"""


def _attack_at(t: float, phase: dict, report: dict) -> str:
    """The attack under way at time t (the attacker sends them one after another, each
    once the one before is answered), and each one's seconds."""
    end = phase["attack"]
    for name, out in report.items():
        end += out["s"]
        if t <= end:
            break
    return f"{name} ({t - phase['attack']:.3f}s in); " + ", ".join(
        f"{k} {v['s']}s" for k, v in report.items()
    )


def test_client_attacks_get_clear_errors_and_stall_no_other_stream(tiny_model, tmp_path):
    """4M token ids, an 8 MB prompt, 20,000 stop strings and a grammar that takes seconds to
    compile, one after another, while four streams run: each attack is refused with a
    clear error (the grammar before any node sees it), and the streams' largest gap
    between tokens stays under 250 ms (or 5x their largest gap before); none fails or moves."""
    c = Cluster(tiny_model, tmp_path / "c.log", "--no-http")
    attacker = subprocess.Popen(
        [sys.executable, "-c", ATTACKER, c.endpoint, "512"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert json.loads(attacker.stdout.readline())["ready"]

        async def run():
            async with AsyncClient(c.endpoint, idle_timeout_s=120) as client:
                arrivals: list[list[float]] = [[] for _ in range(4)]
                phase = {"attack": None}

                async def stream(i: int):
                    outs = []
                    async for out in client.generate(
                        prompt_token_ids=[i + 5] * 12, max_tokens=700, ignore_eos=True
                    ):
                        arrivals[i].append(time.monotonic())
                        outs.append(out)
                    return outs

                tasks = [asyncio.create_task(stream(i)) for i in range(4)]
                while min(len(a) for a in arrivals) < 60:
                    await asyncio.sleep(0.05)
                phase["attack"] = time.monotonic()
                attacker.stdin.write(b"go\n")
                attacker.stdin.flush()
                report = json.loads(await asyncio.to_thread(attacker.stdout.readline))
                phase["end"] = time.monotonic()
                return phase, arrivals, report, await asyncio.gather(*tasks)

        phase, arrivals, report, results = asyncio.run(run())
        assert "holds more than" in report["ids"]["error"], report
        assert "characters" in report["text"]["error"] or "tokens" in report["text"]["error"], (
            report
        )
        assert "stop" in report["stops"]["error"] and "than" in report["stops"]["error"], report
        assert "to compile" in report["grammar"]["error"], report

        before = max(b - a for t in arrivals for a, b in zip(t, t[1:]) if b <= phase["attack"])
        during, ended = max(
            (b - a, b)
            for t in arrivals
            for a, b in zip(t, t[1:])
            if phase["attack"] <= b <= phase["end"]
        )
        assert during < max(0.25, 5 * before), (during, before, _attack_at(ended, phase, report))
        for outs in results:
            assert outs[-1].finish_reason == "length" and not (outs[-1].timings or {}).get(
                "num_migrations"
            )
    finally:
        attacker.kill()
        c.stop()


def test_a_killed_launcher_leaves_no_secret_keys_behind(tiny_model, tmp_path):
    """SIGKILL of start_cluster.sh itself: its nodes and frontend stop (they die with it),
    and the frontend takes the key directory made for that cluster with it."""
    from tests.cluster_util import is_alive, python_children_of

    c = Cluster(tiny_model, tmp_path / "c.log", "--no-http")
    try:
        frontend = next(
            pid
            for pid in c.children
            if b"frontend" in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[2]
        )
        argv = open(f"/proc/{frontend}/cmdline", "rb").read().decode().split("\0")
        keys = argv[argv.index("--keys") + 1]
        assert os.path.isdir(keys) and any(n.endswith(".key_secret") for n in os.listdir(keys))
        children = python_children_of(c.proc.pid)
        os.kill(c.proc.pid, signal.SIGKILL)  # the launcher alone: no trap runs
        wait_for(
            lambda: not any(map(is_alive, children)), 60, "every process of the cluster to stop"
        )
        assert not os.path.exists(keys)
    finally:
        c._kill()


@pytest.mark.parametrize("module", ["frontend", "prefill_node", "decode_node"])
def test_a_process_whose_launcher_ended_before_its_imports_does_not_start(module):
    """Defect: a process tied its life to its launcher's (PR_SET_PDEATHSIG) after its
    imports, seconds of torch, so a launcher killed meanwhile left it to load and serve with
    no one to stop it. It now ties it first thing, and ends there if the launcher named in
    its environment is no longer its parent, before importing anything heavy."""
    from common.base.env import PARENT_PID_ENV

    gone = subprocess.Popen(["true"])
    gone.wait()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-X", "importtime", "-m", module, "--help"]
    done = subprocess.run(
        argv, env={**env, PARENT_PID_ENV: str(gone.pid)}, capture_output=True, timeout=120
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"{module}: its launcher (pid {gone.pid}) ended before it started".encode() in (
        done.stderr
    )
    assert b" torch" not in done.stderr and b"zmq" not in done.stderr  # nothing heavy loaded
    # started by the launcher it names (this test), it goes on
    done = subprocess.run(
        argv, env={**env, PARENT_PID_ENV: str(os.getpid())}, capture_output=True, timeout=120
    )
    assert done.returncode == 0 and b"usage:" in done.stdout, done.stderr[-2000:]
