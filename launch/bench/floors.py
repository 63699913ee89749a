"""This machine's floors and a step's bound as a roofline: a step can go no faster than
its bytes over the measured memory bandwidth, nor than its FLOPs over the measured
matmul rate; the larger of the two binds, and the benchmarks name which."""

from __future__ import annotations

import time

import torch

from common.base.model_spec import ModelSpec
from common.wire.codec import dtype_name
from kernels.portable import onednn_linear, onednn_pack

# What binds a step, as its record names it.
MEMORY, COMPUTE = "memory bandwidth", "matmul rate"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device_str: str) -> float:
    """Memory bandwidth in GB/s: a large device copy, bytes read + written, the best of 8."""
    device = torch.device(device_str)
    n = (1 << 30) if device.type == "cuda" else (1 << 28)
    # NOTE: filled, not torch.empty: an untouched host buffer's pages are not there yet (the
    # copy reads the shared zero page and faults its writes in), so it reads too fast.
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    dst.copy_(src)
    best = float("inf")
    for _ in range(8):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return float(f"{2 * n / best / 1e9:.3g}")


def measure_floors(device_str: str, dtype: torch.dtype) -> dict:
    """Memory bandwidth (measure_bandwidth) and the dense matmul rate (8192^3, 1024^3 on a
    host, in the model dtype), each the best of several runs."""
    device = torch.device(device_str)
    bandwidth = measure_bandwidth(device_str)
    m = 8192 if device.type == "cuda" else 1024
    # NOTE: a host without bf16 matrix units multiplies bf16 weights fastest widened to
    # fp32: the floor is the better of the two rates this machine has.
    dtypes = [dtype] if device.type == "cuda" or dtype == torch.float32 else [dtype, torch.float32]
    rates = {dtype_name(dt): _matmul_rate(device, dt, m) for dt in dtypes}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # NOTE: three significant figures, not one decimal: a busy 2-core CPU does about
    # 0.04 TFLOP/s, which one decimal rounds to 0 (and a floor to a division by zero).
    return {
        "bandwidth_GBps": bandwidth,
        "matmul_TFLOPs": float(f"{max(rates.values()):.3g}"),
        "matmul_TFLOPs_by_dtype": {k: float(f"{v:.3g}") for k, v in rates.items()},
    }


def _matmul_rate(device: torch.device, dtype: torch.dtype, m: int) -> float:
    """TFLOP/s of an m^3 matmul in dtype, the best of 8 (on a host in fp32: of torch's
    matmul and oneDNN's, whichever is faster here)."""
    a = torch.randn(m, m, device=device, dtype=dtype)
    b = torch.randn(m, m, device=device, dtype=dtype)
    ways = [lambda: a @ b]
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        # NOTE: torch's fp32 matmul (MKL) runs AVX2 on a CPU not Intel's; oneDNN, which a
        # node uses there (kernels/cpu_linear_fp32.py), runs its widest vectors
        packed = onednn_pack(b.t())
        ways.append(lambda: onednn_linear(a, packed))
    best = float("inf")
    for way in ways:
        for _ in range(8):
            sync(device)
            t0 = time.perf_counter()
            way()
            sync(device)
            best = min(best, time.perf_counter() - t0)
    return 2 * m**3 / best / 1e12


def matmul_params(spec: ModelSpec) -> int:
    """Weights that take part in a token's matmuls (the embedding lookup does not)."""
    per_layer = (
        spec.hidden_size * (spec.q_size + 2 * spec.kv_size)
        + spec.q_size * spec.hidden_size
        + 3 * spec.hidden_size * spec.intermediate_size
    )
    return spec.num_layers * per_layer + spec.vocab_size * spec.hidden_size


def attention_flops(spec: ModelSpec, num_pairs: float) -> float:
    """QK^T and PV over num_pairs (query, key) pairs, every layer and head."""
    return 4 * spec.num_layers * spec.num_heads * spec.head_dim * num_pairs


def decode_cost(spec: ModelSpec, elem: int, batch: int, context_len: float) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step: every matmul weight read once and used for each
    row, and each row's attention over its context, whose KV is read."""
    flops = 2 * matmul_params(spec) * batch + attention_flops(spec, batch * context_len)
    return flops, matmul_params(spec) * elem + batch * context_len * spec.kv_bytes_per_token(elem)


def prefill_cost(spec: ModelSpec, elem: int, batch: int, prompt_len: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one pass over batch prompts: the matmuls of every token (lm_head:
    only each prompt's last), causal attention over half the square, the weights read
    once and the prompts' KV written and read once."""
    tokens = batch * prompt_len
    head = spec.vocab_size * spec.hidden_size
    flops = (
        2 * (matmul_params(spec) - head) * tokens
        + 2 * head * batch
        + attention_flops(spec, batch * prompt_len * prompt_len / 2)
    )
    return flops, matmul_params(spec) * elem + 2 * tokens * spec.kv_bytes_per_token(elem)


def roofline(flops: float, num_bytes: float, floors: dict) -> dict:
    """The floor (ms) a step of this cost cannot beat on this machine, and what binds it."""
    memory_ms = num_bytes / (floors["bandwidth_GBps"] * 1e9) * 1e3
    compute_ms = flops / (floors["matmul_TFLOPs"] * 1e12) * 1e3
    return {
        "bound": COMPUTE if compute_ms > memory_ms else MEMORY,
        "floor_ms": round(max(memory_ms, compute_ms), 3),
        "memory_floor_ms": round(memory_ms, 3),
        "compute_floor_ms": round(compute_ms, 3),
        "gflop": float(f"{flops / 1e9:.3g}"),
        "gbytes": float(f"{num_bytes / 1e9:.3g}"),
    }
