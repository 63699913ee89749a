"""CPU linear layers in bf16 at a model's matmul shapes: the weight laid out once for oneDNN
(what kernels/portable.py's pack_linear_weight does at load where the CPU has bf16 matrix units)
against torch's own bf16 linear on the checkpoint's layout, on --threads threads.

    pdserve bench linear [--shape qwen3-0.6b] [--rows 1,8,64,1024] [--threads 2]

One JSON line per (rows, layer) on stdout, then a table on stderr: each side's ms per call
(the best of --repeats), the ratio, and the floor: the larger of the weight's bytes over
this host's measured memory bandwidth and the FLOPs over its measured bf16 matmul rate.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common.base.model_spec import preset_spec
from common.runtime.process import HelpFormat
from launch.bench.common import best_ms, emit, measure_floors
from launch.bench.table import cell, show, table


def main(argv: list[str] | None = None) -> int:
    from kernels import portable

    p = argparse.ArgumentParser(
        "pdserve bench linear", description=__doc__, formatter_class=HelpFormat
    )
    p.add_argument(
        "--shape", default="qwen3-0.6b", help="a preset shape (common/base/model_spec.py)"
    )
    p.add_argument(
        "--rows",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8, 64, 1024],
        help="comma-separated rows of x (decode batch, prefill tokens)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per side; the best counts")
    a = p.parse_args(argv)
    if not portable.IS_BF16_NATIVE:
        print("this CPU has no bf16 matrix units (AVX512-BF16, AMX): nothing is packed here")
        return 2
    torch.set_num_threads(a.threads)
    spec = preset_spec(a.shape)
    floors = measure_floors("cpu", torch.bfloat16)
    bandwidth, rate = floors["bandwidth_GBps"] * 1e9, floors["matmul_TFLOPs"] * 1e12
    d, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    layers = {
        "qkv": (q + 2 * kv, d),
        "o": (d, q),
        "gate_up": (2 * spec.intermediate_size, d),
        "down": (d, spec.intermediate_size),
    }
    g = torch.Generator().manual_seed(0)
    rows = []
    for num_rows in a.rows:
        for name, (n, k) in layers.items():
            w = torch.randn(n, k, generator=g).bfloat16()
            x = torch.randn(num_rows, k, generator=g)  # fp32 activations, as a CPU node's
            packed = portable.pack_linear_weight(w)
            packed_ms = best_ms(lambda: portable.linear(x, packed), a.repeats)
            torch_ms = best_ms(lambda: F.linear(x.bfloat16(), w).float(), a.repeats)
            floor_ms = max(w.numel() * 2 / bandwidth, 2 * num_rows * n * k / rate) * 1e3
            record = {
                "bench": "linear",
                "device": "cpu",
                "dtype": "bfloat16",
                "threads": a.threads,
                "shape": a.shape,
                "layer": name,
                "rows": num_rows,
                "packed_ms": round(packed_ms, 3),
                "torch_ms": round(torch_ms, 3),
                "peer": "torch F.linear bf16 (oneDNN, the checkpoint's layout)",
                "packed_speedup": round(torch_ms / packed_ms, 2),
                "floor": "roofline",
                "floor_ms": round(floor_ms, 3),
                "bandwidth_GBps": round(bandwidth / 1e9, 1),
                "matmul_TFLOPs": round(rate / 1e12, 3),
            }
            emit(record)
            rows.append(
                [
                    str(num_rows),
                    name,
                    cell(packed_ms, 3),
                    cell(torch_ms, 3),
                    cell(record["packed_speedup"], 2),
                    cell(floor_ms, 3),
                ]
            )
    show(
        table(
            f"linear: {a.shape} in bf16 on cpu, {a.threads} thread(s)",
            ["rows", "layer", "packed ms", "torch ms", "speedup", "floor ms"],
            rows,
            [
                f"floor: max(weight bytes / {bandwidth / 1e9:.3g} GB/s, "
                f"FLOPs / {rate / 1e12:.3g} TFLOP/s); NOTE: one layer's weight, called again "
                "and again, may sit in the last-level cache, below the DRAM floor"
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
