"""CPU prefill attention: this project's C kernel against torch's fused kernel (what
kernels/cpu.py sends a chunk of TORCH_MIN_QUERY_LEN queries or more to), one chunk at a
time over a paged cache, on --threads threads.

    pdserve bench attention [--query-lens 32,256,1024,2048] [--context-len 0] [--threads 1]

One JSON line a length on stdout, then a table on stderr: each kernel's ms per call
(the best of --repeats), the ratio, and the floor: the attention's FLOPs (QK^T and PV
over the causal pairs) at the measured fp32 matmul rate of this host.
"""

from __future__ import annotations

import argparse

import torch

from common.runtime.process import HelpFormat
from launch.bench.common import best_ms, emit, measure_floors
from launch.bench.table import cell, show, table


def main(argv: list[str] | None = None) -> int:
    from kernels import cpu

    p = argparse.ArgumentParser(
        "pdserve bench attention", description=__doc__, formatter_class=HelpFormat
    )
    p.add_argument(
        "--query-lens",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[32, 256, 1024, 2048],
        help="comma-separated chunk lengths",
    )
    p.add_argument("--context-len", type=int, default=0, help="cached tokens before each chunk")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--head-dim", type=int, default=64, help="each head's width")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per kernel; the best counts")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rate = measure_floors("cpu", torch.float32)["matmul_TFLOPs"] * 1e12
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in a.query_lens:
        total = a.context_len + n
        num_blocks = (total + a.block_size - 1) // a.block_size
        k = torch.randn(num_blocks + 1, a.block_size, a.kv_heads, a.head_dim, generator=g)
        v = torch.randn(num_blocks + 1, a.block_size, a.kv_heads, a.head_dim, generator=g)
        q = torch.randn(n, a.heads, a.head_dim, generator=g)
        tables = torch.arange(1, num_blocks + 1, dtype=torch.int32)[None]
        args = (q, k, v, tables, [n], [a.context_len], a.head_dim**-0.5)
        c_ms = (
            best_ms(lambda: cpu.prefill_attention(*args), a.repeats)
            if n < cpu.TORCH_MIN_QUERY_LEN
            else None
        )
        if c_ms is None:  # NOTE: the C kernel for this chunk too, only while it is timed
            limit, cpu.TORCH_MIN_QUERY_LEN = cpu.TORCH_MIN_QUERY_LEN, 1 << 30
            try:
                c_ms = best_ms(lambda: cpu.prefill_attention(*args), a.repeats)
            finally:
                cpu.TORCH_MIN_QUERY_LEN = limit
        # torch's kernel as the backend calls it (operands heads-first, contiguous)
        long_args = (q, k, v, tables[0], a.context_len, a.head_dim**-0.5, q.dtype)
        torch_ms = best_ms(lambda: cpu._long_chunk(*long_args), a.repeats)
        pairs = n * a.context_len + n * (n + 1) / 2
        flops = 4 * pairs * a.heads * a.head_dim
        record = {
            "bench": "attention",
            "device": "cpu",
            "threads": a.threads,
            "query_len": n,
            "context_len": a.context_len,
            "heads": [a.heads, a.kv_heads, a.head_dim],
            "c_kernel_ms": round(c_ms, 2),
            "torch_ms": round(torch_ms, 2),
            "torch_over_c_rate": round(c_ms / torch_ms, 2),
            "floor": "matmul rate",
            "floor_ms": round(flops / rate * 1e3, 2),
            "matmul_TFLOPs": round(rate / 1e12, 3),
        }
        emit(record)
        rows.append(
            [
                str(n),
                cell(c_ms, 2),
                cell(torch_ms, 2),
                cell(record["torch_over_c_rate"], 2),
                cell(record["floor_ms"], 2),
            ]
        )
    show(
        table(
            f"attention: one chunk over a paged cache on cpu, {a.threads} thread(s), context "
            f"{a.context_len}, heads {a.heads}/{a.kv_heads}x{a.head_dim}",
            ["query len", "C kernel ms", "torch ms", "C / torch", "floor ms"],
            rows,
            [
                f"floor: the attention's FLOPs / {rate / 1e12:.3g} TFLOP/s (fp32 matmul, measured "
                f"here)"
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
