"""CPU linear layers at a model's matmul shapes: the weight as the CPU backend lays it out
at load (kernels.pack_linear_weight; in bf16 the tiles' layout on a CPU with AMX, the dot
products' on one with bf16 units alone, a tied lm_head as the embedding table it also is; in
fp32 oneDNN's where torch's own leaves AVX-512 unused: kernels/cpu_linear_fp32.py), against
oneDNN's packed layout (which a tied table cannot take) and torch's own linear on the
checkpoint's layout, on --threads threads.

    pdserve bench linear [--shape qwen3-0.6b] [--dtype bfloat16] [--rows 1,8,64,1024]

Each call takes the next of --distinct copies of the layer's weight, so the weights come
from memory as a model's do, not from the last-level cache. One JSON line per (rows,
layer) on stdout, then a table on stderr: each side's ms per call (the best of
--repeats), the ratio, and the floor: the larger of the weight's bytes over this host's
measured memory bandwidth and the FLOPs over its measured matmul rate in --dtype.
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
    import kernels
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
    p.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the weights' dtype"
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--repeats", type=int, default=5, help="timed passes per side; the best counts")
    p.add_argument("--distinct", type=int, default=28, help="copies of each weight, called in turn")
    a = p.parse_args(argv)
    if a.distinct < 1:
        p.error("--distinct: at least 1")
    dtype = getattr(torch, a.dtype)
    if dtype == torch.bfloat16 and not portable.IS_BF16_NATIVE:
        print("this CPU has no bf16 matrix units (AVX512-BF16, AMX): nothing is packed here")
        return 2
    if not torch.backends.mkldnn.is_available():
        print("this torch has no oneDNN: there is nothing to compare")
        return 2
    torch.set_num_threads(a.threads)
    spec = preset_spec(a.shape)
    floors = measure_floors("cpu", dtype)
    bandwidth, rate = floors["bandwidth_GBps"] * 1e9, floors["matmul_TFLOPs"] * 1e12
    d, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    layers = {
        "qkv": (q + 2 * kv, d),
        "o": (d, q),
        "gate_up": (2 * spec.intermediate_size, d),
        "down": (d, spec.intermediate_size),
        "lm_head": (spec.vocab_size, d),
    }
    g = torch.Generator().manual_seed(0)
    rows = []
    for num_rows in a.rows:
        for name, (n, k) in layers.items():
            # NOTE: the lm_head alone is larger than any cache: two copies do
            num_copies = min(a.distinct, 2) if name == "lm_head" else a.distinct
            ws = [torch.randn(n, k, generator=g).to(dtype) for _ in range(num_copies)]
            x = torch.randn(num_rows, k, generator=g)  # fp32 activations, as a CPU node's
            # a tied lm_head is packed as the embedding table it also is
            is_table = name == "lm_head" and spec.is_tied_embeddings
            packed = [kernels.pack_linear_weight(w, is_embedding=is_table) for w in ws]
            onednn = [portable.onednn_pack(w) for w in ws]
            per_call = 1 / num_copies

            def each(fn, weights) -> float:
                # NOTE: each output dropped as the next call comes: buffers reused, as a model's
                def run() -> None:
                    for w in weights:
                        fn(x, w)

                return per_call * best_ms(run, a.repeats)

            packed_ms = each(kernels.linear, packed)
            onednn_ms = each(portable.linear, onednn)
            torch_ms = each(lambda x, w: F.linear(x.to(dtype), w).float(), ws)
            floor_ms = max(n * k * dtype.itemsize / bandwidth, 2 * num_rows * n * k / rate) * 1e3
            record = {
                "bench": "linear",
                "device": "cpu",
                "dtype": a.dtype,
                "threads": a.threads,
                "shape": a.shape,
                "layer": f"{name} (tied)" if is_table else name,
                "rows": num_rows,
                "kernels": kernels.describe("cpu"),
                "packed_ms": round(packed_ms, 3),
                "onednn_ms": round(onednn_ms, 3),
                "torch_ms": round(torch_ms, 3),
                "peer": f"torch F.linear {a.dtype} (the checkpoint's layout)",
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
                    record["layer"],
                    cell(packed_ms, 3),
                    cell(onednn_ms, 3),
                    cell(torch_ms, 3),
                    cell(record["packed_speedup"], 2),
                    cell(floor_ms, 3),
                ]
            )
    show(
        table(
            f"linear: {a.shape} in {a.dtype} on cpu, {a.threads} thread(s)",
            ["rows", "layer", "packed ms", "oneDNN ms", "torch ms", "speedup", "floor ms"],
            rows,
            [
                f"packed: {kernels.describe('cpu')}; speedup: torch / packed",
                f"floor: max(weight bytes / {bandwidth / 1e9:.3g} GB/s, "
                f"FLOPs / {rate / 1e12:.3g} TFLOP/s)",
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
