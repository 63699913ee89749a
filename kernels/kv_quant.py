"""KV in 8 bits (--kv-cache-dtype int8 | fp8): each token's K and V rows are quantized per
head as they are written, with the row's scale stored beside it.

A quantized cache keeps the one-tensor layout, [L, 2, num_blocks, block_size, Hk, D + 4]:
the row of (token, head) holds D 8-bit values and then its fp32 scale's 4 bytes, so a block
is still one slice of the tensor, and all that moves blocks (the KV transfers, swap, forks,
prefix caching, --kv-verify's sums) moves the scales with them. x ~ value * scale, where
scale = max |x| over the row / QMAX (127 for int8; 448 for fp8, e4m3) and 1 for a row of
zeros; int8 rounds to nearest, fp8 as torch converts to e4m3.

Storage: int8 values in an int8 tensor; fp8 values as their bytes in a uint8 tensor (torch
copies, selects and sends bytes on every device; not every op takes float8 tensors). The
two dtypes tell the formats apart wherever a cache's dtype is compared (the KV link's
handshake).

NOTE: prefill attention, and every attention on a device whose backend does not say
reads_8bit_kv, reads a dense copy of the blocks its batch touches, dequantized into the
activations' dtype (dense_blocks): the same on every device and exact against the
reference's quantize-dequantize. The CPU's decode and verify attention read the rows in
place (cpu_attention.c), a byte a value.
"""

from __future__ import annotations

import time

import torch

SCALE_BYTES = 4  # an fp32 scale after each head's D values
FORMATS = {"int8": torch.int8, "fp8": torch.uint8}  # --kv-cache-dtype -> storage dtype
_QMAX = {torch.int8: 127.0, torch.uint8: 448.0}


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in _QMAX


def row_size(head_dim: int, kv_format: str) -> int:
    """Elements of one (token, head) row in a cache of this format ("auto": the model's)."""
    return head_dim + SCALE_BYTES if kv_format in FORMATS else head_dim


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] -> [..., D + 4] rows of the storage dtype: values, then the fp32 scale."""
    qmax, d = _QMAX[dtype], x.shape[-1]
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)  # [..., 1]
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = xf / scale
    out = torch.empty(*x.shape[:-1], d + SCALE_BYTES, dtype=dtype, device=x.device)
    if dtype == torch.int8:
        out[..., :d] = y.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        out[..., :d] = y.clamp_(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    out.view(torch.uint8)[..., d:] = scale.view(torch.uint8)
    return out


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., D + 4] of a quantized cache -> [..., D] in dtype."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows.view(torch.uint8)[..., d:].contiguous().view(torch.float32)  # [..., 1]
    values = rows[..., :d]
    if rows.dtype == torch.uint8:
        values = values.contiguous().view(torch.float8_e4m3fn)
    return (values.float() * scale).to(dtype)


def round_trip_rate(like: torch.Tensor, synchronize, num_bytes: int = 4 * 2**20) -> float:
    """Bytes/s (of like's dtype) at which like's device quantizes rows [.., D] of like's
    dtype to int8 and dequantizes them back: what int8 on the KV wire costs (kv_wire.py).
    synchronize: waits for the device (its platform's)."""
    d = like.shape[-1]
    x = torch.randn(max(num_bytes // (d * like.element_size()), 1), d, device=like.device)
    x = x.to(like.dtype)
    dequantize(quantize(x, torch.int8), like.dtype)  # warm: the first call pays allocations
    synchronize()
    start = time.perf_counter()
    dequantize(quantize(x, torch.int8), like.dtype)
    synchronize()
    return x.nbytes / max(time.perf_counter() - start, 1e-9)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [T, Hk, D] quantized into their slots (slot_mapping [T]) of one layer's caches
    [num_blocks, block_size, Hk, D + 4]."""
    num_kv_heads, size = k_cache.shape[-2:]
    slots = slot_mapping.long()
    for cache, x in ((k_cache, k), (v_cache, v)):
        rows = quantize(x, cache.dtype).view(torch.uint8)
        cache.view(torch.uint8).view(-1, num_kv_heads, size).index_copy_(0, slots, rows)


def blocks_used(block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks a step's tables name, once each ([U], ascending), and the tables renumbered
    into them (as block_tables' shape and dtype): what dense_blocks' copies are read with."""
    ids, tables = torch.unique(block_tables, return_inverse=True)
    return ids, tables.to(block_tables.dtype).view_as(block_tables)


def dense_blocks(cache: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ids [U] of one layer's quantized cache, dequantized: [U, block_size, Hk, D]."""
    return dequantize(cache.index_select(0, ids), dtype)


def dense(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's caches as attention in dtype reads them, with the tables to read them by:
    a quantized cache's named blocks dequantized, any other as it is."""
    if not is_quantized(k_cache):
        return k_cache, v_cache, block_tables
    ids, tables = blocks_used(block_tables)
    return dense_blocks(k_cache, ids, dtype), dense_blocks(v_cache, ids, dtype), tables
