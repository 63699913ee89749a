"""Preemption on the decode node's own classes: admission reserves what a request needs
now, the newest is preempted and the oldest resumes first, and a resumed sequence goes on
token for token by swap and by recompute (under load through a cluster:
tests/cluster/test_preemption.py)."""

from __future__ import annotations

import pytest

from common.base.config import WorkerConfig
from common.base.request import SamplingParams
from common.engine.worker import DeviceWorker, PrefillChunk
from common.kv.blocks import BlockAllocator, num_blocks_for
from common.kv.sequence import Sequence
from decode_node.scheduler import DecodeScheduler
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
    assert sched.prefix_cache.num_free == 40 and sched.prefix_cache.num_reserved == 0


def test_the_newest_is_preempted_and_the_oldest_resumes_first():
    sched = DecodeScheduler(BlockAllocator(41), 16, 8)
    rx = receiver(sched, max_queue=8)
    seqs = [_start(sched, rx, rid, 40, 200) for rid in "abc"]
    assert sched.victim() is seqs[2]
    sched.preempt(seqs[2], now=1.0)
    sched.preempt(sched.victim(), now=2.0)
    assert [s.request_id for s in sched.preempted] == ["b", "c"] and list(sched.running) == ["a"]
    assert sched.prefix_cache.num_free == 37  # b's and c's blocks are back
    assert "resume first" in rx.refusal("d", 10, 10)[0]  # nothing new while they wait
    seq = sched.next_resumable()
    assert seq is seqs[1]
    blocks = sched.resume(seq, now=5.0)
    assert len(blocks) == num_blocks_for(seq.num_cached + 1, 16) and seq.preempted_s == 3.0
    assert sched.drop_preempted("c") is seqs[2] and not sched.preempted
    for rid in ("a", "b"):
        sched.finish(rid)
    assert sched.prefix_cache.num_free == 40


@pytest.mark.parametrize("kv_format", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("how", ["swap", "recompute"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=48, ignore_eos=True, num_logprobs=0),
        SamplingParams(
            max_tokens=48, ignore_eos=True, temperature=0.9, top_k=40, seed=1234, num_logprobs=0
        ),
    ],
    ids=["greedy", "seeded"],
)
def test_a_resumed_sequence_continues_token_for_token(tiny_model, how, params, kv_format):
    """Decode, preempt mid-block, clobber the freed blocks, resume in other blocks:
    the tokens equal an unpreempted run's (an 8-bit cache's scales go and come back too),
    and so do their log-probabilities: swapped back exactly; recomputed, KV written by a
    prefill where decode steps wrote it, within float tolerance (8-bit caches too)."""
    bs, prompt = 16, list(range(3, 24))
    cfg = WorkerConfig(
        model=str(tiny_model), block_size=bs, kv_cache_memory=2**20, kv_cache_dtype=kv_format
    )
    with DeviceWorker(cfg) as w:

        def run(preempt_at: int | None) -> tuple[list[int], list[float]]:
            alloc = BlockAllocator(w.num_kv_blocks)
            seq = Sequence("s", len(prompt), params, prompt_ids=prompt)
            seq.block_ids = alloc.allocate(num_blocks_for(len(prompt) + 1, bs))
            chunk = PrefillChunk(prompt, 0, seq.block_ids, params)
            (first,), _ = w.prefill([chunk])
            seq.output_ids.append(first)
            logprobs = [chunk.logprobs.logprob]
            w.decode.add("s", first, len(prompt), seq.block_ids, params)
            while len(seq.output_ids) < params.max_tokens:
                if len(seq.output_ids) == preempt_at:
                    w.decode.remove("s")
                    old = seq.block_ids
                    if how == "swap":
                        w.swap.swap_out("s", old[: num_blocks_for(seq.num_cached, bs)])
                    w.kv_cache[:, :, old] = 7.0  # the blocks go to someone else
                    seq.block_ids = alloc.allocate(num_blocks_for(seq.num_cached + 1, bs))
                    alloc.free(old)
                    assert not set(seq.block_ids) & set(old)
                    if how == "swap":
                        w.swap.swap_in("s", seq.block_ids)
                        assert w.swap.swapped_bytes == 0
                    else:
                        w.recompute(prompt + seq.output_ids[:-1], seq.block_ids, chunk_len=16)
                    w.decode.add("s", seq.output_ids[-1], seq.num_cached, seq.block_ids, params)
                if w.decode.keys_needing_block():
                    w.decode.append_block("s", seq.take_block(alloc))
                ticket = w.decode.launch()
                seq.output_ids += w.decode.collect(ticket)
                logprobs += [lp.logprob for lp in ticket.logprobs]
            w.decode.remove("s")
            return seq.output_ids, logprobs

        tokens, logprobs = run(None)
        for preempt_at in (29, 12):  # 21 + 28 = 49 tokens cached: mid-block; 32: a boundary
            got, got_logprobs = run(preempt_at)
            assert got == tokens
            if how == "swap":
                assert got_logprobs == logprobs
            else:
                assert got_logprobs == pytest.approx(logprobs, abs=1e-4)
