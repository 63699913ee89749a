"""Preemption on the decode node: admission on what a request needs now, and a
preempted request resumed (swapped back in, or recomputed) token for token."""

from __future__ import annotations

import asyncio
import random

import pytest

from common.base.config import WorkerConfig
from common.base.request import SamplingParams
from common.engine.worker import DeviceWorker, PrefillChunk
from common.kv.blocks import BlockAllocator, num_blocks_for
from common.kv.sequence import Sequence
from decode_node.scheduler import DecodeScheduler
from frontend.client import AsyncClient, Client
from tests.cluster_util import INT_ARRAY, INT_ARRAY_PREFIX, Processes, free_base_port, wait_for
from tests.conftest import hf_greedy_gaps
from tests.handoff_util import commit, receiver, reserve, start_all


def _start(sched: DecodeScheduler, rx, rid: str, prompt_len: int, max_tokens: int) -> Sequence:
    reserve(rx, rid, prompt_len, max_tokens)
    commit(rx, rid, prompt_len, max_tokens)
    (seq,), _ = start_all(sched, rx.next_ready())
    seq.output_ids.append(1)
    return seq


def test_preemptive_admission_reserves_what_a_request_needs_now():
    sched = DecodeScheduler(BlockAllocator(41), 16, 8)  # 40 usable blocks, watermark 1
    rx = receiver(sched, max_queue=8)
    a, num_a = sched.take_blocks(40, 1000)
    assert len(a) == 3 and num_a == 0  # 41 tokens fit in 3 blocks
    b, num_b = sched.take_blocks(48, 1000)
    assert len(b) == 3 and num_b == 1  # its first output starts block 4
    assert rx.refusal("c", 40, 1000)[1] is False  # more than the whole pool
    assert rx.refusal("c", 600, 10)[1] is True  # fits the pool, not the free part
    assert rx.refusal("c", 16 * 32 - 1, 10) is None  # 32 of 33 free: 1 left, the watermark
    assert rx.refusal("c", 16 * 32, 10)[1] is True  # 33 would eat the watermark
    sched.give_back(a, num_a)
    sched.give_back(b, num_b)
    assert sched.blocks.num_free == 40 and sched.blocks.num_reserved == 0


def test_the_newest_is_preempted_and_the_oldest_resumes_first():
    sched = DecodeScheduler(BlockAllocator(41), 16, 8)
    rx = receiver(sched, max_queue=8)
    seqs = [_start(sched, rx, rid, 40, 200) for rid in "abc"]
    assert sched.victim() is seqs[2]
    sched.preempt(seqs[2], now=1.0)
    sched.preempt(sched.victim(), now=2.0)
    assert [s.request_id for s in sched.preempted] == ["b", "c"] and list(sched.running) == ["a"]
    assert sched.blocks.num_free == 37  # b's and c's blocks are back
    assert "resume first" in rx.refusal("d", 10, 10)[0]  # nothing new while they wait
    seq = sched.next_resumable()
    assert seq is seqs[1]
    blocks = sched.resume(seq, now=5.0)
    assert len(blocks) == num_blocks_for(seq.num_cached + 1, 16) and seq.preempted_s == 3.0
    assert sched.drop_preempted("c") is seqs[2] and not sched.preempted
    for rid in ("a", "b"):
        sched.finish(rid)
    assert sched.blocks.num_free == 40


@pytest.mark.parametrize("how", ["swap", "recompute"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=48, ignore_eos=True),
        SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.9, top_k=40, seed=1234),
    ],
    ids=["greedy", "seeded"],
)
def test_a_resumed_sequence_continues_token_for_token(tiny_model, how, params):
    """Decode, preempt mid-block, clobber the freed blocks, resume in other blocks:
    the tokens equal an unpreempted run's."""
    bs, prompt = 16, list(range(3, 24))
    with DeviceWorker(
        WorkerConfig(model=str(tiny_model), block_size=bs, kv_cache_memory=2**20)
    ) as w:

        def run(preempt_at: int | None) -> list[int]:
            alloc = BlockAllocator(w.num_kv_blocks)
            seq = Sequence("s", len(prompt), params, prompt_ids=prompt)
            seq.block_ids = alloc.allocate(num_blocks_for(len(prompt) + 1, bs))
            (first,), _ = w.prefill([PrefillChunk(prompt, 0, seq.block_ids, params)])
            seq.output_ids.append(first)
            w.add_decode_seq("s", first, len(prompt), seq.block_ids, params)
            while len(seq.output_ids) < params.max_tokens:
                if len(seq.output_ids) == preempt_at:
                    w.remove_decode_seq("s")
                    old = seq.block_ids
                    if how == "swap":
                        w.swap_out("s", old[: num_blocks_for(seq.num_cached, bs)])
                    w.kv_cache[:, :, old] = 7.0  # the blocks go to someone else
                    seq.block_ids = alloc.allocate(num_blocks_for(seq.num_cached + 1, bs))
                    alloc.free(old)
                    assert not set(seq.block_ids) & set(old)
                    if how == "swap":
                        w.swap_in("s", seq.block_ids)
                        assert w.swapped_bytes == 0
                    else:
                        w.recompute(prompt + seq.output_ids[:-1], seq.block_ids, chunk_len=16)
                    w.add_decode_seq("s", seq.output_ids[-1], seq.num_cached, seq.block_ids, params)
                if w.keys_needing_block():
                    w.append_block("s", seq.take_block(alloc))
                seq.output_ids += w.decode_step()
            w.remove_decode_seq("s")
            return seq.output_ids

        reference = run(None)
        assert run(29) == reference  # 21 + 28 = 49 tokens cached: mid-block
        assert run(12) == reference  # 32 cached: on a block boundary


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
    host memory for the KV of about two preempted requests."""
    p = Processes(
        tiny_model,
        free_base_port(),
        tmp_path,
        decode=["--kv-cache-memory", "160KiB", "--max-batch-size", "64", "--swap-space", "48KiB"],
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
