"""Offline generation in one process, through the same worker code the nodes use.

python -m launch.generate --model DIR --prompt TEXT [--prompt TEXT ...] --max-tokens N
"""

from __future__ import annotations

import argparse
import json
import time

from common.base.config import WorkerConfig
from common.base.request import SamplingParams, validate_prompt
from common.engine.worker import DeviceWorker, PrefillChunk
from common.kv.blocks import BlockAllocator, num_blocks_for
from common.kv.sequence import Sequence, blocks_to_join, finish_reason
from common.runtime.process import HelpFormat


def generate(
    worker: DeviceWorker, prompts: list[list[int]], params: list[SamplingParams]
) -> list[dict]:
    """Prefill every prompt as one batch, then decode them as one batch.
    Returns per prompt: token_ids, finish_reason, ttft_ms, decode_ms_per_step, and the
    logprobs of each token (TokenLogprobs, where its params ask for them)."""
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
    logprobs: dict[str, list] = {key: [c.logprobs] for key, c in zip(seqs, chunks)}
    for (key, seq), (ids, tok) in zip(seqs.items(), zip(prompts, firsts)):
        seq.output_ids.append(tok)
        reason = finish_reason(seq, tok, spec.eos_token_ids, worker.max_model_len)
        if reason:
            reasons[key] = reason
            seq.release(alloc)
            continue
        blocks_to_join(seq, bs, alloc)
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
        k = _num_drafts(worker, [seqs[key] for key in worker.decode.keys()])
        worker.decode.grow_blocks(seqs, alloc, k)
        ticket = worker.decode.launch(k)
        tokens = worker.decode.collect_many(ticket)
        for key, row, lp in zip(ticket.keys, tokens, ticket.logprobs or [None] * len(tokens)):
            seq = seqs[key]
            for tok in row:
                seq.output_ids.append(tok)
                logprobs[key].append(lp)
                reason = finish_reason(seq, tok, spec.eos_token_ids, worker.max_model_len)
                if reason:
                    reasons[key] = reason
                    worker.decode.remove(key)
                    seq.release(alloc)
                    break
        num_steps += 1
    step_ms = (time.perf_counter() - t1) * 1e3 / max(num_steps, 1)
    return [
        {
            "token_ids": s.output_ids,
            "finish_reason": reasons[k],
            "ttft_ms": round(ttft_ms, 3),
            "decode_ms_per_step": round(step_ms, 3),
            "logprobs": logprobs[k],
        }
        for k, s in seqs.items()
    ]


def _num_drafts(worker: DeviceWorker, seqs: list[Sequence]) -> int:
    """The drafts the next step verifies: the worker's most where every row is plain, no
    more than any row has tokens left to make after the first (its blocks end there)."""
    v = worker.decode.verifier
    if v is None or not all(s.params.is_plain for s in seqs):
        return 0
    return max(min(v.max_k, *(s.params.max_tokens - len(s.output_ids) - 1 for s in seqs)), 0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormat)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", action="append", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.model)
    params = SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        ignore_eos=a.ignore_eos,
    )
    cfg = WorkerConfig(model=a.model, device=a.device, dtype=a.dtype, max_batch_size=len(a.prompt))
    try:
        with DeviceWorker(cfg) as worker:
            prompts = [tokenizer.encode(text) for text in a.prompt]
            results = generate(worker, prompts, [params] * len(prompts))
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    for text, r in zip(a.prompt, results):
        r["text"] = tokenizer.decode(r["token_ids"], skip_special_tokens=True)
        if a.json:
            print(json.dumps(r))
        else:
            print(
                f"prompt: {text!r}\ntext:   {r['text']!r}\ntoken_ids: {r['token_ids']}\n"
                f"finish: {r['finish_reason']}  ttft: {r['ttft_ms']:.1f} ms  "
                f"decode: {r['decode_ms_per_step']:.2f} ms/step\n"
            )


if __name__ == "__main__":
    main()
