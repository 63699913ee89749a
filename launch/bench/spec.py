r"""Speculative decoding against plain decoding, in one process, on the decode node's own
batch code and draft chooser (launch/tools/offline.py drives them as the node's loop does).

    pdserve bench spec --shape qwen3-0.6b --dtype bfloat16 --batch-sizes 1,8,32 \
        --prompt-len 256 --output-len 64 \
        [--speculative-config '{"method": "suffix", "num_speculative_tokens": 4}']

For each batch size and each of --rounds rounds, new random prompts (ignore_eos), the two
workers in turn (a host's memory bandwidth drifts by the minute), as --loads asks:
- greedy: speculation off (the baseline), then on twice, `fresh` (not seen before: what
  prompt lookup and suffix decoding find in the prompts, the outputs and other requests')
  and `repeat` (the same requests asked again: suffix decoding's cache holds their
  answers, as an edit's output holds its input), then off again;
- `sampled`: other new prompts at temperature 1.0, each request seeded, off, on, off: drafts
  that almost never match, which the draft chooser must turn down.
Both workers first serve a batch of other prompts (greedy, and sampled where that load
runs), as a running node has: its draft chooser has measured its kinds of steps. One
JSON line per (batch size, load) on stdout, then a table on stderr: decode tokens/s and
the requests' time per output token (p50) against the baseline's in the same run, the
accepted drafts per verify step and row, the share of steps that verified, and whether
the tokens equal the baseline's (they must: a verify step makes plain decoding's tokens,
a seeded draw included).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from contextlib import ExitStack

import torch

from common.base.config import WorkerConfig, parse_bytes
from common.base.parse import DTYPES
from common.base.request import SamplingParams
from common.base.speculative import SpeculativeConfig, parse_speculative
from common.engine.platform import platform_type
from common.engine.worker import DeviceWorker
from common.kv.blocks import num_blocks_for
from common.runtime.process import HelpFormat, freeze_startup_objects
from decode_node.drafts import DraftChooser
from launch.bench.common import device_name, emit
from launch.bench.table import cell, show, table
from launch.tools.offline import generate

DEFAULT_CONFIG = '{"method": "suffix", "num_speculative_tokens": 4}'
OFF = SpeculativeConfig("off")  # the side it is measured against
LOADS = ("fresh", "repeat", "sampled")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pdserve bench spec", description=__doc__, formatter_class=HelpFormat
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", help="a Hugging Face Qwen3 directory")
    g.add_argument("--shape", help="a preset shape with random weights, e.g. qwen3-0.6b")
    p.add_argument("--device", default="cpu", help="cpu, cuda:N or npu:N")
    p.add_argument("--dtype", default=None, help="default: the device's")
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated")
    p.add_argument("--loads", default=",".join(LOADS), help="comma-separated, of " + str(LOADS))
    p.add_argument("--prompt-len", type=int, default=256, help="tokens in each random prompt")
    p.add_argument("--output-len", type=int, default=64, help="tokens each request makes")
    p.add_argument(
        "--speculative-config",
        default=DEFAULT_CONFIG,
        metavar="JSON",
        help="the speculative side's config, as a decode node takes it",
    )
    p.add_argument("--kv-cache-memory", default="2GiB", metavar="SIZE", help="each worker's")
    p.add_argument("--seed", type=int, default=0, help="the prompts' random seed")
    p.add_argument("--rounds", type=int, default=2, help="rounds of new prompts, each side in turn")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    try:
        # auto: what a decode node on this device runs
        spec = parse_speculative(a.speculative_config)
        platform = platform_type(a.device)
        if a.dtype is not None and a.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {a.dtype!r}")
        dtype = DTYPES[a.dtype] if a.dtype else platform.default_dtype
        spec = spec.for_decode_node(platform.is_host, platform.is_row_exact(dtype))
        sizes = [int(x) for x in a.batch_sizes.split(",")]
        loads = [x for x in LOADS if x in a.loads.split(",")]
        if not loads or set(a.loads.split(",")) - set(LOADS):
            raise ValueError(f"--loads takes one or more of {LOADS}")
        parse_bytes(a.kv_cache_memory)
        if not spec.is_on:
            where = f"{a.device} in {str(dtype).removeprefix('torch.')}"
            raise ValueError(f"--speculative-config must name a method (auto is off on {where})")
        if min(sizes) < 1 or a.prompt_len < 1 or a.output_len < 2 or a.rounds < 1:
            raise ValueError("batch sizes, --prompt-len, --rounds >= 1; --output-len >= 2")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    base = dict(
        model=a.model,
        shape=a.shape,
        device=a.device,
        dtype=a.dtype,
        kv_cache_memory=parse_bytes(a.kv_cache_memory),
        max_batch_size=max(sizes),
        max_model_len=a.prompt_len + a.output_len + 1,
    )
    rows = []
    for size in sizes:
        rng = random.Random(a.seed + size)
        greedy = [SamplingParams(max_tokens=a.output_len, ignore_eos=True)] * size
        sampled = [
            SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=1.0, seed=i + 1)
            for i in range(size)
        ]
        with ExitStack() as stack:
            threads = torch.get_num_threads()
            off = stack.enter_context(DeviceWorker(WorkerConfig(**base, speculative=OFF)))
            # NOTE: a worker leaves the calling thread at one thread (its loop's small ops):
            # the second takes the same threads as the first
            torch.set_num_threads(threads)
            on = stack.enter_context(DeviceWorker(WorkerConfig(**base, speculative=spec)))
            # NOTE: the largest batch's, checked at the first: every size's workers are alike
            need = max(sizes) * num_blocks_for(a.prompt_len + a.output_len, off.block_size)
            have = min(off.num_kv_blocks, on.num_kv_blocks)
            if need > have:
                print(
                    f"error: batch {max(sizes)} needs {need} KV blocks, {have} fit in "
                    f"--kv-cache-memory {a.kv_cache_memory}: give it more",
                    file=sys.stderr,
                )
                return 2
            freeze_startup_objects()  # as a node does once it is built
            vocab = min(off.spec.vocab_size, 32_000)

            def new_prompts() -> list[list[int]]:
                return [[rng.randrange(1, vocab) for _ in range(a.prompt_len)] for _ in range(size)]

            chooser = DraftChooser(spec.num_speculative_tokens)
            for params in [greedy] + ([sampled] if "sampled" in loads else []):
                warm = new_prompts()
                generate(off, warm, params)
                generate(on, warm, params, chooser)
            runs = {"off": [], "off sampled": [], **{load: [] for load in loads}}
            orders = []
            if {"fresh", "repeat"} & set(loads):
                on_loads = [(load, on) for load in ("fresh", "repeat") if load in loads]
                orders.append((greedy, [("off", off), *on_loads, ("off", off)]))
            if "sampled" in loads:
                off_sampled = ("off sampled", off)
                orders.append((sampled, [off_sampled, ("sampled", on), off_sampled]))
            for _ in range(a.rounds):  # NOTE: the sides alternate: a host's bandwidth drifts
                for params, order in orders:
                    prompts = new_prompts()
                    for load, worker in order:
                        before = worker.decode.stats()
                        out = generate(worker, prompts, params, chooser if worker is on else None)
                        runs[load].append((out, before, worker.decode.stats()))
        for load in loads:
            plain = runs["off sampled" if load == "sampled" else "off"]
            rec = _record(a, spec, size, load, plain, runs[load])
            emit(rec)
            rows.append(rec)
    show(_table(rows))
    return 0


def _tokens_per_s(runs: list[tuple]) -> float:
    """Decode tokens (all but each request's first, the prefill's) over the decode time, of
    every run together."""
    made = sum(len(r["token_ids"]) - 1 for out, _, _ in runs for r in out)
    return made / sum(out[0]["decode_s"] for out, _, _ in runs)


def _tpot_p50_ms(runs: list[tuple]) -> float:
    """The median over every request of its decode time per token after the first."""
    return statistics.median(r["tpot_ms"] for out, _, _ in runs for r in out)


def _record(a, spec, size, load, plain, runs) -> dict:
    def grew(key: str) -> int:
        return sum(after.get(key, 0) - before.get(key, 0) for _, before, after in runs)

    num_verify = grew("num_verify_steps")
    num_steps = sum(out[0]["num_decode_steps"] for out, _, _ in runs)
    baseline, got = _tokens_per_s(plain), _tokens_per_s(runs)
    return {
        "bench": "spec",
        "device": device_name(a.device),
        "model": a.model or a.shape,
        "dtype": a.dtype,
        "speculative_config": spec.__dict__,
        "batch_size": size,
        "prompt_len": a.prompt_len,
        "output_len": a.output_len,
        "rounds": a.rounds,
        "load": load,
        "tokens_per_s": round(got, 2),
        "baseline": "speculation off, the same prompts, before and after each round's runs",
        "baseline_tokens_per_s": round(baseline, 2),
        "speedup": round(got / baseline, 3),
        "tpot_p50_ms": round(_tpot_p50_ms(runs), 3),
        "baseline_tpot_p50_ms": round(_tpot_p50_ms(plain), 3),
        "tpot_ratio": round(_tpot_p50_ms(runs) / _tpot_p50_ms(plain), 3),
        "num_steps": num_steps,
        "baseline_num_steps": sum(out[0]["num_decode_steps"] for out, _, _ in plain) // 2,
        "verify_share": round(num_verify / max(num_steps, 1), 3),
        "accepted_per_verify_row": round(
            grew("num_accepted_tokens") / max(num_verify * size, 1), 3
        ),
        "drafted_tokens": grew("num_drafted_tokens"),
        "accepted_tokens": grew("num_accepted_tokens"),
        "is_identical": all(
            [r["token_ids"] for r in out] == [r["token_ids"] for r in ref]
            for (out, _, _), (ref, _, _) in zip(runs, plain[::2])
        ),
    }


def _table(rows: list[dict]) -> str:
    head = ["batch", "load", "tok/s", "off tok/s", "speedup", "TPOT p50 ms", "off ms", "TPOT/off"]
    head += ["verify share", "accepted/row", "same"]
    body = [
        [
            cell(r["batch_size"]),
            r["load"],
            cell(r["tokens_per_s"]),
            cell(r["baseline_tokens_per_s"]),
            f"{r['speedup']:.2f}x",
            cell(r["tpot_p50_ms"]),
            cell(r["baseline_tpot_p50_ms"]),
            f"{r['tpot_ratio']:.2f}x",
            cell(r["verify_share"]),
            cell(r["accepted_per_verify_row"]),
            "yes" if r["is_identical"] else "NO",
        ]
        for r in rows
    ]
    title = f"speculative decoding on {rows[0]['device']}: {rows[0]['speculative_config']}"
    return table(title, head, body)


if __name__ == "__main__":
    sys.exit(main())
