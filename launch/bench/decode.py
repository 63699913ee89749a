"""Decode throughput of one decode node, driven over its sockets with synthetic
handoffs (random KV at a given context length), for a sweep of batch sizes.

    python -m launch.bench.decode --shape qwen3-0.6b --device cuda:0 --batch-sizes 1,64 \
        --context-len 256 [--baseline transformers]

One JSON line per batch size: ms per step and tokens/s over --steps full-batch steps
(with the mean context they ran at), host-to-device writes per steady step (the
copies that carry block-table entries at block crossings are counted apart),
the share of each step the device sat idle, and the memory-bandwidth floor:
(weight bytes + KV bytes read) / measured bandwidth.
"""
from __future__ import annotations

import argparse
import time

import torch

from common.wire.codec import dtype_name
from common.kv.blocks import num_blocks_for
from common.runtime.process import HelpFormat
from common.wire.protocol import HandoffAck, NodeAbort, TokenBatch
from common.base.request import SamplingParams
from launch.bench.common import (NodeUnderTest, add_common_args, device_name, emit, fit_len, hf_model,
                                 matmul_params, measure_floors, resolve, sync, worker_args)


def run_batch(node: NodeUnderTest, spec, dtype, batch: int, ctx_len: int, block_size: int,
              window_s: float, max_tokens: int, num_steps: int, warm_steps: int = 8) -> dict:
    num_blocks = num_blocks_for(ctx_len, block_size)
    kv = torch.randn(spec.num_layers, 2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim,
                     dtype=torch.float32).mul_(0.1).to(dtype)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rids = [f"b{batch}-{i}" for i in range(batch)]
    _, s0 = node.next_heartbeat(time.perf_counter())
    for i, rid in enumerate(rids):
        node.hand_off(rid, ctx_len, i + 1, params, kv)
    # Each TokenBatch is one step. Time num_steps full-batch steps, and note the
    # step at which each request joined, to know the context the steps ran at.
    admitted_at: dict[str, int] = {}
    step, full_steps = 0, []
    while len(full_steps) < warm_steps + num_steps + 1:
        for _, _, msg in node.poll(0.05):
            if isinstance(msg, TokenBatch):
                step += 1
                for u in msg.updates:
                    admitted_at.setdefault(u.request_id, step)
                if len(admitted_at) == batch and len(msg.updates) == batch:
                    full_steps.append((step, time.perf_counter()))
            elif isinstance(msg, HandoffAck) and not msg.is_accepted:
                raise RuntimeError(f"decode node refused {msg.request_id}: {msg.reason}")
    (first_step, t_first), (last_step, t_last) = full_steps[warm_steps], full_steps[-1]
    ms = (t_last - t_first) * 1e3 / (last_step - first_step)
    mean_ctx = ctx_len + (first_step + last_step) / 2 - sum(admitted_at.values()) / batch
    # Counters over a longer steady window, between two heartbeats.
    t1, s1 = node.next_heartbeat(time.perf_counter())
    t2, s2 = node.next_heartbeat(t1 + window_s)
    for rid in rids:
        node.send(NodeAbort(rid))
    while node.next_heartbeat(time.perf_counter())[1]["num_running"]:
        pass
    steps = s2["num_decode_steps"] - s1["num_decode_steps"]
    if steps <= 0 or s2["num_finished"] != s0["num_finished"]:
        raise SystemExit(f"bench_decode: the requests ran out ({max_tokens} tokens at {ms:.2f} ms/step) "
                         f"before the {window_s:g}s counter window closed: raise --max-tokens (the "
                         f"model's length permitting), lower --context-len or --window")
    writes = s2["num_h2d_writes"] - s1["num_h2d_writes"]
    block_copies = s2["num_block_copies"] - s1["num_block_copies"]
    busy = s2["device_busy_s"] - s1["device_busy_s"]
    idle = s2["device_idle_s"] - s1["device_idle_s"]
    return {"ms_per_step": round(ms, 3), "tokens_per_s": round(batch * 1e3 / ms, 1),
            "mean_context_len": round(mean_ctx, 1), "timed_steps": last_step - first_step,
            "h2d_writes_per_steady_step": (writes - block_copies) / steps,
            "block_entries_per_step": round((s2["num_block_writes"] - s1["num_block_writes"]) / steps, 4),
            "device_idle_share": round(idle / (busy + idle), 4) if busy else None,
            "counter_window_steps": steps, "is_graphed": s2.get("is_graphed")}


def transformers_decode(spec, device: str, dtype, batch: int, ctx_len: int, steps: int = 20) -> float:
    """ms per step of transformers' eager forward with its dynamic cache, as generate runs it."""
    from transformers import DynamicCache
    model = hf_model(spec, device, dtype)
    dev = torch.device(device)
    with torch.inference_mode():
        ids = torch.randint(0, spec.vocab_size, (batch, ctx_len), device=dev)
        cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps + 3):
            sync(dev)
            t0 = time.perf_counter()
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            sync(dev)
            times.append(time.perf_counter() - t0)
    del model, out, cache
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    times = sorted(times[3:])
    return times[len(times) // 2] * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormat)
    add_common_args(p)
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=64, help="full-batch steps timed per batch size")
    p.add_argument("--window", type=float, default=1.0,
                   help="seconds over which write and idle counters are read")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="per synthetic request; must outlast the window (default: 3072, or what "
                        "the model's length leaves after --context-len)")
    a = p.parse_args(argv)
    spec, dtype = resolve(a)
    a.max_tokens = fit_len(a.max_tokens, 3072, spec.max_position_embeddings - a.context_len - 1,
                           "--max-tokens")
    batches = [int(b) for b in a.batch_sizes.split(",")]
    floors = measure_floors(a.device, dtype)
    max_len = a.context_len + a.max_tokens
    node = NodeUnderTest("decode_node", worker_args(a, max(batches), max_len) +
                         ["--block-size", str(a.block_size)], a.base_port, a.node_log, kv_is_router=False)
    results = []
    try:
        node.wait_ready()
        elem = torch.tensor([], dtype=dtype).element_size()
        weight_bytes = matmul_params(spec) * elem   # every matmul weight is read once per step
        for batch in batches:
            r = run_batch(node, spec, dtype, batch, a.context_len, a.block_size, a.window,
                          a.max_tokens, a.steps)
            kv_bytes = batch * r["mean_context_len"] * spec.kv_bytes_per_token(elem)
            floor_ms = (weight_bytes + kv_bytes) / (floors["bandwidth_GBps"] * 1e9) * 1e3
            results.append((batch, r, floor_ms))
    finally:
        node.close()
    for batch, r, floor_ms in results:
        record = {"bench": "decode", "device": device_name(a.device), "shape": a.shape or a.model,
                  "dtype": dtype_name(dtype), "batch": batch,
                  "context_len": a.context_len, **r, "floor": "memory bandwidth",
                  "floor_ms_per_step": round(floor_ms, 3),
                  "floor_fraction": round(floor_ms / r["ms_per_step"], 3), **floors}
        if a.baseline == "transformers":
            base_ms = transformers_decode(spec, a.device, dtype, batch, a.context_len)
            record["baseline"] = {"impl": "transformers eager forward + DynamicCache",
                                  "ms_per_step": round(base_ms, 3),
                                  "tokens_per_s": round(batch * 1e3 / base_ms, 1)}
            record["speedup_vs_baseline"] = round(base_ms / r["ms_per_step"], 2)
        emit(record)


if __name__ == "__main__":
    main()
