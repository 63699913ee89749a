"""Node failure, restart, refusal and backpressure, with the processes started
one by one so that each can be killed, frozen or restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from frontend.client import AsyncClient, Client
from tests.cluster_util import Processes, free_base_port, start_streams, wait_for

pytestmark = pytest.mark.cluster  # every test here starts processes


def _nodes(endpoint):
    with Client(endpoint) as c:
        return c.stats().nodes


def _free_blocks(endpoint, name):
    node = _nodes(endpoint).get(name, {})
    return node.get("num_free_blocks") if node.get("is_alive") else None


def _start(procs: Processes, *roles):
    for role in roles:
        procs.start(role)
    with Client(procs.clients) as c:
        c.wait_ready(120)


@pytest.fixture
def procs(tiny_model, tmp_path):
    p = Processes(tiny_model, free_base_port(), tmp_path)
    yield p
    p.stop()


def test_with_migration_off_a_killed_decode_node_fails_its_requests_fast_and_a_new_one_serves(
    tiny_model, tmp_path
):
    procs = Processes(tiny_model, free_base_port(), tmp_path, frontend=["--max-migrations", "0"])
    try:
        _killed_decode_node_fails_its_requests(procs)
    finally:
        procs.stop()


def _killed_decode_node_fails_its_requests(procs: Processes) -> None:
    _start(procs, "frontend", "prefill", "decode")
    start_prefill = wait_for(lambda: _free_blocks(procs.clients, "prefill-0"), 5, "prefill stats")
    start_decode = wait_for(lambda: _free_blocks(procs.clients, "decode-0"), 5, "decode stats")

    async def stream_then_kill():
        async with AsyncClient(procs.clients, idle_timeout_s=20) as client:
            # Kill as soon as every request streams: each still has ~900 steps to go.
            tasks = await start_streams(client, 6, 900)
            assert not any(t.done() for t in tasks), "a request ended before the kill"
            killed_at = time.monotonic()
            os.kill(procs.procs["decode"].pid, signal.SIGKILL)
            return killed_at, await asyncio.gather(*tasks)

    killed_at, results = asyncio.run(stream_then_kill())
    for outs, ended_at in results:
        out = outs[-1]
        assert out.finish_reason == "error" and "decode-0" in out.error
        assert ended_at - killed_at < 5.0
    assert procs.procs["frontend"].poll() is None and procs.procs["prefill"].poll() is None
    # The surviving prefill node gets every block back.
    wait_for(
        lambda: _free_blocks(procs.clients, "prefill-0") == start_prefill,
        10,
        "prefill blocks to come back",
    )
    with Client(procs.clients) as c:
        r = c.complete("no decode node", max_tokens=3)
        assert r.finish_reason == "error" and "no live" in r.error
    procs.start("decode")
    with Client(procs.clients) as c:
        c.wait_ready(120)
        r = c.complete("served again", max_tokens=5, ignore_eos=True)
        assert r.error is None and len(r.token_ids) == 5
    wait_for(
        lambda: _free_blocks(procs.clients, "decode-0") == start_decode,
        10,
        "decode blocks to be free",
    )


@pytest.mark.parametrize("backend", ["auto", "tcp", "dist"])
def test_mixed_endings_leak_no_blocks(tiny_model, tmp_path, backend):
    """Finished, cancelled, timed-out, rejected and stop-string requests together,
    with each KV transfer backend (auto is ipc here)."""
    kv = ["--kv-transfer", backend]
    procs = Processes(tiny_model, free_base_port(), tmp_path, prefill=kv, decode=kv)
    try:
        _mixed_endings(procs)
    finally:
        procs.stop()


def _mixed_endings(procs):
    _start(procs, "frontend", "prefill", "decode")
    start = {
        n: wait_for(lambda: _free_blocks(procs.clients, n), 5, f"{n} stats")
        for n in ("prefill-0", "decode-0")
    }

    async def mix():
        async with AsyncClient(procs.clients) as client:

            async def cancelled(i):
                rid = f"c{i}"
                async for out in client.generate(
                    "cancel", request_id=rid, max_tokens=500, ignore_eos=True
                ):
                    if out.token_ids and not out.is_finished:
                        await client.abort(rid)
                    if out.is_finished:
                        return out

            jobs = [
                client.complete(f"finish {i}", max_tokens=10 + i, ignore_eos=True) for i in range(8)
            ]
            jobs += [cancelled(i) for i in range(4)]
            # NOTE: the deadline must end them, however fast decoding gets (1,000 tokens in 50 ms
            # is 20,000 steps/s)
            jobs += [
                client.complete("slow", max_tokens=1000, ignore_eos=True, timeout_s=0.05)
                for _ in range(3)
            ]
            jobs += [
                client.complete("bad", max_tokens=0),
                client.complete(prompt_token_ids=[10**6]),
            ]
            jobs += [client.complete("stop early", max_tokens=200, ignore_eos=True, stop=["e"])]
            return await asyncio.gather(*jobs)

    results = asyncio.run(mix())
    reasons = [r.finish_reason for r in results]
    assert reasons[:8] == ["length"] * 8
    assert reasons[8:12] == ["abort"] * 4 and reasons[12:15] == ["abort"] * 3
    assert reasons[15:17] == ["error"] * 2
    for name, free in start.items():
        wait_for(lambda: _free_blocks(procs.clients, name) == free, 10, f"{name} blocks back")


def test_decode_node_refuses_what_it_cannot_hold(tiny_model, tmp_path):
    # 256 KiB of KV on the decode node: 31 usable blocks of 16 tokens.
    p = Processes(tiny_model, free_base_port(), tmp_path, decode=["--kv-cache-memory", "256KiB"])
    try:
        _start(p, "frontend", "prefill", "decode")
        with Client(p.clients) as c:
            r = c.complete(prompt_token_ids=list(range(300)), max_tokens=300)
            assert r.finish_reason == "error" and "refused" in r.error and "KV blocks" in r.error
            assert c.complete("small", max_tokens=4, ignore_eos=True).error is None
    finally:
        p.stop()


def test_prompts_for_a_stalled_decode_node_wait_holding_nothing(tiny_model, tmp_path):
    """A prompt is prefilled only once its decode node has reserved blocks for it: while
    that node is stopped, prompts wait at the prefill node without taking its blocks,
    then all complete."""
    p = Processes(
        tiny_model,
        free_base_port(),
        tmp_path,
        frontend=["--dead-after", "30"],
        prefill=["--kv-cache-memory", "64KiB", "--handoff-lease", "30"],
    )
    try:
        _start(p, "frontend", "prefill", "decode")
        start = wait_for(lambda: _free_blocks(p.clients, "prefill-0"), 5, "prefill stats")
        decode = p.procs["decode"]
        decode.send_signal(signal.SIGSTOP)
        try:

            async def three():
                async with AsyncClient(p.clients) as client:
                    jobs = [
                        asyncio.create_task(
                            client.complete(
                                prompt_token_ids=[i + 1] * 40, max_tokens=4, ignore_eos=True
                            )
                        )
                        for i in range(3)
                    ]
                    stats = {}
                    for _ in range(200):  # until all three wait for their reservations
                        stats = (await client.stats()).nodes["prefill-0"]
                        if stats.get("num_unreserved") == 3:
                            break
                        await asyncio.sleep(0.05)
                    decode.send_signal(signal.SIGCONT)
                    return stats, await asyncio.gather(*jobs)

            stats, results = asyncio.run(three())
        finally:
            decode.send_signal(signal.SIGCONT)
        assert stats["num_waiting"] == 3 and stats["num_unreserved"] == 3
        assert stats["num_free_blocks"] == start and stats["num_pending_handoffs"] == 0
        assert all(r.error is None and len(r.token_ids) == 4 for r in results)
    finally:
        p.stop()


def test_unanswered_reservation_fails_within_the_handoff_lease(tiny_model, tmp_path):
    p = Processes(
        tiny_model,
        free_base_port(),
        tmp_path,
        frontend=["--dead-after", "30"],
        prefill=["--handoff-lease", "1"],
    )
    try:
        _start(p, "frontend", "prefill", "decode")
        start = wait_for(lambda: _free_blocks(p.clients, "prefill-0"), 5, "prefill stats")
        p.procs["decode"].send_signal(signal.SIGSTOP)
        try:
            with Client(p.clients) as c:
                t0 = time.monotonic()
                r = c.complete("never answered", max_tokens=4)
                assert r.finish_reason == "error" and "did not answer" in r.error
                assert time.monotonic() - t0 < 10  # not the frontend's 30 s dead-node limit
            assert _free_blocks(p.clients, "prefill-0") == start
        finally:
            p.procs["decode"].send_signal(signal.SIGCONT)
    finally:
        p.stop()


def test_the_first_token_streams_before_the_kv_reaches_the_decode_node(procs):
    """At light load a prompt starts while its reservation is on its way, and its first
    token streams from the prefill node: a stopped decode node holds back only the rest."""
    _start(procs, "frontend", "prefill", "decode")
    decode = procs.procs["decode"]
    with Client(procs.clients, idle_timeout_s=20) as c:
        # The reference, and the decode node's at-once grant that lets the next prompt start early.
        want = c.complete(prompt_token_ids=[7] * 40, max_tokens=6, ignore_eos=True)
        assert want.error is None and len(want.token_ids) == 6
        decode.send_signal(signal.SIGSTOP)
        try:
            stream = c.generate(prompt_token_ids=[7] * 40, max_tokens=6, ignore_eos=True)
            first = next(stream)
            assert first.token_ids == want.token_ids[:1] and not first.is_finished
            assert set(first.timings) >= {"queue_ms", "prefill_ms", "ttft_ms"}
            assert "kv_transfer_ms" not in first.timings  # the KV has not reached decode yet
        finally:
            decode.send_signal(signal.SIGCONT)
        rest = list(stream)
    assert rest[-1].finish_reason == "length" and rest[-1].error is None
    # The decode node's first update repeats that token: it is streamed once.
    assert first.token_ids + [t for o in rest for t in o.token_ids] == want.token_ids
    assert rest[-1].usage["completion_tokens"] == 6
    assert rest[-1].timings["kv_transfer_ms"] >= 0
