"""The CPU's matmuls with fp32 weights where torch's own leaves the vector units half used.

torch's fp32 linear is MKL's sgemm, whose widest paths are chosen by the CPU's vendor: on a
CPU with AVX-512 that is not Intel's it runs its AVX2 code (AMD EPYC, one core: ~110 GFLOP/s,
the AVX2 peak). oneDNN, also in torch, runs AVX-512 there: 2.2-2.9x from 64 rows at the tiny
model's and Qwen3-0.6B's shapes (pdserve bench linear --dtype float32). Its call costs ~10 us
more, which a large weight repays from one row and a small one from about 16:

- a weight of at least PACK_MIN_ELEMENTS is laid out once, at load, in oneDNN's layout;
- a smaller one stays as it is: ONEDNN_MIN_ROWS rows and more go through oneDNN, which lays
  it out on each call (cheap for a small weight), fewer through torch's own.

Where the vendor is Intel, or the CPU has no AVX-512, or torch has no oneDNN, every fp32
weight stays as it is and torch's linear serves (IS_ONEDNN_FP32 is False); the functions
here run on any x86 CPU all the same (the tests call them directly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_features import CpuFeatures

PACK_MIN_ELEMENTS = 1 << 20  # 4 MiB of fp32: oneDNN's call cost repaid from one row
ONEDNN_MIN_ROWS = 16  # a smaller weight's crossover (128 x 512: 23.6 us against 22.6)
PACK_BATCH_HINT = 16  # the layout's batch hint; only tunes it (any row count runs)


def is_onednn_faster(features: CpuFeatures) -> bool:
    """Whether oneDNN's fp32 matmul beats torch's default one on this CPU (the module)."""
    return (
        features.is_avx512
        and features.vendor != "GenuineIntel"
        and torch.backends.mkldnn.is_available()
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [N, K] of at least PACK_MIN_ELEMENTS in oneDNN's layout; any other as
    it is."""
    if not (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.numel() >= PACK_MIN_ELEMENTS
    ):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


def is_served(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear() below takes this call: fp32 x [M, K] by a plain fp32 weight."""
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() == 2
        and weight.dim() == 2
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and not weight.is_mkldnn
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 x [M, K] by a plain fp32 weight [N, K] -> [M, N]: through oneDNN from
    ONEDNN_MIN_ROWS rows where the weight is small (a large one, unpacked: a tied lm_head,
    would be laid out again on every call), else torch's."""
    if x.shape[0] < ONEDNN_MIN_ROWS or weight.numel() >= PACK_MIN_ELEMENTS:
        return F.linear(x, weight, bias)
    # NOTE: oneDNN reads x [M, K] row-major; a strided view (a slice of columns) is copied
    return torch.ops.mkldnn._linear_pointwise(
        x.contiguous(), weight.contiguous(), bias, "none", [], ""
    )
