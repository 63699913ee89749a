r"""8-bit KV (--kv-cache-dtype int8 | fp8) against the model's dtype, in one process, each
format's worker in turn:

    pdserve bench kv --shape qwen3-0.6b --dtype bfloat16 --batch 16 --context-len 2000

For each format: the tokens and the sequences (of --context-len plus --steps tokens) one
KV budget holds; a KV token's bytes, what a handoff sends over a link; decode TPOT, the
median of --steps steps over --batch rows of --context-len tokens each (their KV filled
with random values, no prefill: the step reads every token's K and V, where the format
pays); prefill tokens/s over --prefill-batch prompts of --prefill-len tokens, where
each layer's K and V are quantized as they are written; and against the model's dtype's
own greedy decoding of the same --prefill-batch prompts (--quality-tokens each): the share
of tokens equal to it up to each request's first difference, and the largest and mean
difference of the chosen tokens' log-probabilities there. For the model's dtype, int8 on
the KV wire (--kv-wire-dtype): a --prefill-len prompt's KV quantized (the prefill node's
cost) and dequantized (the decode node's), against its share of the prefill's time, and
its bytes against the model's dtype's. Rounds alternate the formats (a
host's memory bandwidth drifts by the minute). One JSON line per format on stdout, each
with the model's dtype's figures from the same run beside it, then a table on stderr.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from contextlib import ExitStack

import torch

from common.base.config import KV_CACHE_DTYPES, WorkerConfig
from common.base.request import SamplingParams
from common.engine.worker import DeviceWorker, PrefillChunk
from common.kv.blocks import BlockAllocator, num_blocks_for
from common.runtime.process import HelpFormat
from common.transfer import tcp
from kernels import kv_quant
from launch.bench.common import check_memory, device_name, emit, fit_len, kv_budget, resolve
from launch.bench.table import cell, show, table
from launch.tools.offline import generate


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdserve bench kv", description=__doc__, formatter_class=HelpFormat
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", help="a Hugging Face Qwen3 directory")
    g.add_argument("--shape", help="a preset shape with random weights, e.g. qwen3-0.6b")
    p.add_argument("--device", default="cpu", help="cpu, cuda:N or npu:N")
    p.add_argument("--dtype", default=None, help="default: the device's")
    p.add_argument("--formats", default="auto,int8,fp8", help="--kv-cache-dtype values")
    p.add_argument("--batch", type=int, default=16, help="decode rows")
    p.add_argument(
        "--context-len",
        type=int,
        default=None,
        help="tokens in each row (default: 2000, or as many as the model's length leaves)",
    )
    p.add_argument("--steps", type=int, default=32, help="decode steps timed a round")
    p.add_argument("--prefill-batch", type=int, default=4, help="prompts prefilled together")
    p.add_argument("--prefill-len", type=int, default=512, help="tokens in each prompt")
    p.add_argument(
        "--kv-cache-memory",
        default=None,
        metavar="SIZE",
        help="each worker's (default: what the model's dtype needs for the decode rows and "
        "the prompts)",
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds, each format in turn")
    p.add_argument("--quality-tokens", type=int, default=32, help="greedy tokens compared")
    return p.parse_args(argv)


def _decode_ms(w: DeviceWorker, batch: int, context_len: int, steps: int) -> list[float]:
    """Each of steps decode steps' time over batch rows of context_len tokens of random KV."""
    bs, alloc = w.block_size, BlockAllocator(w.num_kv_blocks)
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    blocks = [alloc.allocate(num_blocks_for(context_len + steps + 1, bs)) for _ in range(batch)]
    used = torch.tensor(sorted(b for row in blocks for b in row))
    gen = torch.Generator().manual_seed(0)
    for i in range(w.kv_cache.shape[0]):  # a layer at a time: random K and V in the format
        shape = w.kv_cache[i, :, used].shape[:-1] + (w.spec.head_dim,)
        values = torch.randn(shape, generator=gen)
        if kv_quant.is_quantized(w.kv_cache):
            w.kv_cache[i, :, used] = kv_quant.quantize(values, w.kv_cache.dtype)
        else:
            w.kv_cache[i, :, used] = values.to(w.kv_cache.dtype)
    for i, row in enumerate(blocks):
        w.decode.add(f"r{i}", 1 + i, context_len, row, params)
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            w.decode.step()
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        for i in range(batch):
            w.decode.remove(f"r{i}")
    return times


