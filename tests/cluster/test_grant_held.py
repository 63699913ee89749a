"""A layer-wise ipc write held past its grant, on live processes: the prefill node is frozen
while it pushes a long prompt's KV layer by layer, for longer than the decode node's
reservation lease and the quarantine after it; its blocks go to other requests; then the
pass resumes. Defect: the write went on into blocks the decode node had granted to another
request, which then decoded on foreign KV."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from frontend.client import AsyncClient, Client
from tests.cluster_util import Processes, free_base_port, is_alive, wait_for
from tests.conftest import clear_prompts

pytestmark = pytest.mark.cluster

LEASE_S = 1.0  # the decode node's reservation lease: ends, then its quarantine, in ~2 s
NEW_TOKENS = 48
LONG_TOKENS = 160
# When each try freezes the prefill node after sending the long prompt, as a share of the
# time a prompt as long takes to its first token just before (timed on this host, in this
# load): its passes, and the write beside them, fill most of that time. NOTE: on a fast
# host a tiny model's first token comes in ~40 ms: three tries once all missed the write.
FREEZE_AT = (0.4, 0.25, 0.6, 0.15, 0.8)


def _failed_writes(stats: dict) -> int:
    """Writes the prefill node stopped (its deadline, or a grant gone), summed over backends."""
    return sum(f.get("num_failed", 0) for f in (stats.get("kv_writes") or {}).values())


def test_a_write_frozen_past_its_grant_never_lands_in_another_requests_blocks(tiny_model, tmp_path):
    candidates = [[(13 * i + 5 * j) % 390 + 3 for j in range(60)] for i in range(10)]
    others, expected = clear_prompts(tiny_model, candidates, NEW_TOKENS, 3)
    long_candidates = [[(11 * i + 3 * j) % 397 + 2 for j in range(700)] for i in range(16)]
    long_prompts, long_expected = clear_prompts(
        tiny_model, long_candidates, LONG_TOKENS, len(FREEZE_AT)
    )
    # One prefill pass of 16 tokens at a time: a 700-token prompt is ~44 passes, pushed layer
    # by layer over ipc, so a freeze soon after it starts lands while its grant is in use.
    prefill_args = ["--kv-transfer", "ipc", "--kv-layerwise", "on", "--token-budget", "16"]
    p = Processes(
        tiny_model,
        free_base_port(3),
        tmp_path,
        prefill=prefill_args,
        decode=["--reservation-lease", str(LEASE_S), "--kv-cache-memory", "1MiB"],
    )
    try:
        p.start("frontend")
        decode = p.start("decode")
        frozen = p.start("prefill", name="prefill-0")
        wait_for(lambda: _is_live(p, "prefill-0") and _is_live(p, "decode-0"), 60, "the nodes")
        with Client(p.clients) as c:  # the KV link made: the long prompt's grant comes at once
            assert c.complete(prompt_token_ids=[5] * 20, max_tokens=2).error is None
        tried = []  # (seconds to a first token, freeze after) of each try
        for attempt, (prompt, want) in enumerate(zip(long_prompts, long_expected)):
            spare = f"prefill-{attempt + 1}"
            first_token_s = _first_token_s(p, attempt, len(prompt))
            freeze_after_s = FREEZE_AT[attempt] * first_token_s
            tried.append((round(first_token_s, 3), round(freeze_after_s, 3)))
            run = _freeze_during(p, frozen, spare, prompt, others, freeze_after_s)
            (long_ids, long_error), outs = asyncio.run(run)
            p.procs[spare].send_signal(signal.SIGTERM)  # the next try's prompt goes to prefill-0
            p.procs[spare].wait(30)
            # The long prompt moved to the other prefill node, its new blocks most likely the
            # ones its frozen write held (freed last, handed out first); the others took
            # blocks meanwhile too. Each decodes on its own KV only.
            assert long_error is None and long_ids == want
            assert outs == [(ids, None) for ids in expected]
            with Client(p.clients) as c:
                if _failed_writes(c.stats().nodes.get("prefill-0", {})):
                    break  # the frozen write was stopped at its deadline: what this tests
        else:
            pytest.fail(f"the freeze never caught a write under way (tries: {tried})")
        assert is_alive(frozen.pid) and is_alive(decode.pid)  # both survived the cancel
        wait_for(lambda: _is_live(p, "prefill-0"), 30, "the frozen prefill node to serve again")
    finally:
        for proc in p.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        p.stop()


async def _freeze_during(
    p: Processes,
    frozen,
    spare: str,
    prompt: list[int],
    others: list[list[int]],
    freeze_after_s: float,
):
    """Send the long prompt, freeze its prefill node once its write is under way, and while
    it is frozen (past the lease and the quarantine) let prefill node `spare` take the long
    prompt and the others; resume it once all of them decode.
    -> ((token ids, error) of the long prompt, the same of each other prompt)."""
    async with AsyncClient(p.clients, idle_timeout_s=60) as client:
        started = asyncio.Event()
        num_started = [0]

        async def stream(ids: list[int], max_tokens: int):
            tokens, error = [], None
            async for out in client.generate(
                prompt_token_ids=ids, max_tokens=max_tokens, ignore_eos=True
            ):
                if out.token_ids and not tokens:
                    num_started[0] += 1
                    if num_started[0] == 1 + len(others):
                        started.set()
                tokens += out.token_ids
                error = out.error
            return tokens, error

        long_task = asyncio.create_task(stream(prompt, LONG_TOKENS))
        await asyncio.sleep(freeze_after_s)
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            p.start("prefill", name=spare)
            await asyncio.sleep(2.5 * LEASE_S)  # the grant ends, then its quarantine
            await asyncio.to_thread(
                wait_for, lambda: _is_live(p, spare), 60, "a second prefill node"
            )
            tasks = [asyncio.create_task(stream(ids, NEW_TOKENS)) for ids in others]
            await asyncio.wait_for(started.wait(), 60)
        finally:
            os.kill(frozen.pid, signal.SIGCONT)  # the pass goes on, its grant long gone
        return await long_task, list(await asyncio.gather(*tasks))


def _first_token_s(p: Processes, attempt: int, prompt_len: int) -> float:
    """Seconds a prompt of prompt_len tokens, new to the prefix cache, takes to its first
    token through prefill-0 now."""
    ids = [(7 * attempt + 5 * j) % 389 + 4 for j in range(prompt_len)]
    wait_for(lambda: _is_live(p, "prefill-0"), 60, "prefill-0 to serve (a try before froze it)")
    with Client(p.clients) as c:
        start = time.monotonic()
        assert c.complete(prompt_token_ids=ids, max_tokens=1).error is None
        return time.monotonic() - start


def _is_live(p: Processes, name: str) -> bool:
    """False while the frontend does not answer yet (still starting, on a busy host)."""
    try:
        with Client(p.clients) as c:
            return bool(c.stats().nodes.get(name, {}).get("is_alive"))
    except TimeoutError:
        return False
