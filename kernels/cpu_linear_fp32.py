"""The CPU's matmuls with fp32 weights where torch's own leaves the vector units half used.

torch's fp32 linear is MKL's sgemm, whose widest paths are chosen by the CPU's vendor: on a
CPU with AVX-512 that is not Intel's it runs its AVX2 code (AMD EPYC, one core: ~110 GFLOP/s,
the AVX2 peak). oneDNN, also in torch, runs AVX-512 there: 2.2-2.9x from 64 rows at the tiny
model's and Qwen3-0.6B's shapes (pdserve bench linear --dtype float32). Its call costs ~10 us
more, which a large weight repays from one row and a small one from about 16:

- a weight of at least PACK_MIN_ELEMENTS is laid out once, at load, in oneDNN's layout,
  except a tied lm_head, which the embedding must still index: it stays as it is and goes
  through oneDNN all the same (Qwen3-0.6B's, 622 MB, two threads: 16.3 ms a row against
  torch's 29.5, 28.3 against 67.7 at 8 rows; no copy of it is made);
- a smaller one stays as it is: ONEDNN_MIN_ROWS rows and more go through oneDNN, fewer
  through torch's own.

NOTE: oneDNN makes a primitive for each shape it meets (160 us at the tiny model's, 600 at
Qwen3-0.6B's qkv) and keeps the last 1,024: a prefill's token count differs from pass to
pass, so from ONEDNN_MIN_ROWS rows x is padded with zero rows to one of 8 counts an octave
(at most 1/8 more rows): random 300-700-row passes, 3 tiny matmuls, 295 us against 407-514.
The thread count is part of a primitive's key too: a host of many cores, whose passes take
many grants, may still miss.

Where the vendor is Intel, or the CPU has no AVX-512, or torch has no oneDNN, every fp32
weight stays as it is and torch's linear serves (IS_ONEDNN_FP32 is False); the functions
here run on any x86 CPU all the same (the tests call them directly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_features import CpuFeatures
from kernels.portable import onednn_linear, onednn_pack

PACK_MIN_ELEMENTS = 1 << 20  # 4 MiB of fp32: oneDNN's call cost repaid from one row
ONEDNN_MIN_ROWS = 16  # a smaller weight's crossover (128 x 512: 23.6 us against 22.6)


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
    return onednn_pack(weight)


def is_served(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear() below takes this call: fp32 x [M, K] by an fp32 weight, packed or
    plain."""
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() == 2
        and weight.dim() == 2
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
    )


def padded_rows(num_rows: int) -> int:
    """num_rows rounded up to one of 8 counts an octave (16 -> 16, 17 -> 18, 430 -> 448)."""
    step = 1 << max(0, num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_seqs: int | None = None,
) -> torch.Tensor:
    """fp32 x [M, K] by an fp32 weight [N, K] (+ bias [N]) -> [M, N]: through oneDNN,
    except a small plain weight's few rows (fewer than ONEDNN_MIN_ROWS; a verify step's
    sequences: num_seqs, as portable.linear's), torch's. NOTE: either library's sum of a
    row may differ in the last bit with the rows beside it (MKL's at 1 row and 2)."""
    num_rows = x.shape[0]
    if num_rows == 0:
        return x.new_zeros((0, weight.shape[0]))
    if not weight.is_mkldnn:
        is_small = weight.numel() < PACK_MIN_ELEMENTS
        is_few_rows = (num_rows if num_seqs is None else num_seqs) < ONEDNN_MIN_ROWS
        # NOTE: oneDNN reads a plain weight row-major: a strided large one would be copied
        # whole on every call
        is_strided_large = not (is_small or weight.is_contiguous())
        if is_small and is_few_rows or is_strided_large:
            return F.linear(x, weight, bias)
        weight = weight.contiguous()
    if bias is not None:
        bias = bias.contiguous()  # NOTE: oneDNN reads the bias as contiguous, whatever its strides
    rows = padded_rows(num_rows) if num_rows >= ONEDNN_MIN_ROWS else num_rows
    if rows == num_rows:
        x = x.contiguous()  # NOTE: oneDNN reads x row-major: a slice of columns is copied
    else:
        x = torch.cat([x, x.new_zeros(rows - num_rows, x.shape[1])])
    return onednn_linear(x, weight, bias)[:num_rows]
