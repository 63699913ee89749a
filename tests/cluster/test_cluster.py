"""End to end through launch/start_cluster.sh on CPU: correctness against
transformers, batching, seeds, streaming, stop strings, cancellation, deadlines,
bad input, and that the launcher leaves nothing behind."""

from __future__ import annotations

import asyncio
import os
import pty
import select
import signal
import subprocess
import termios
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from frontend.client import AsyncClient, Client, make_request
from launch.cluster import supervisor
from tests.cluster_util import ROOT, Cluster, Processes, free_base_port, is_alive, wait_for
from tests.conftest import clear_prompts

pytestmark = pytest.mark.cluster  # every test here starts processes

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    c = Cluster(tiny_model, tmp_path_factory.mktemp("logs") / "cluster.log")
    yield c
    c.stop()


def _all_blocks_free(cluster) -> bool:
    """Every usable KV block free on every node and none reserved: nothing held, nothing leaked."""
    return all(
        s["num_free_blocks"] == s["num_usable_blocks"] and not s.get("num_reserved_blocks")
        for s in cluster.stats().values()
    )


def _prompts(n=64, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, 400, size=int(rng.randint(1, 120))).tolist() for _ in range(n)]


def test_64_concurrent_requests_match_transformers(cluster, tiny_model):
    prompts, expected = clear_prompts(tiny_model, _prompts(96), NEW_TOKENS, 64)

    async def run():
        async with AsyncClient(cluster.endpoint) as client:
            return await asyncio.gather(
                *[
                    client.complete(prompt_token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True)
                    for p in prompts
                ]
            )

    results = asyncio.run(run())
    for i, (r, ref) in enumerate(zip(results, expected)):
        assert r.error is None, r.error
        assert r.token_ids == ref, f"request {i} ({len(prompts[i])} prompt tokens) diverged"
        assert r.finish_reason == "length"
        cached = r.usage["cached_tokens"]  # a prompt sharing a block with an earlier one hits
        assert r.usage == {
            "prompt_tokens": len(prompts[i]),
            "completion_tokens": NEW_TOKENS,
            "cached_tokens": cached,
        }
        assert 0 <= cached < len(prompts[i]) and cached % 16 == 0
    # Heartbeat figures are up to one beat old: wait for them rather than sample once.
    wait_for(
        lambda: cluster.stats()["decode-0"].get("num_batched_steps", 0) > 0, 10, "batched steps"
    )
    assert cluster.stats()["decode-0"]["max_decode_batch"] > 1


def test_ttft_is_split_into_its_parts(cluster):
    with Client(cluster.endpoint) as c:
        first = next(c.generate("hello there", max_tokens=4))
        r = c.complete("hello there", max_tokens=4)
    # The first token streams from the prefill node: its parts are those before it; the
    # last message has every part, the handoff's included.
    for t, parts in (
        (first.timings, ("queue_ms", "prefill_ms", "ttft_ms")),
        (r.timings, ("queue_ms", "prefill_ms", "kv_transfer_ms", "decode_admission_ms", "ttft_ms")),
    ):
        for part in parts:
            assert t[part] is not None and t[part] >= 0, part
        assert t["ttft_ms"] >= t["prefill_ms"]
    assert r.timings["total_ms"] >= r.timings["ttft_ms"]


def test_outputs_read_during_a_stats_call_reach_their_streams(cluster):
    """Requests decoded together get their outputs in one message; the blocking client
    reads those while it waits for a stats reply and must keep every one."""
    with Client(cluster.endpoint, idle_timeout_s=10) as c:
        rids = [
            c.submit(make_request(prompt_token_ids=[5 + i] * 8, max_tokens=32, ignore_eos=True))
            for i in range(8)
        ]
        wait_for(lambda: c.stats().frontend["num_running"] == 0, 60, "the requests to finish")
        for rid in rids:
            outs = list(c.stream(rid))
            assert sum(len(o.token_ids) for o in outs) == 32 and outs[-1].finish_reason == "length"