def _prefill_tokens_per_s(w: DeviceWorker, batch: int, prompt_len: int, rng) -> float:
    alloc, params = BlockAllocator(w.num_kv_blocks), SamplingParams(max_tokens=1)
    vocab = min(w.spec.vocab_size, 32_000)
    chunks = [
        PrefillChunk(
            [rng.randrange(1, vocab) for _ in range(prompt_len)],
            0,
            alloc.allocate(num_blocks_for(prompt_len, w.block_size)),
            params,
        )
        for _ in range(batch)
    ]
    t0 = time.perf_counter()
    w.prefill(chunks)
    return batch * prompt_len / (time.perf_counter() - t0)


def _wire_ms(w: DeviceWorker, prompt_len: int, rounds: int = 3) -> tuple[float, float, float]:
    """A prompt's KV as int8 on the KV wire: (quantize ms, dequantize ms, bytes over the
    cache's), the medians of rounds, on a prompt's worth of the worker's cache in the tcp
    writer's frames (each quantized as it is gathered, each dequantized as it lands)."""
    num_blocks = num_blocks_for(prompt_len, w.block_size)
    kv = w.kv_cache[:, :, 1 : 1 + num_blocks]
    layers, blocks = tcp.frame_shape(w.kv_cache, num_blocks)
    frames = [
        kv[i : i + layers, :, b : b + blocks]
        for i in range(0, kv.shape[0], layers)
        for b in range(0, num_blocks, blocks)
    ]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        rows = [kv_quant.quantize(f, torch.int8) for f in frames]
        t1 = time.perf_counter()
        for r in rows:
            kv_quant.dequantize(r, kv.dtype)
        times.append((1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t1)))
    wire_bytes = sum(r.nbytes for r in rows)
    return (*(statistics.median(t) for t in zip(*times)), wire_bytes / kv.nbytes)


def _greedy(w: DeviceWorker, prompts: list[list[int]], num_tokens: int) -> list[tuple]:
    """Each prompt's greedy tokens and their log-probabilities."""
    params = [SamplingParams(max_tokens=num_tokens, ignore_eos=True, num_logprobs=0)]
    out = generate(w, prompts, params * len(prompts))
    return [(o["token_ids"], [lp.logprob for lp in o["logprobs"]]) for o in out]


def _quality(runs: list[tuple], full: list[tuple]) -> dict:
    """Greedy agreement with the model's dtype's run: tokens equal before each request's
    first difference over all tokens, and the chosen tokens' log-probability differences
    there (the same token at the same place, after the same tokens)."""
    same, diffs = 0, []
    for (tokens, lps), (ref, ref_lps) in zip(runs, full):
        n = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), len(ref))
        same += n
        diffs += [abs(a - b) for a, b in zip(lps[: n + 1], ref_lps[: n + 1])]
    return {
        "greedy_agreement": round(same / sum(len(ref) for ref, _ in full), 3),
        "max_logprob_diff": round(max(diffs), 4),
        "mean_logprob_diff": round(sum(diffs) / len(diffs), 5),
    }


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    formats = a.formats.split(",")
    if set(formats) - set(KV_CACHE_DTYPES) or "auto" not in formats:
        print(f"error: --formats: auto and any of {KV_CACHE_DTYPES}", file=sys.stderr)
        return 2
    spec, dtype = resolve(a)
    a.context_len = fit_len(a.context_len, 2000, spec.max_position_embeddings - a.steps - 2,
                            "--context-len")  # fmt: skip
    lens = [a.context_len + a.steps + 1] * a.batch + [a.prefill_len] * a.prefill_batch
    budget = kv_budget(a, spec, dtype.itemsize, lens, 16)
    a.kv_cache_memory = a.kv_cache_memory or f"{budget // 2**20}MiB"
    # NOTE: every format's worker is held at once (they alternate): each its weights and KV
    weights = spec.num_params() * dtype.itemsize
    check_memory(a, spec, dtype.itemsize, budget * len(formats), weights * (len(formats) - 1))
    base = dict(
        model=a.model,
        shape=a.shape,
        device=a.device,
        dtype=a.dtype,
        kv_cache_memory=budget,
        max_batch_size=max(a.batch, a.prefill_batch),
        max_model_len=max(a.context_len + a.steps, a.prefill_len, 64 + a.quality_tokens) + 2,
    )
    rng = random.Random(0)
    figures = {f: {"decode_ms": [], "prefill_tokens_per_s": []} for f in formats}
    with ExitStack() as stack:
        threads = torch.get_num_threads()
        workers = {}
        for f in formats:
            torch.set_num_threads(threads)  # NOTE: a worker leaves the caller at one thread
            workers[f] = stack.enter_context(DeviceWorker(WorkerConfig(**base, kv_cache_dtype=f)))
        for w in workers.values():  # first calls at these shapes: not timed
            _decode_ms(w, a.batch, a.context_len, 2)
            _prefill_tokens_per_s(w, 1, 16, rng)
        vocab = min(spec.vocab_size, 32_000)
        prompts = [[rng.randrange(1, vocab) for _ in range(64)] for _ in range(a.prefill_batch)]
        greedy = {f: _greedy(w, prompts, a.quality_tokens) for f, w in workers.items()}
        for f in formats:
            figures[f].update(_quality(greedy[f], greedy["auto"]))
        for _ in range(a.rounds):
            for f, w in workers.items():
                figures[f]["decode_ms"] += _decode_ms(w, a.batch, a.context_len, a.steps)
                rate = _prefill_tokens_per_s(w, a.prefill_batch, a.prefill_len, rng)
                figures[f]["prefill_tokens_per_s"].append(rate)
        quantize_ms, dequantize_ms, wire_bytes = _wire_ms(workers["auto"], a.prefill_len)
        records = [_record(a, f, workers[f], figures[f], workers["auto"]) for f in formats]
        prefill_ms = 1e3 * a.prefill_len / records[formats.index("auto")]["prefill_tokens_per_s"]
        records[formats.index("auto")] |= {
            "wire_int8_quantize_ms": round(quantize_ms, 2),
            "wire_int8_dequantize_ms": round(dequantize_ms, 2),
            "wire_int8_quantize_vs_prefill": round(quantize_ms / prefill_ms, 3),
            "wire_int8_bytes_vs_auto": round(wire_bytes, 3),
        }
        records = [dict(r, **_against(r, records[formats.index("auto")])) for r in records]
    for r in records:
        emit(r)
    show(_table(records))
    return 0


