"""Offline generation through the worker code the nodes use: a batch prefilled, then
decoded step by step (speculative decoding's verify steps included, the draft chooser
the decode node's). launch/generate.py is its command; the tests and `pdserve bench spec`
drive it in process."""

from __future__ import annotations

import time

from common.base.request import SamplingParams, validate_prompt
from common.engine.worker import DeviceWorker, PrefillChunk
from common.kv.blocks import BlockAllocator, num_blocks_for
from common.kv.sequence import Sequence, blocks_to_join, finish_reason
from decode_node.drafts import DraftChooser


def generate(
    worker: DeviceWorker,
    prompts: list[list[int]],
    params: list[SamplingParams],
    drafts: DraftChooser | None = None,
) -> list[dict]:
    """Prefill every prompt as one batch, then decode them as one batch. With speculative
    decoding on, every step verifies as many drafts as the rows have room for, or as
    drafts (the decode node's chooser) picks.
    Returns per prompt: token_ids, finish_reason, ttft_ms, tpot_ms (its decode time over
    its tokens after the first), decode_ms_per_step, decode_s and num_decode_steps (the
    batch's), and the logprobs of each token (TokenLogprobs,
    where its params ask for them)."""
    bs, spec = worker.block_size, worker.spec
    alloc = BlockAllocator(worker.num_kv_blocks)
    seqs: dict[str, Sequence] = {}
    for i, (ids, p) in enumerate(zip(prompts, params)):
        p.validate(spec.vocab_size)
        validate_prompt(ids, p.max_tokens, spec.vocab_size, worker.max_model_len)
        seq = Sequence(str(i), len(ids), p)
        seq.num_reserved = seq.num_blocks_needed(bs)
        alloc.reserve(seq.num_reserved)
        for _ in range(num_blocks_for(len(ids), bs)):
            seq.take_block(alloc)
        seqs[seq.request_id] = seq
    t0 = time.perf_counter()
    chunks = [
        PrefillChunk(
            ids, 0, s.block_ids, s.params, s.params.split(ids) if s.params.is_processing else None
        )
        for ids, s in zip(prompts, seqs.values())
    ]
    firsts, _ = worker.prefill(chunks)
    ttft_ms = (time.perf_counter() - t0) * 1e3
    reasons: dict[str, str] = {}
    ended: dict[str, float] = {}  # key -> perf_counter when its last token was taken
    logprobs: dict[str, list] = {key: [c.logprobs] for key, c in zip(seqs, chunks)}
    for (key, seq), (ids, tok) in zip(seqs.items(), zip(prompts, firsts)):
        seq.output_ids.append(tok)
        reason = finish_reason(seq, tok, spec.eos_token_ids, worker.max_model_len)
        if reason:
            reasons[key] = reason
            seq.release(alloc)
            continue
        blocks_to_join(seq, bs, alloc)
        if drafts:
            p = seq.params
            drafts.join(key, not p.is_greedy, p.no_drafts, not p.is_plain)
        prompt, prior = seq.params.split(ids)
        worker.decode.add(
            key,
            tok,
            len(ids),
            seq.block_ids,
            seq.params,
            (prompt, prior + seq.output_ids),
            ids + seq.output_ids,
        )
    num_steps, t1 = 0, time.perf_counter()
    while worker.decode.num_seqs:
        keys = worker.decode.keys()
        if drafts and drafts.is_resting(keys):
            k = 0  # as the decode node: no limits asked while plain steps win
        else:
            k = _num_drafts(worker, [seqs[key] for key in keys])
            k = drafts.choose(keys, k) if drafts else k
        worker.decode.grow_blocks(seqs, alloc, k)
        t0 = time.perf_counter()
        # NOTE: as the decode node (with a chooser): no row has a draft, and the step runs plain
        # (timed as one: the chooser's plain time)
        if drafts and k and worker.platform.is_host and not worker.decode.propose(k):
            drafts.observe_none_proposed(keys, k)
            k, t0 = 0, time.perf_counter()
        ahead_s = time.perf_counter() - t0
        ticket = worker.decode.launch(k)
        tokens = worker.decode.collect_many(ticket)
        if drafts:
            step_s = ahead_s + ticket.busy_s + ticket.taken_s  # as the decode node counts it
            drafts.observe(keys, k, step_s, ticket.num_accepted or [0] * len(keys))
        for key, row, lp in zip(ticket.keys, tokens, ticket.logprobs or [None] * len(tokens)):
            seq = seqs[key]
            for j, tok in enumerate(row):
                seq.output_ids.append(tok)
                logprobs[key].append(lp[j] if lp else None)
                reason = finish_reason(seq, tok, spec.eos_token_ids, worker.max_model_len)
                if reason:
                    reasons[key] = reason
                    ended[key] = time.perf_counter()
                    worker.decode.remove(key)
                    seq.release(alloc)
                    if drafts:
                        drafts.forget(key)
                    break
        num_steps += 1
    decode_s = time.perf_counter() - t1
    step_ms = decode_s * 1e3 / max(num_steps, 1)
    return [
        {
            "token_ids": s.output_ids,
            "finish_reason": reasons[k],
            "ttft_ms": round(ttft_ms, 3),
            "tpot_ms": round((ended.get(k, t1) - t1) * 1e3 / max(len(s.output_ids) - 1, 1), 3),
            "decode_ms_per_step": round(step_ms, 3),
            "decode_s": decode_s,
            "num_decode_steps": num_steps,
            "logprobs": logprobs[k],
        }
        for k, s in seqs.items()
    ]


def _num_drafts(worker: DeviceWorker, seqs: list[Sequence]) -> int:
    """The drafts the next step verifies: the worker's most where no row's mask depends on
    its tokens, no more than any row has tokens left to make after the first (its blocks
    end there)."""
    v = worker.decode.verifier
    if v is None or any(s.params.is_masked_per_step for s in seqs):
        return 0
    room = min(
        min(s.params.max_tokens - len(s.output_ids) - 1 for s in seqs),
        min(worker.max_model_len - s.prompt_len - len(s.output_ids) for s in seqs),
    )
    return max(min(v.max_k, room), 0)
