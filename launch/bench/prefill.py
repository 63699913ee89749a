r"""Prefill throughput of one prefill node, driven over its sockets; a sink stands
in for the decode node, accepting and discarding every handoff.

    pdserve bench prefill --shape qwen3-14b --batch 8 --prompt-len 1024 \
        [--device cuda:0] [--baseline transformers]

One JSON line on stdout, then a table on stderr: prompt tokens/s of the forward
passes, end to end (send to the last handoff committed, over the tcp KV transfer),
time to first token, handoff time, and the pass's floor as a roofline: the larger of
its FLOPs over the measured matmul rate and its bytes (the weights, the prompts' KV
written and read) over the measured memory bandwidth; "bound" names which binds. The
benchmark sizes the node's KV cache itself and refuses in one line a model the
device cannot hold.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.base.request import SamplingParams
from common.runtime.process import HelpFormat
from common.wire.codec import dtype_name
from common.wire.protocol import PrefillRequest, RequestFailed
from launch.bench.common import (
    add_common_args,
    check_memory,
    device_name,
    emit,
    fit_len,
    hf_model,
    kv_budget,
    measure_floors,
    resolve,
    sync,
)
from launch.bench.floors import prefill_cost, roofline
from launch.bench.node_under_test import NodeUnderTest, worker_args
from launch.bench.table import cell, show, table


def run_round(
    node: NodeUnderTest, spec, dtype, block_size: int, batch: int, prompt_len: int, tag: str
) -> dict:
    gen = torch.Generator().manual_seed(hash(tag) % 2**31)
    params = SamplingParams(max_tokens=1)
    t0 = time.time()
    for i in range(batch):
        ids = torch.randint(0, spec.vocab_size, (prompt_len,), generator=gen).tolist()
        node.send(PrefillRequest(f"{tag}-{i}", ids, params, t0, "bench-decode", node.kv_endpoint))
    got: list[tuple[float, dict]] = []
    while len(got) < batch:
        for ch, sender, msg in node.poll(0.05):
            if ch is node.kv:
                commit = node.answer_kv(sender, msg, spec, dtype, block_size)
                if commit is not None:
                    got.append((time.time(), commit.timings))
            elif isinstance(msg, RequestFailed):
                raise RuntimeError(f"{msg.request_id} failed: {msg.error}")
    forward_s = max(t["prefill_end"] for _, t in got) - min(t["prefill_start"] for _, t in got)
    last = max(r for r, _ in got)
    return {
        "forward_s": forward_s,
        "end_to_end_s": last - t0,
        "ttft_ms": [(r - t0) * 1e3 for r, _ in got],
        "handoff_ms": [(r - t["prefill_end"]) * 1e3 for r, t in got],
    }


def transformers_prefill(
    spec, device: str, dtype, batch: int, prompt_len: int, runs: int = 3
) -> float:
    """Seconds for one transformers forward over the whole batch (no padding: equal lengths)."""
    model = hf_model(spec, device, dtype)
    dev = torch.device(device)
    ids = torch.randint(0, spec.vocab_size, (batch, prompt_len), device=dev)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(runs + 1):
            sync(dev)
            t0 = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            sync(dev)
            best = min(best, time.perf_counter() - t0)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return best


def table_of(r: dict) -> str:
    base = r.get("baseline") or {}
    rows = [
        [
            "pdserve",
            cell(r["prompt_tokens_per_s"]),
            cell(r["forward_ms"], 1),
            cell(r["floor_ms"], 1),
            cell(r["floor_fraction"], 2),
            r["bound"],
            cell(r["end_to_end_tokens_per_s"]),
            cell(r["ttft_ms_median"], 1),
            cell(r["handoff_ms_median"], 1),
        ]
    ]
    if base:
        rows.append(
            [
                "transformers",
                cell(base["prompt_tokens_per_s"]),
                cell(base["forward_ms"], 1),
                "",
                "",
                "",
                "",
                "",
                "",
            ]
        )
    return table(
        f"prefill: {r['shape']} on {r['device']}, {r['dtype']}, {r['batch']} prompts of "
        f"{r['prompt_len']} tokens in one pass",
        [
            "",
            "prompt tok/s",
            "forward ms",
            "floor ms",
            "of floor",
            "bound",
            "end-to-end tok/s",
            "TTFT p50 ms",
            "handoff p50 ms",
        ],
        rows,
        [
            f"floor: the larger of FLOPs / {r['matmul_TFLOPs']:g} TFLOP/s and bytes / "
            f"{r['bandwidth_GBps']:g} GB/s (measured here); of floor: floor / measured"
        ],
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="pdserve bench prefill", description=__doc__, formatter_class=HelpFormat
    )
    add_common_args(p)
    p.add_argument("--batch", type=int, default=8, help="prompts per round, prefilled in one pass")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="default: 1024, or what the model's length allows",
    )
    p.add_argument("--rounds", type=int, default=3, help="timed rounds; the best counts")
    a = p.parse_args(argv)
    spec, dtype = resolve(a)
    a.prompt_len = fit_len(a.prompt_len, 1024, spec.max_position_embeddings - 16, "--prompt-len")
    elem = torch.tensor([], dtype=dtype).element_size()
    block_size = 16
    tokens = a.batch * a.prompt_len
    kv_bytes = kv_budget(a, spec, elem, [a.prompt_len + 16] * a.batch, block_size)
    baseline = (
        spec.num_params() * elem + tokens * spec.kv_bytes_per_token(elem)
        if a.baseline == "transformers"
        else 0
    )
    check_memory(a, spec, elem, kv_bytes, baseline)
    floors = measure_floors(a.device, dtype)
    args = worker_args(a, a.batch, a.prompt_len + 16, kv_bytes) + [
        "--token-budget",
        str(tokens),
        "--kv-transfer",
        "tcp",
    ]
    node = NodeUnderTest("prefill_node", args, a.base_port, a.node_log, kv_is_router=True)
    try:
        node.wait_ready()
        run_round(node, spec, dtype, block_size, a.batch, a.prompt_len, "warmup")
        rounds = [
            run_round(node, spec, dtype, block_size, a.batch, a.prompt_len, f"r{i}")
            for i in range(a.rounds)
        ]
    except (RuntimeError, TimeoutError) as e:  # a prompt failed; the node exited or never came up
        raise SystemExit(f"{p.prog}: {e}") from None
    finally:
        node.close()
    forward_s = min(r["forward_s"] for r in rounds)
    e2e_s = min(r["end_to_end_s"] for r in rounds)
    roof = roofline(*prefill_cost(spec, elem, a.batch, a.prompt_len), floors)
    record = {
        "bench": "prefill",
        "device": device_name(a.device),
        "shape": a.shape or a.model,
        "dtype": dtype_name(dtype),
        "batch": a.batch,
        "prompt_len": a.prompt_len,
        "prompt_tokens_per_s": round(tokens / forward_s, 1),
        "end_to_end_tokens_per_s": round(tokens / e2e_s, 1),
        "forward_ms": round(forward_s * 1e3, 2),
        "ttft_ms_median": round(statistics.median([x for r in rounds for x in r["ttft_ms"]]), 2),
        "handoff_ms_median": round(
            statistics.median([x for r in rounds for x in r["handoff_ms"]]), 2
        ),
        "floor": "roofline",
        "bound": roof["bound"],
        "floor_ms": roof["floor_ms"],
        "memory_floor_ms": roof["memory_floor_ms"],
        "compute_floor_ms": roof["compute_floor_ms"],
        "pass_gflop": roof["gflop"],
        "pass_gbytes": roof["gbytes"],
        "floor_fraction": round(roof["floor_ms"] / 1e3 / forward_s, 3),
        **floors,
    }
    if a.baseline == "transformers":
        base_s = transformers_prefill(spec, a.device, dtype, a.batch, a.prompt_len)
        record["baseline"] = {
            "impl": "transformers forward",
            "forward_ms": round(base_s * 1e3, 2),
            "prompt_tokens_per_s": round(tokens / base_s, 1),
        }
        record["speedup_vs_baseline"] = round(base_s / forward_s, 2)
    emit(record)
    show(table_of(record))


if __name__ == "__main__":
    main()