def _record(a, kv_format: str, w: DeviceWorker, fig: dict, full: DeviceWorker) -> dict:
    need = num_blocks_for(a.context_len + a.steps, w.block_size)
    return {
        "bench": "kv",
        "device": device_name(a.device),
        "shape": a.shape or a.model,
        "dtype": str(full.dtype).removeprefix("torch."),
        "kv_cache_dtype": kv_format,
        "kv_cache_memory": a.kv_cache_memory,
        "token_capacity": w.num_kv_blocks * w.block_size,
        "sequences_held": (w.num_kv_blocks - 1) // need,
        "kv_bytes_per_token": w.block_bytes() // w.block_size,
        "batch": a.batch,
        "context_len": a.context_len,
        "tpot_ms": round(statistics.median(fig["decode_ms"]), 2),
        "prefill_tokens_per_s": round(statistics.median(fig["prefill_tokens_per_s"]), 1),
        "prefill_len": a.prefill_len,
        **{k: fig[k] for k in ("greedy_agreement", "max_logprob_diff", "mean_logprob_diff")},
        "quality_tokens": a.quality_tokens,
    }


def _against(r: dict, full: dict) -> dict:
    """The figures over the model's dtype's, measured in the same run (the peer)."""
    return {
        "peer": f"--kv-cache-dtype auto ({full['dtype']}), same run",
        "capacity_vs_auto": round(r["sequences_held"] / max(full["sequences_held"], 1), 2),
        "bytes_vs_auto": round(r["kv_bytes_per_token"] / full["kv_bytes_per_token"], 3),
        "tpot_vs_auto": round(r["tpot_ms"] / full["tpot_ms"], 2),
        "prefill_vs_auto": round(r["prefill_tokens_per_s"] / full["prefill_tokens_per_s"], 2),
    }


def _table(records: list[dict]) -> str:
    rows = [
        [
            r["kv_cache_dtype"],
            f"{r['sequences_held']:,}",
            f"{r['capacity_vs_auto']:.2f}x",
            f"{r['kv_bytes_per_token']:,}",
            cell(r["tpot_ms"], 2),
            f"{r['tpot_vs_auto']:.2f}x",
            f"{r['prefill_tokens_per_s']:,.0f}",
            f"{r['prefill_vs_auto']:.2f}x",
            f"{r['greedy_agreement']:.3f}",
            f"{r['max_logprob_diff']:.4f}",
        ]
        for r in records
    ]
    r0 = records[0]
    title = (
        f"KV formats: {r0['shape']} in {r0['dtype']}, {r0['device']}; decode batch "
        f"{r0['batch']} at {r0['context_len']} tokens, KV budget {r0['kv_cache_memory']}"
    )
    header = ["kv", "seqs held", "vs auto", "bytes/token", "TPOT ms", "vs auto",
              "prefill tok/s", "vs auto", "greedy same", "max |dlogp|"]  # fmt: skip
    return table(title, header, rows)


if __name__ == "__main__":
    sys.exit(main())
