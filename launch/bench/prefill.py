"""Prefill throughput of one prefill node, driven over its sockets; a sink stands
in for the decode node, accepting and discarding every handoff.

    python -m launch.bench.prefill --shape qwen3-14b --device cuda:0 --batch 8 --prompt-len 1024 \
        [--baseline transformers]

One JSON line: prompt tokens/s of the forward passes, end to end (send to the
last handoff committed, over the tcp KV transfer), time to first token, handoff
time, and the matmul floor: FLOPs / measured matmul rate.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.wire.codec import dtype_name
from common.runtime.process import HelpFormat
from common.wire.protocol import PrefillRequest, RequestFailed
from common.base.request import SamplingParams
from launch.bench.common import (NodeUnderTest, add_common_args, device_name, emit, fit_len, hf_model,
                                 matmul_params, measure_floors, resolve, sync, worker_args)


def prefill_flops(spec, batch: int, prompt_len: int) -> float:
    """Matmuls (2 per weight per token) plus causal attention (QK^T and PV over half the square)."""
    tokens = batch * prompt_len
    attn = 2 * 2 * spec.num_layers * spec.num_heads * spec.head_dim * batch * prompt_len * prompt_len / 2
    # Only the last token of each prompt goes through lm_head.
    dense = 2 * (matmul_params(spec) - spec.vocab_size * spec.hidden_size) * tokens
    return dense + 2 * spec.vocab_size * spec.hidden_size * batch + attn


def run_round(node: NodeUnderTest, spec, dtype, block_size: int, batch: int, prompt_len: int,
              tag: str) -> dict:
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
    return {"forward_s": forward_s, "end_to_end_s": last - t0,
            "ttft_ms": [(r - t0) * 1e3 for r, _ in got],
            "handoff_ms": [(r - t["prefill_end"]) * 1e3 for r, t in got]}


def transformers_prefill(spec, device: str, dtype, batch: int, prompt_len: int, runs: int = 3) -> float:
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormat)
    add_common_args(p)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=None,
                   help="default: 1024, or what the model's length allows")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds; the best counts")
    a = p.parse_args(argv)
    spec, dtype = resolve(a)
    a.prompt_len = fit_len(a.prompt_len, 1024, spec.max_position_embeddings - 16, "--prompt-len")
    floors = measure_floors(a.device, dtype)
    tokens = a.batch * a.prompt_len
    args = worker_args(a, a.batch, a.prompt_len + 16) + ["--token-budget", str(tokens),
                                                         "--kv-transfer", "tcp"]
    node = NodeUnderTest("prefill_node", args, a.base_port, a.node_log, kv_is_router=True)
    block_size = 16
    try:
        node.wait_ready()
        run_round(node, spec, dtype, block_size, a.batch, a.prompt_len, "warmup")
        rounds = [run_round(node, spec, dtype, block_size, a.batch, a.prompt_len, f"r{i}")
                  for i in range(a.rounds)]
    finally:
        node.close()
    forward_s = min(r["forward_s"] for r in rounds)
    e2e_s = min(r["end_to_end_s"] for r in rounds)
    floor_s = prefill_flops(spec, a.batch, a.prompt_len) / (floors["matmul_TFLOPs"] * 1e12)
    record = {"bench": "prefill", "device": device_name(a.device), "shape": a.shape or a.model,
              "dtype": dtype_name(dtype), "batch": a.batch, "prompt_len": a.prompt_len,
              "prompt_tokens_per_s": round(tokens / forward_s, 1),
              "end_to_end_tokens_per_s": round(tokens / e2e_s, 1),
              "forward_ms": round(forward_s * 1e3, 2),
              "ttft_ms_median": round(statistics.median(sum((r["ttft_ms"] for r in rounds), [])), 2),
              "handoff_ms_median": round(statistics.median(sum((r["handoff_ms"] for r in rounds), [])), 2),
              "floor": "matmul rate", "floor_ms": round(floor_s * 1e3, 2),
              "floor_fraction": round(floor_s / forward_s, 3), **floors}
    if a.baseline == "transformers":
        base_s = transformers_prefill(spec, a.device, dtype, a.batch, a.prompt_len)
        record["baseline"] = {"impl": "transformers forward", "forward_ms": round(base_s * 1e3, 2),
                              "prompt_tokens_per_s": round(tokens / base_s, 1)}
        record["speedup_vs_baseline"] = round(base_s / forward_s, 2)
    emit(record)


if __name__ == "__main__":
    main()