def test_seeded_sampling_repeats_through_the_cluster(cluster):
    kw = dict(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    with Client(cluster.endpoint) as c:
        a, b = c.complete("sample me", **kw), c.complete("sample me", **kw)
        other = c.complete("sample me", **{**kw, "seed": 99})
    assert a.token_ids == b.token_ids and a.text == b.text
    assert other.token_ids != a.token_ids


def test_text_chat_and_stop_strings(cluster):
    with Client(cluster.endpoint) as c:
        full = c.complete("The day is", max_tokens=20, ignore_eos=True)
        assert full.text and full.finish_reason == "length"
        stop = full.text[len(full.text) // 2 :][:3]
        cut = c.complete("The day is", max_tokens=20, ignore_eos=True, stop=[stop])
        assert cut.finish_reason == "stop"
        assert cut.text == full.text[: full.text.index(stop)]
        chat = c.complete(
            messages=[{"role": "user", "content": "hi"}], max_tokens=5, ignore_eos=True
        )
        assert len(chat.token_ids) == 5 and chat.usage["prompt_tokens"] > 3


def _stop_beside_a_running_request(endpoint: str):
    """A request that stops on a token (one its free run first makes at index >= 3, so
    in a decode step) while another keeps the decode batch busy: (its free run, the
    stop's index, the stopped run, the busy one's tokens and finish reason)."""

    async def run():
        async with AsyncClient(endpoint) as client:
            free = await client.complete("stop here", max_tokens=30, ignore_eos=True)
            first = next(
                i for i, t in enumerate(free.token_ids) if i >= 3 and t not in free.token_ids[:i]
            )
            long_stream = client.generate("keep going", max_tokens=120, ignore_eos=True)
            long_tokens = (await long_stream.__anext__()).token_ids  # it is in the batch now
            stopped = await client.complete(
                "stop here", max_tokens=30, ignore_eos=True, stop_token_ids=[free.token_ids[first]]
            )
            async for out in long_stream:
                long_tokens += out.token_ids
            return free, first, stopped, (long_tokens, out.finish_reason)

    return asyncio.run(run())


def test_stop_token_mid_stream_beside_a_running_request(cluster):
    """On the host a step runs in its launch: no step is queued behind the stopping one
    (it would only hold the tokens back a step), so no token is made past an end."""
    discarded = cluster.stats()["decode-0"]["num_discarded_tokens"]
    free, first, stopped, long = _stop_beside_a_running_request(cluster.endpoint)
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first + 1]
    assert long == (long[0], "length") and len(long[0]) == 120
    wait_for(lambda: _all_blocks_free(cluster), 10, "every block to be free again")
    assert cluster.stats()["decode-0"]["num_discarded_tokens"] == discarded


def test_stop_token_with_steps_queued_ahead(tiny_model, tmp_path):
    """Where steps are queued (a device), the next step is launched before this one's
    tokens are read: the stopping request's row runs once more and that token is dropped.
    The node runs here, on the host, told its steps are queued."""
    from common.runtime.process import StopEvent

    p, stop, thread = Processes(tiny_model, free_base_port(), tmp_path), StopEvent(), None
    try:
        p.start("frontend")
        p.start("prefill")
        node = p.decode_node_here()
        node.worker.is_step_queued = True  # the worker is prepared as the node is made
        thread = threading.Thread(target=node.run, args=(stop,), daemon=True)
        thread.start()
        with Client(p.clients) as c:
            c.wait_ready(120, num_nodes=2)
        free, first, stopped, long = _stop_beside_a_running_request(p.clients)
        assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first + 1]
        assert long == (long[0], "length") and len(long[0]) == 120
        # The step queued behind the stopping one ran, and its token for the stopped request was
        # dropped.
        assert node.batch.num_discarded_tokens > 0
        wait_for(
            lambda: (
                not node.scheduler.running
                and node.prefix_cache.num_free == node.prefix_cache.capacity
            ),
            10,
            "every block to be free again",
        )
    finally:
        stop.set()
        if thread is not None:
            thread.join(30)
        p.stop()


def test_cancel_and_deadline_free_blocks_on_both_nodes(cluster):
    with Client(cluster.endpoint) as c:
        stream = c.generate("cancel me", max_tokens=600, ignore_eos=True, request_id="cancel-1")
        next(stream)
        next(stream)
        c.abort("cancel-1")
        last = list(stream)[-1]
        assert last.finish_reason == "abort" and "cancelled" in last.error
        timed = c.complete(
            "too slow", max_tokens=1000, ignore_eos=True, timeout_s=0.05
        )  # unfinishable in time
        assert timed.finish_reason == "abort" and "deadline" in timed.error
    wait_for(lambda: _all_blocks_free(cluster), 10, "every block to be free on both nodes")


def _raw(endpoint):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return ctx, s


def _reply(s, timeout_ms=5000):
    assert s.poll(timeout_ms), "no reply"
    return msgpack.unpackb(s.recv())


