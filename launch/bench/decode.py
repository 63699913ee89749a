r"""Decode throughput of one decode node, driven over its sockets with synthetic
handoffs (random KV at a given context length), for a sweep of batch sizes.

    pdserve bench decode --shape qwen3-0.6b --batch-sizes 1,8,64 --context-len 256 \
        [--device cuda:0] [--baseline transformers]

One JSON line per batch size on stdout, then a table on stderr: ms per step and
tokens/s over --steps full-batch steps (with the mean context they ran at),
host-to-device writes per steady step (the copies that carry block-table entries at
block crossings are counted apart), the share of each step the device sat idle, and
the step's floor as a roofline: the larger of its bytes (every weight, and the
batch's KV) over the memory bandwidth measured around that batch's steps (a copy just
before and one just after: their mean) and its FLOPs over the measured matmul rate;
"bound" names which binds. The benchmark sizes the node's KV cache and each
request's length itself, and refuses in one line a model the device cannot hold. The
node runs plain steps (--speculative-config off) unless a --node-arg says otherwise.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable

import torch

from common.base.config import NodeLinks
from common.base.request import SamplingParams
from common.kv.blocks import num_blocks_for
from common.runtime.process import HelpFormat
from common.wire.codec import dtype_name
from common.wire.protocol import HandoffAck, NodeAbort, TokenBatch
from launch.bench.common import (
    add_common_args,
    check_memory,
    device_name,
    emit,
    fit_len,
    hf_model,
    kv_budget,
    measure_bandwidth,
    measure_floors,
    resolve,
    sync,
)
from launch.bench.floors import decode_cost, roofline
from launch.bench.node_under_test import NodeUnderTest, worker_args
from launch.bench.table import cell, show, table

WARM_STEPS = 8
WINDOW_STEPS = 4  # the counter window spans at least this many steps
STEP_WAIT_S = 300.0  # with no step in this long, the node is stuck (a slow CPU step is seconds)
HEARTBEAT_S = NodeLinks().heartbeat_s  # the node's counters come with its heartbeats
NO_COUNTERS = {
    "h2d_writes_per_steady_step": None,
    "block_entries_per_step": None,
    "device_idle_share": None,
    "counter_window_steps": 0,
}


def run_batch(
    node: NodeUnderTest,
    spec,
    dtype,
    batch: int,
    ctx_len: int,
    block_size: int,
    window_s: float,
    max_tokens: int,
    num_steps: int,
    warm_steps: int = WARM_STEPS,
) -> dict:
    num_blocks = num_blocks_for(ctx_len, block_size)
    kv = (
        torch.randn(
            spec.num_layers,
            2,
            num_blocks,
            block_size,
            spec.num_kv_heads,
            spec.head_dim,
            dtype=torch.float32,
        )
        .mul_(0.1)
        .to(dtype)
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rids = [f"b{batch}-{i}" for i in range(batch)]
    _, s0 = node.next_heartbeat(time.perf_counter())
    came = node.hand_off([(rid, i + 1) for i, rid in enumerate(rids)], ctx_len, params, kv)
    # Each TokenBatch is one step. Time num_steps full-batch steps, and note the
    # step at which each request joined, to know the context the steps ran at.
    admitted_at: dict[str, int] = {}
    step, full_steps, last_step_at = 0, [], time.monotonic()
    while len(full_steps) < warm_steps + num_steps + 1:
        if time.monotonic() - last_step_at > STEP_WAIT_S:
            raise RuntimeError(
                f"the decode node ran no step for {STEP_WAIT_S:.0f}s (batch "
                f"{batch}, {len(admitted_at)} requests admitted)"
            )
        for _, _, msg in came or node.poll(0.05):
            if isinstance(msg, TokenBatch):
                step, last_step_at = step + 1, time.monotonic()
                for u in msg.updates:
                    admitted_at.setdefault(u.request_id, step)
                    if u.finish_reason is not None:
                        raise RuntimeError(
                            f"{u.request_id} ended ({u.finish_reason}) after "
                            f"{len(full_steps)} of the {warm_steps + num_steps + 1} "
                            f"full-batch steps needed: give a larger --max-tokens"
                        )
                if len(admitted_at) == batch and len(msg.updates) == batch:
                    full_steps.append((step, time.perf_counter()))
            elif isinstance(msg, HandoffAck) and not msg.is_accepted:
                raise RuntimeError(f"the decode node refused {msg.request_id}: {msg.reason}")
        came = []
    (first_step, t_first), (last_step, t_last) = full_steps[warm_steps], full_steps[-1]
    ms = (t_last - t_first) * 1e3 / (last_step - first_step)
    mean_ctx = ctx_len + (first_step + last_step) / 2 - sum(admitted_at.values()) / batch
    # Counters over a longer steady window, between two heartbeats. NOTE: a node's figures
    # are taken once a loop turn: the window spans a few steps however slow they are.
    window_s = max(window_s, WINDOW_STEPS * ms / 1e3)
    t1, s1 = node.next_heartbeat(time.perf_counter())
    t2, s2 = node.next_heartbeat(t1 + window_s)
    for rid in rids:
        node.send(NodeAbort(rid))
    deadline = time.monotonic() + STEP_WAIT_S
    while node.next_heartbeat(time.perf_counter())[1]["num_running"]:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the decode node still ran batch {batch} {STEP_WAIT_S:.0f}s after its aborts"
            )
    record = {
        "ms_per_step": round(ms, 3),
        "tokens_per_s": round(batch * 1e3 / ms, 1),
        "mean_context_len": round(mean_ctx, 1),
        "timed_steps": last_step - first_step,
        "max_tokens": max_tokens,
        "is_graphed": s2.get("is_graphed"),
    }
    steps = s2["num_decode_steps"] - s1["num_decode_steps"]
    if steps <= 0 or s2["num_finished"] != s0["num_finished"]:
        # NOTE: a model this short cannot outlast the window at this speed: the timed
        # figures stand, the counters are not measured.
        return {
            **record,
            **NO_COUNTERS,
            "counters_note": f"not measured: the requests' {max_tokens} tokens at "
            f"{ms:.2f} ms/step ended before the {window_s:.1f}s window "
            f"between two heartbeats closed; a longer model (or "
            f"--max-tokens) measures them",
        }
    writes = s2["num_h2d_writes"] - s1["num_h2d_writes"]
    block_copies = s2["num_block_copies"] - s1["num_block_copies"]
    busy = s2["device_busy_s"] - s1["device_busy_s"]
    idle = s2["device_idle_s"] - s1["device_idle_s"]
    return {
        **record,
        "h2d_writes_per_steady_step": round((writes - block_copies) / steps, 4),
        "block_entries_per_step": round(
            (s2["num_block_writes"] - s1["num_block_writes"]) / steps, 4
        ),
        "device_idle_share": round(idle / (busy + idle), 4) if busy else None,
        "counter_window_steps": steps,
    }


def transformers_decode(
    spec, device: str, dtype, batch: int, ctx_len: int, steps: int = 20
) -> float:
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


def around_steps(device: str, floors: dict, run: Callable[[], dict]) -> tuple[dict, dict]:
    """run()'s figures, and the floors its row is set against. NOTE: a shared host's
    bandwidth drifts by the minute (44-85 GB/s within an hour on one VM): there a row's
    bandwidth is the mean of a copy's just before and just after its steps. An accelerator
    keeps the one measured before the node started: its copy needs 2 GiB beside the node."""
    if torch.device(device).type != "cpu":
        return run(), {**floors, "bandwidth_when": "measured before the node started"}
    before = measure_bandwidth(device)
    figures = run()
    after = measure_bandwidth(device)
    return figures, {
        **floors,
        "bandwidth_GBps": float(f"{(before + after) / 2:.3g}"),
        "bandwidth_GBps_before_after": [before, after],
        "bandwidth_GBps_at_start": floors["bandwidth_GBps"],
        "bandwidth_when": "the mean of one just before and one just after the row's steps",
    }


def tokens_needed(
    spec, elem: int, floors: dict, batch: int, a: argparse.Namespace, room: int
) -> int:
    """Tokens per request that outlast the batch's admission (the first requests step while
    the last ones' KV arrives), the warm-up, the timed steps and the counter window (two
    heartbeats past it), were each step as fast as its floor: an upper bound on the steps,
    and half again for what the host does besides. At most room."""
    floor_s = roofline(*decode_cost(spec, elem, batch, a.context_len), floors)["floor_ms"] / 1e3
    admission = 8 + batch // 2
    steps = (
        admission
        + WARM_STEPS
        + a.steps
        + 1
        + WINDOW_STEPS
        + 2
        + math.ceil((a.window + 2 * HEARTBEAT_S) / max(floor_s, 1e-6))
    )
    return min(room, math.ceil(1.5 * steps))


def table_of(records: list[dict]) -> str:
    r, has_base = records[0], "baseline" in records[0]
    rows = [
        [
            str(x["batch"]),
            cell(x["ms_per_step"], 2),
            cell(x["tokens_per_s"]),
            cell(x["floor_ms_per_step"], 3),
            cell(x["floor_fraction"], 2),
            x["bound"],
            cell(x["bandwidth_GBps"], 1),
            cell(x["mean_context_len"], 0),
            cell(x["h2d_writes_per_steady_step"]),
            cell(x["device_idle_share"], 3),
            *([cell(x["baseline"]["ms_per_step"], 2)] if has_base else []),
        ]
        for x in records
    ]
    notes = [
        f"floor: the larger of bytes / GB/s (a copy's, {r['bandwidth_when']}) and FLOPs / "
        f"{r['matmul_TFLOPs']:g} TFLOP/s (measured here); of floor: floor / measured"
    ]
    notes += sorted(
        {
            f"batch {x['batch']}: counters {x['counters_note']}"
            for x in records
            if x.get("counters_note")
        }
    )
    return table(
        f"decode: {r['shape']} on {r['device']}, {r['dtype']}, context {r['context_len']}",
        [
            "batch",
            "ms/step",
            "tokens/s",
            "floor ms",
            "of floor",
            "bound",
            "GB/s",
            "mean ctx",
            "h2d/step",
            "idle share",
            *(["transformers ms"] if has_base else []),
        ],
        rows,
        notes,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="pdserve bench decode", description=__doc__, formatter_class=HelpFormat
    )
    add_common_args(p)
    p.add_argument("--batch-sizes", default="1,8,64", help="comma-separated: one run each")
    p.add_argument(
        "--context-len", type=int, default=256, help="prompt tokens of each synthetic request"
    )
    p.add_argument("--steps", type=int, default=64, help="full-batch steps timed per batch size")
    p.add_argument(
        "--window",
        type=float,
        default=1.0,
        help="seconds over which write and idle counters are read (between two heartbeats)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="per synthetic request (default: enough to outlast the timed steps and the "
        "counter window, as far as the model's length allows)",
    )
    a = p.parse_args(argv)
    spec, dtype = resolve(a)
    elem = torch.tensor([], dtype=dtype).element_size()
    room = spec.max_position_embeddings - a.context_len - 1
    if a.max_tokens is not None:
        fit_len(a.max_tokens, 0, room, "--max-tokens")
    fit_len(None, 1, room, "--context-len")
    batches = [int(b) for b in a.batch_sizes.split(",")]
    check_memory(a, spec, elem, 0)  # the weights alone, before the floors' buffers
    floors = measure_floors(a.device, dtype)
    max_tokens = {b: a.max_tokens or tokens_needed(spec, elem, floors, b, a, room) for b in batches}
    max_len = a.context_len + max(max_tokens.values()) + 1
    kv_bytes = max(
        kv_budget(a, spec, elem, [a.context_len + max_tokens[b] + 1] * b, a.block_size)
        for b in batches
    )
    baseline = (
        (
            spec.num_params() * elem
            + max(batches) * (a.context_len + 32) * spec.kv_bytes_per_token(elem)
        )
        if a.baseline == "transformers"
        else 0
    )
    check_memory(a, spec, elem, kv_bytes, baseline)
    args = worker_args(a, max(batches), max_len, kv_bytes) + ["--block-size", str(a.block_size)]
    node = NodeUnderTest("decode_node", args, a.base_port, a.node_log, kv_is_router=False)
    results = []
    try:
        node.wait_ready()
        for batch in batches:
            r, row_floors = around_steps(
                a.device,
                floors,
                lambda: run_batch(
                    node,
                    spec,
                    dtype,
                    batch,
                    a.context_len,
                    a.block_size,
                    a.window,
                    max_tokens[batch],
                    a.steps,
                ),
            )
            cost = decode_cost(spec, elem, batch, r["mean_context_len"])
            results.append((batch, r, row_floors, roofline(*cost, row_floors)))
            print(f"  batch {batch}: {r['ms_per_step']:.2f} ms/step", file=sys.stderr, flush=True)
    except (RuntimeError, TimeoutError) as e:  # the node refused, exited or never came up
        raise SystemExit(f"{p.prog}: {e}") from None
    finally:
        node.close()
    records = []
    for batch, r, row_floors, roof in results:
        record = {
            "bench": "decode",
            "device": device_name(a.device),
            "shape": a.shape or a.model,
            "dtype": dtype_name(dtype),
            "batch": batch,
            "context_len": a.context_len,
            **r,
            "floor": "roofline",
            "bound": roof["bound"],
            "floor_ms_per_step": roof["floor_ms"],
            "memory_floor_ms": roof["memory_floor_ms"],
            "compute_floor_ms": roof["compute_floor_ms"],
            "step_gflop": roof["gflop"],
            "step_gbytes": roof["gbytes"],
            "floor_fraction": round(roof["floor_ms"] / r["ms_per_step"], 3),
            **row_floors,
        }
        if a.baseline == "transformers":
            base_ms = transformers_decode(spec, a.device, dtype, batch, a.context_len)
            record["baseline"] = {
                "impl": "transformers eager forward + DynamicCache",
                "ms_per_step": round(base_ms, 3),
                "tokens_per_s": round(batch * 1e3 / base_ms, 1),
            }
            record["speedup_vs_baseline"] = round(base_ms / r["ms_per_step"], 2)
        emit(record)
        records.append(record)
    show(table_of(records))


if __name__ == "__main__":
    main()
