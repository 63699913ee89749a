"""Preemption on the decode node: admission on what a request needs now, and a
preempted request resumed (swapped back in, or recomputed) token for token."""

from __future__ import annotations

import asyncio
import random

import pytest

from common.base.request import SamplingParams
from frontend.client import AsyncClient, Client
from tests.cluster_util import INT_ARRAY, INT_ARRAY_PREFIX, Processes, free_base_port, wait_for
from tests.conftest import hf_greedy_gaps


def _stopping_prompts(model_dir, num_prompts: int, seed: int):
    """Prompts, their greedy outputs, and for each an output index to stop on: a token's
    first appearance, 20 to 60 tokens in, before any step whose two best logits are
    within rounding of each other (no single right answer there)."""
    rng = random.Random(seed)
    candidates = [
        [rng.randrange(1, 500) for _ in range(rng.randrange(8, 30))]
        for _ in range(num_prompts * 3 // 2)
    ]
    prompts, expected, stops = [], [], []
    for ids, (out, gaps) in zip(candidates, hf_greedy_gaps(model_dir, candidates, 60)):
        clear_len = next((i for i, g in enumerate(gaps) if g < 1e-3), len(gaps))
        firsts = [i for i in range(20, clear_len) if out[i] not in out[:i]]
        if firsts and len(prompts) < num_prompts:
            prompts.append(ids)
            expected.append(out)
            stops.append(rng.choice(firsts))
    assert len(prompts) == num_prompts
    return prompts, expected, stops


@pytest.fixture
def squeezed(tiny_model, tmp_path):
    """A cluster whose decode node holds 19 blocks of 16 tokens (8 KiB each) and room in
    host memory for two blocks of preempted KV: a young request's, so that some preempted
    requests are swapped and others recomputed. NOTE: with room for about two requests
    (48 KiB), 3-6 of ~50 preemptions were recomputed alone, and none in a full suite's run."""
    p = Processes(
        tiny_model,
        free_base_port(),
        tmp_path,
        decode=["--kv-cache-memory", "160KiB", "--max-batch-size", "64", "--swap-space", "16KiB"],
        frontend=["--dead-after", "10"],
    )
    for role in ("frontend", "prefill", "decode"):
        p.start(role)
    with Client(p.clients) as c:
        c.wait_ready(120)
    yield p
    p.stop()


def _decode_stats(p: Processes) -> dict:
    with Client(p.clients) as c:
        return c.stats().nodes.get("decode-0", {})


def test_64_requests_far_past_the_pool_all_complete_token_exact(squeezed, tiny_model):
    """max_tokens 200 (14 blocks with the prompt) for each of 64 requests on 19 blocks:
    full reservation would run one at a time. Each greedy request stops on a token of
    its own at 21 to 60 outputs, so the pool runs out mid-flight again and again."""
    prompts, expected, stops = _stopping_prompts(tiny_model, 64, 7)
    seeded = [
        SamplingParams(max_tokens=40, temperature=0.8, top_k=50, seed=100 + i, ignore_eos=True)
        for i in range(8)
    ]

    async def burst():
        async with AsyncClient(squeezed.clients, idle_timeout_s=120) as client:
            greedy = [
                client.complete(
                    prompt_token_ids=ids, max_tokens=200, ignore_eos=True, stop_token_ids=[out[k]]
                )
                for ids, out, k in zip(prompts, expected, stops)
            ]
            sampled = [
                client.complete(
                    prompt_token_ids=prompts[i],
                    max_tokens=p.max_tokens,
                    temperature=p.temperature,
                    top_k=p.top_k,
                    seed=p.seed,
                    ignore_eos=True,
                )
                for i, p in enumerate(seeded)
            ]
            return await asyncio.gather(*greedy, *sampled)

    results = asyncio.run(burst())
    for r, out, k in zip(results, expected, stops):
        assert r.error is None and r.finish_reason == "stop"
        assert r.token_ids == out[: k + 1]
    stats = wait_for(
        lambda: (s := _decode_stats(squeezed)).get("num_finished", 0) >= 72 and s,
        10,
        "a heartbeat after the burst",
    )
    assert stats["num_preemptions"] > 0 and stats["num_swapped"] > 0 and stats["num_recomputed"] > 0
    assert any(
        r.timings.get("num_preemptions", 0) > 0 and r.timings.get("preempted_ms", -1) >= 0
        for r in results
    )
    # Nothing left behind: every block free, no swapped KV, nobody waiting.
    wait_for(
        lambda: (
            (s := _decode_stats(squeezed))["num_free_blocks"] == s["num_usable_blocks"]
            and s["swapped_bytes"] == 0
            and s["num_preempted"] == 0
        ),
        10,
        "every block back",
    )

    # Seeded sampling: each request again, alone (never preempted), gives the same tokens.
    with Client(squeezed.clients) as c:
        for i, (p, r) in enumerate(zip(seeded, results[64:])):
            alone = c.complete(
                prompt_token_ids=prompts[i],
                max_tokens=p.max_tokens,
                temperature=p.temperature,
                top_k=p.top_k,
                seed=p.seed,
                ignore_eos=True,
            )
            assert alone.token_ids == r.token_ids and len(r.token_ids) == 40
    before = _decode_stats(squeezed)["num_preemptions"]
    assert (
        wait_for(lambda: _decode_stats(squeezed)["num_finished"] >= 80, 10, "a heartbeat")
        and _decode_stats(squeezed)["num_preemptions"] == before
    )


@pytest.mark.cluster
def test_prompts_prefilled_on_a_squeezed_decode_node_are_preempted_and_cached_token_exact(
    tiny_model, tmp_path
):
    """--disaggregate never on the 19-block decode node: prompts prefilled there run out
    of blocks mid-flight, are preempted and resumed; finished ones leave their blocks in
    its prefix cache, evicted as the pool needs them; a second wave of the same prompts
    finds some of them. Every token as transformers', every block back."""
    p = Processes(
        tiny_model,
        free_base_port(),
        tmp_path,
        decode=["--kv-cache-memory", "160KiB", "--max-batch-size", "64", "--swap-space", "48KiB"],
        frontend=["--dead-after", "10", "--disaggregate", "never"],
    )
    try:
        for role in ("frontend", "prefill", "decode"):
            p.start(role)
        with Client(p.clients) as c:
            c.wait_ready(120)
        prompts, expected, stops = _stopping_prompts(tiny_model, 24, 5)

        async def wave():
            async with AsyncClient(p.clients, idle_timeout_s=120) as client:
                return await asyncio.gather(
                    *(
                        client.complete(
                            prompt_token_ids=ids,
                            max_tokens=200,
                            ignore_eos=True,
                            stop_token_ids=[out[k]],
                        )
                        for ids, out, k in zip(prompts, expected, stops)
                    )
                )

        for _ in range(2):
            for r, out, k in zip(asyncio.run(wave()), expected, stops):
                assert r.error is None and r.token_ids == out[: k + 1], r.error
                assert r.timings["path"] == "local"
        stats = wait_for(
            lambda: (s := _decode_stats(p)).get("num_local_prefilled", 0) >= 48 and s,
            10,
            "a heartbeat after both waves",
        )
        assert stats["num_preemptions"] > 0 and stats["num_prefix_evictions"] > 0
        wait_for(
            lambda: (
                (s := _decode_stats(p))["num_free_blocks"] == s["num_usable_blocks"]
                and s["num_preempted"] == 0
                and not s["num_local_waiting"]
            ),
            10,
            "every block back",
        )
    finally:
        p.stop()


@pytest.mark.cluster
def test_full_prefill_and_decode_pools_never_wait_on_each_other(tiny_model, tmp_path):
    """Both pools squeezed and the decode node's reservation lease 2 s. A prompt is
    prefilled only once its decode blocks are reserved; otherwise prompts computed for
    a full decode node fill the prefill pool while the decode node's blocks wait for
    prompts queued behind them, until leases run out and requests fail. Waiting
    reservations are renewed, so none runs out while its prefill node lives."""
    p = Processes(
        tiny_model,
        free_base_port(),
        tmp_path,
        prefill=["--kv-cache-memory", "48KiB"],
        decode=[
            "--kv-cache-memory",
            "160KiB",
            "--max-batch-size",
            "64",
            "--swap-space",
            "48KiB",
            "--reservation-lease",
            "2",
        ],
        frontend=["--dead-after", "10"],
    )
    try:
        for role in ("frontend", "prefill", "decode"):
            p.start(role)
        with Client(p.clients) as c:
            c.wait_ready(120)
        prompts, expected, stops = _stopping_prompts(tiny_model, 64, 11)

        async def burst():
            async with AsyncClient(p.clients, idle_timeout_s=120) as client:
                return await asyncio.gather(
                    *(
                        client.complete(
                            prompt_token_ids=ids,
                            max_tokens=200,
                            ignore_eos=True,
                            stop_token_ids=[out[k]],
                        )
                        for ids, out, k in zip(prompts, expected, stops)
                    )
                )

        for r, out, k in zip(asyncio.run(burst()), expected, stops):
            assert r.error is None and r.token_ids == out[: k + 1]
        stats = wait_for(
            lambda: (s := _decode_stats(p)).get("num_finished", 0) >= 64 and s, 10, "a heartbeat"
        )
        assert stats["num_expired_reservations"] == 0 and stats["num_preemptions"] > 0
        assert stats["num_granted"] > 0  # requests waited in the decode node's line
        wait_for(
            lambda: (s := _decode_stats(p))["num_free_blocks"] == s["num_usable_blocks"],
            10,
            "every decode block back",
        )

        def prefill_free():
            with Client(p.clients) as c:
                s = c.stats().nodes["prefill-0"]
            return s["num_free_blocks"] == s["num_usable_blocks"]

        wait_for(prefill_free, 10, "every prefill block back")  # a heartbeat may be a beat old
    finally:
        p.stop()


def test_a_grammar_holds_across_preemptions(squeezed):
    """Seeded requests under a JSON schema on a pool far too small for them: preempted
    (swapped or recomputed) and resumed, each streams what it streams alone, valid to
    its schema: the matcher is the sequence's and waits with it."""
    import re

    from common.wire.client import Structured

    kw = [
        dict(
            prompt_token_ids=[(11 * i + j) % 500 + 1 for j in range(20)],
            max_tokens=100,
            temperature=0.9,
            seed=50 + i,
            ignore_eos=True,
            structured=Structured("json_schema", INT_ARRAY),
        )
        for i in range(16)
    ]
    before = _decode_stats(squeezed).get("num_preemptions", 0)

    async def burst():
        async with AsyncClient(squeezed.clients, idle_timeout_s=120) as client:
            return await asyncio.gather(*[client.complete(**k) for k in kw])

    results = asyncio.run(burst())
    stats = wait_for(
        lambda: (s := _decode_stats(squeezed)).get("num_finished", 0) >= 16 and s, 10, "a heartbeat"
    )
    assert stats["num_preemptions"] > before
    with Client(squeezed.clients) as c:
        for k, r in zip(kw, results):
            assert r.error is None and len(r.token_ids) == 100
            assert re.fullmatch(INT_ARRAY_PREFIX, r.text), r.text
            assert c.complete(**k).token_ids == r.token_ids