def test_bad_client_input_gets_clear_errors_and_service_goes_on(cluster):
    ctx, s = _raw(cluster.endpoint)
    cases = [
        (b"\xc1garbage", "malformed msgpack"),
        (msgpack.packb({"v": 2, "type": "launch_missiles"}), "unknown message type"),
        (msgpack.packb({"v": 2, "type": "generate"}), "missing field 'request_id'"),
        (
            msgpack.packb({"v": 2, "type": "generate", "request_id": "b1", "prompt": 5}),
            "prompt must be str",
        ),
        (
            msgpack.packb(
                {"v": 2, "type": "generate", "request_id": "b2", "prompt": "x", "max_tokens": 0}
            ),
            "max_tokens",
        ),
        (
            msgpack.packb(
                {"v": 2, "type": "generate", "request_id": "b3", "prompt": "x", "temperature": -1.0}
            ),
            "temperature",
        ),
        (
            msgpack.packb(
                {"v": 2, "type": "generate", "request_id": "b4", "prompt": "x", "top_p": 0.0}
            ),
            "top_p",
        ),
        (
            msgpack.packb(
                {
                    "v": 2,
                    "type": "generate",
                    "request_id": "b5",
                    "prompt_token_ids": [1] * 1020,
                    "max_tokens": 10,
                }
            ),
            "maximum length",
        ),
        (
            msgpack.packb(
                {"v": 2, "type": "generate", "request_id": "b6", "prompt_token_ids": [1, 100000]}
            ),
            "outside the vocabulary",
        ),
        (msgpack.packb({"v": 2, "type": "generate", "request_id": "b7"}), "exactly one of"),
        (
            msgpack.packb(
                {"v": 2, "type": "generate", "request_id": "b8", "prompt": "x", "stop": ["ok", ""]}
            ),
            "stop string must not be empty",
        ),
        (
            msgpack.packb(
                {
                    "v": 2,
                    "type": "generate",
                    "request_id": "b9",
                    "prompt": "x",
                    "allowed_token_ids": [],
                }
            ),
            "allowed_token_ids must not be empty",
        ),
        (msgpack.packb({"v": 2, "type": "abort", "request_id": "nobody"}), "unknown request_id"),
    ]
    try:
        for payload, match in cases:
            s.send(payload)
            reply = _reply(s)
            assert match in reply["error"], (match, reply)
        # A duplicate id while the first is still running is refused; the first is unharmed.
        gen = {
            "v": 2,
            "type": "generate",
            "request_id": "dup",
            "prompt": "x",
            "max_tokens": 200,
            "ignore_eos": True,
        }
        s.send(msgpack.packb(gen))
        s.send(msgpack.packb(gen))
        replies = [_reply(s) for _ in range(3)]
        assert any(r["type"] == "error" and "duplicate" in r["error"] for r in replies)
        s.send(msgpack.packb({"v": 2, "type": "abort", "request_id": "dup"}))
        # An oversized message closes that connection, and only that one.
        big_ctx, big = _raw(cluster.endpoint)
        big.send(b"\x00" * (17 * 2**20))
        assert not big.poll(500)
        big_ctx.destroy()
    finally:
        ctx.destroy()
    with Client(cluster.endpoint) as c:
        assert c.complete("still serving", max_tokens=3).finish_reason in ("length", "stop")


def test_malformed_messages_on_node_sockets_are_survived(cluster):
    """Garbage into the frontend's node endpoint and the decode node's KV endpoint."""
    for port in (cluster.base + 1, cluster.base + 2):
        ctx, s = _raw(f"tcp://127.0.0.1:{port}")
        # NOTE: these ports take CURVE keys, which this socket lacks: once the node has
        # refused the handshake, a send waits for a peer that never comes.
        s.setsockopt(zmq.SNDTIMEO, 2000)
        try:
            s.send(b"\x93\x01")
            s.send(
                msgpack.packb(
                    {
                        "v": 2,
                        "type": "kv_handoff",
                        "request_id": "evil",
                        "prompt_len": 1,
                        "first_token": 1,
                        "params": {},
                        "timings": {},
                        "tensors": [["kv", "float32", [2]]],
                    }
                ),
                zmq.SNDMORE,
            )
            s.send(b"\x00" * 3)
            s.send(
                msgpack.packb({"v": 2, "type": "heartbeat", "role": "x", "name": "y", "stats": {}})
            )
            time.sleep(0.3)
        except zmq.Again:
            pass  # refused at the handshake: nothing reached the node
        ctx.destroy()
    with Client(cluster.endpoint) as c:
        assert c.complete("after garbage", max_tokens=3).error is None
    assert all(is_alive(pid) for pid in cluster.children)


def _descendants_gone(pids):
    return all(not is_alive(p) for p in pids)


def test_sigterm_leaves_no_process(tiny_model, tmp_path):
    c = Cluster(tiny_model, tmp_path / "c.log")
    pids = c.children
    assert len(pids) >= 3
    # each process a session of its own: a terminal's ^C reaches the launcher alone
    nodes = [p for p in pids if _module(p) in ("frontend", "prefill_node", "decode_node")]
    assert len(nodes) == 3 and all(os.getsid(p) == p for p in nodes), nodes
    c.proc.send_signal(signal.SIGTERM)
    assert c.proc.wait(30) != 0
    wait_for(lambda: _descendants_gone(pids), 15, "every cluster process to exit")
    c.log.close()


