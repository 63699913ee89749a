"""CPU prefill attention, one chunk at a time over a paged cache on --threads threads: this
project's C kernel (cpu_attention.c, many short chunks a call), its long-chunk path
(kernels/cpu_long_chunk.py: the AMX tiles over a bf16 cache where the CPU has them, else
torch's fused kernel) and torch's fused kernel as that path calls it.

    pdserve bench attention [--query-lens 32,256,1024,2048] [--context-len 0] [--threads 1]
                            [--dtype float32|bfloat16]

One JSON line a length on stdout, then a table on stderr: each kernel's ms per call
(the best of --repeats), the ratios, and the floor: the attention's FLOPs (QK^T and PV
over the causal pairs) at the measured matmul rate of this host in --dtype.
"""

from __future__ import annotations

import argparse

import torch

from common.runtime.process import HelpFormat
from launch.bench.common import best_ms, emit, measure_floors
from launch.bench.table import cell, show, table


def main(argv: list[str] | None = None) -> int:
    from kernels import cpu
    from kernels import cpu_long_chunk as long_chunk

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
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the cache's dtype (the tiles take bf16)",
    )
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    rate = measure_floors("cpu", dtype)["matmul_TFLOPs"] * 1e12
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in a.query_lens:
        total = a.context_len + n
        num_blocks = (total + a.block_size - 1) // a.block_size
        shape = (num_blocks + 1, a.block_size, a.kv_heads, a.head_dim)
        k = torch.randn(shape, generator=g).to(dtype)
        v = torch.randn(shape, generator=g).to(dtype)
        q = torch.randn(n, a.heads, a.head_dim, generator=g)
        tables = torch.arange(1, num_blocks + 1, dtype=torch.int32)[None]
        args = (q, k, v, tables, [n], [a.context_len], a.head_dim**-0.5)
        # NOTE: the C kernel for this chunk at every length, only while it is timed
        limits = cpu.TORCH_MIN_QUERY_LEN, long_chunk.TILES_MIN_QUERY_LEN
        cpu.TORCH_MIN_QUERY_LEN = long_chunk.TILES_MIN_QUERY_LEN = 1 << 30
        try:
            c_ms = best_ms(lambda: cpu.prefill_attention(*args), a.repeats)
        finally:
            cpu.TORCH_MIN_QUERY_LEN, long_chunk.TILES_MIN_QUERY_LEN = limits
        # the long-chunk path, and torch's kernel as it calls it (operands heads-first)
        scale, out = a.head_dim**-0.5, torch.empty(q.shape)
        long_args = (q, k, v, tables[0], a.context_len, scale, dtype, out)
        path = long_chunk.attend(*long_args)
        long_ms = best_ms(lambda: long_chunk.attend(*long_args), a.repeats)
        torch_args = (q, k, v, tables[0], a.context_len, scale, dtype)
        torch_ms = best_ms(lambda: long_chunk._torch_chunk(*torch_args), a.repeats)
        pairs = n * a.context_len + n * (n + 1) / 2
        flops = 4 * pairs * a.heads * a.head_dim
        record = {
            "bench": "attention",
            "device": "cpu",
            "threads": a.threads,
            "query_len": n,
            "context_len": a.context_len,
            "heads": [a.heads, a.kv_heads, a.head_dim],
            "dtype": a.dtype,
            "c_kernel_ms": round(c_ms, 2),
            "long_chunk_path": path,
            "long_chunk_ms": round(long_ms, 2),
            "torch_ms": round(torch_ms, 2),
            "torch_over_c_rate": round(c_ms / torch_ms, 2),
            "torch_over_long_chunk_rate": round(long_ms / torch_ms, 2),
            "floor": "matmul rate",
            "floor_ms": round(flops / rate * 1e3, 2),
            "matmul_TFLOPs": round(rate / 1e12, 3),
        }
        emit(record)
        rows.append(
            [
                str(n),
                cell(c_ms, 2),
                f"{cell(long_ms, 2)} ({path})",
                cell(torch_ms, 2),
                cell(record["torch_over_c_rate"], 2),
                cell(record["floor_ms"], 2),
            ]
        )
    show(
        table(
            f"attention: one chunk over a paged cache on cpu, {a.threads} thread(s), context "
            f"{a.context_len}, heads {a.heads}/{a.kv_heads}x{a.head_dim}",
            ["query len", "C kernel ms", "long-chunk ms", "torch ms", "C / torch", "floor ms"],
            rows,
            [
                f"floor: the attention's FLOPs / {rate / 1e12:.3g} TFLOP/s ({a.dtype} matmul, "
                f"measured here)"
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