def test_a_node_started_from_a_terminal_under_tostop_is_not_stopped_by_its_logs():
    """A node started from a terminal set to `stty tostop` writes its log lines to it: were
    it a background job of the launcher's session, its first one would stop it (SIGTTOU)."""
    log_line = "import sys; sys.stderr.write('a node logs\\n'); sys.stderr.flush()"
    pid, fd = pty.fork()
    if pid == 0:  # a session led by this process, the terminal its own, in the foreground
        code = 3
        try:
            attrs = termios.tcgetattr(0)
            attrs[3] |= termios.TOSTOP
            termios.tcsetattr(0, termios.TCSANOW, attrs)
            # NOTE: as a terminal's shell leaves it (ignored or blocked, it would pass unseen)
            signal.signal(signal.SIGTTOU, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTTOU})
            code = supervisor._spawn(["-c", log_line], {}).wait(20)
        finally:
            os._exit(code)
    out, status, deadline = b"", None, time.monotonic() + 30
    try:
        while status is None and time.monotonic() < deadline:
            out += _read_some(fd)
            done, st = os.waitpid(pid, os.WNOHANG)
            status = st if done else None
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the launcher's child never ended (stopped by its log line?): {out!r}")
        out += _read_some(fd)
    finally:
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0 and b"a node logs" in out, (status, out)


def _read_some(fd: int) -> bytes:
    if select.select([fd], [], [], 0.05)[0]:
        try:
            return os.read(fd, 4096)
        except OSError:  # the terminal closed
            return b""
    return b""


def _module(pid: int) -> str | None:
    """The module a Python process runs (`-m NAME`), None if none."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    return argv[argv.index(b"-m") + 1].decode() if b"-m" in argv[:-1] else None


def test_dead_child_stops_the_cluster_without_restarts(tiny_model, tmp_path):
    c = Cluster(tiny_model, tmp_path / "c.log", "--no-restart-nodes")
    pids = c.children
    decode = next(p for p in pids if b"decode_node" in open(f"/proc/{p}/cmdline", "rb").read())
    os.kill(decode, signal.SIGKILL)
    assert c.proc.wait(30) == 1
    wait_for(lambda: _descendants_gone(pids), 15, "every cluster process to exit")
    c.log.close()


def test_dead_frontend_stops_the_cluster(tiny_model, tmp_path):
    c = Cluster(tiny_model, tmp_path / "c.log")
    pids = c.children
    frontend = next(
        p
        for p in pids
        if b"-mfrontend" in open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b"")
    )
    os.kill(frontend, signal.SIGKILL)
    assert c.proc.wait(30) == 1
    wait_for(lambda: _descendants_gone(pids), 15, "every cluster process to exit")
    c.log.close()


def test_demo_command_prints_answers(tmp_path):
    env = {**os.environ, "PDSERVE_HOME": str(tmp_path)}
    base = free_base_port(4)
    out = subprocess.run(
        [
            "bash",
            str(ROOT / "launch/start_cluster.sh"),
            "--demo",
            "--base-port",
            str(base),
            "--http-port",
            str(base + 3),
        ],
        capture_output=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    text = out.stdout.decode()
    assert text.count("[length]") == 4 and "> Hello, world! How are you?" in text
    assert (tmp_path / "tiny-qwen3" / "config.json").exists()


def test_a_cluster_bound_to_every_interface_advertises_a_reachable_kv_address(tiny_model, tmp_path):
    """--host 0.0.0.0: the decode node binds the wildcard but tells prefill nodes an
    address they can connect to, and KV travels over it."""
    c = Cluster(
        tiny_model,
        tmp_path / "c.log",
        "--host",
        "0.0.0.0",
        "--advertise-host",
        "127.0.0.1",
        "--kv-transfer",
        "tcp",
    )
    try:
        decode = next(
            p for p in c.children if b"decode_node" in open(f"/proc/{p}/cmdline", "rb").read()
        )
        argv = open(f"/proc/{decode}/cmdline", "rb").read().split(b"\0")
        assert argv[argv.index(b"--kv-bind") + 1] == f"tcp://0.0.0.0:{c.base + 2}".encode()
        assert argv[argv.index(b"--kv-advertise") + 1] == f"tcp://127.0.0.1:{c.base + 2}".encode()
        with Client(c.endpoint) as client:
            r = client.complete(prompt_token_ids=[5, 6, 7], max_tokens=6, ignore_eos=True)
        assert r.finish_reason == "length" and len(r.token_ids) == 6
        wait_for(
            lambda: c.stats()["prefill-0"].get("kv_links") == {"decode-0": "tcp"},
            5,
            "the prefill node's heartbeat to name its KV link",
        )
    finally:
        c.stop()
