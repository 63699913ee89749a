"""Triton kernels for CUDA, behind the same op functions as kernels/portable.py: norms,
rotary embedding, the gated activation and KV writes here; the paged attention in
kernels/triton_attention.py.

Importing this module fails where Triton is missing; kernels/backends.py then
keeps the portable ops. Ops not defined here fall back to the portable ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import portable
from kernels.triton_attention import decode_attention, prefill_attention

__all__ = [
    "add_rms_norm",
    "decode_attention",
    "prefill_attention",
    "qk_norm_rope",
    "qk_norm_rope_write_kv",
    "rms_norm",
    "silu_mul",
    "write_kv",
]


# ---- RMSNorm, fused residual add ---------------------------------------------


@triton.jit
def _rms_norm_kernel(
    X,
    R,
    W,
    Out,
    ResOut,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Round the sum to the model dtype first, as the unfused model does.
        x = x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = w * (xf * inv).to(x.dtype)
    tl.store(Out + row * stride_o + cols, y, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x.reshape(-1, x.shape[-1]))
    out = torch.empty_like(x2)
    n = x2.shape[-1]
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        x2,
        weight,
        out,
        out,
        x2.stride(0),
        0,
        out.stride(0),
        0,
        n,
        eps,
        HAS_RESIDUAL=False,
        BLOCK=triton.next_power_of_2(n),
    )
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = _rows(x.reshape(-1, x.shape[-1]))
    r2 = _rows(residual.reshape(-1, x.shape[-1]))
    out, res_out = torch.empty_like(x2), torch.empty_like(x2)
    n = x2.shape[-1]
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight,
        out,
        res_out,
        x2.stride(0),
        r2.stride(0),
        out.stride(0),
        res_out.stride(0),
        n,
        eps,
        HAS_RESIDUAL=True,
        BLOCK=triton.next_power_of_2(n),
    )
    return out.view(x.shape), res_out.view(x.shape)


# ---- per-head RMSNorm + rotary embedding ---------------------------------------


@triton.jit
def _norm_rope_heads(
    src, stride_h, W, dst, num_heads, cos, sin, eps, H_PAD: tl.constexpr, D: tl.constexpr
):
    """RMSNorm each head of one token over D, scale by W, rotate; [H_PAD, D/2] halves.
    dst: the token's heads, contiguous [num_heads, D] (a q row or a KV-cache slot)."""
    half: tl.constexpr = D // 2
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, half)[None, :]
    ok = h < num_heads
    x1 = tl.load(src + h * stride_h + d, mask=ok, other=0.0)
    x2 = tl.load(src + h * stride_h + half + d, mask=ok, other=0.0)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / D + eps)[:, None]
    y1 = (tl.load(W + d) * (f1 * inv).to(x1.dtype)).to(tl.float32)
    y2 = (tl.load(W + half + d) * (f2 * inv).to(x1.dtype)).to(tl.float32)
    tl.store(dst + h * D + d, (y1 * cos - y2 * sin).to(x1.dtype), mask=ok)
    tl.store(dst + h * D + half + d, (y2 * cos + y1 * sin).to(x1.dtype), mask=ok)


@triton.jit
def _qk_norm_rope_kernel(
    Q,
    K,
    V,
    QW,
    KW,
    CS,
    Pos,
    QOut,
    KOut,
    VOut,
    Slots,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_q_heads,
    num_kv_heads,
    eps,
    D: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HK_PAD: tl.constexpr,
    TO_CACHE: tl.constexpr,
):
    """With TO_CACHE, k goes straight to its cache slot and v is copied beside it."""
    t = tl.program_id(0)
    half: tl.constexpr = D // 2
    d = tl.arange(0, half)[None, :]
    pos = tl.load(Pos + t)
    cos = tl.load(CS + pos * 2 * D + d)  # halves repeat, so the first half serves both
    sin = tl.load(CS + pos * 2 * D + D + d)
    _norm_rope_heads(
        Q + t * stride_qt,
        stride_qh,
        QW,
        QOut + t * num_q_heads * D,
        num_q_heads,
        cos,
        sin,
        eps,
        HQ_PAD,
        D,
    )
    row = tl.load(Slots + t).to(tl.int64) if TO_CACHE else t
    _norm_rope_heads(
        K + t * stride_kt,
        stride_kh,
        KW,
        KOut + row * num_kv_heads * D,
        num_kv_heads,
        cos,
        sin,
        eps,
        HK_PAD,
        D,
    )
    if TO_CACHE:
        h = tl.arange(0, HK_PAD)[:, None]
        dd = tl.arange(0, D)[None, :]
        ok = h < num_kv_heads
        v = tl.load(V + t * stride_vt + h * stride_vh + dd, mask=ok)
        tl.store(VOut + row * num_kv_heads * D + h * D + dd, v, mask=ok)


def qk_norm_rope(q, k, q_weight, k_weight, cos_sin, positions, eps):
    num_tokens, num_q_heads, d = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_q_heads, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((num_tokens, num_kv_heads, d), dtype=k.dtype, device=k.device)
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens,)](
            q,
            k,
            k,
            q_weight,
            k_weight,
            cos_sin,
            positions,
            q_out,
            k_out,
            k_out,
            positions,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            0,
            0,
            num_q_heads,
            num_kv_heads,
            eps,
            D=d,
            HQ_PAD=triton.next_power_of_2(num_q_heads),
            HK_PAD=triton.next_power_of_2(num_kv_heads),
            TO_CACHE=False,
        )
    return q_out, k_out


def qk_norm_rope_write_kv(
    q, k, v, q_weight, k_weight, cos_sin, positions, eps, k_cache, v_cache, slot_mapping
):
    """qk_norm_rope, with k and v written to their cache slots in the same pass. -> q."""
    num_tokens, num_q_heads, d = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_q_heads, d), dtype=q.dtype, device=q.device)
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens,)](
            q,
            k,
            v,
            q_weight,
            k_weight,
            cos_sin,
            positions,
            q_out,
            k_cache,
            v_cache,
            slot_mapping,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            num_q_heads,
            num_kv_heads,
            eps,
            D=d,
            HQ_PAD=triton.next_power_of_2(num_q_heads),
            HK_PAD=triton.next_power_of_2(num_kv_heads),
            TO_CACHE=True,
        )
    return q_out


# ---- SwiGLU ------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(X, Out, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(Out + row * stride_o + cols, silu * up, mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up [T, I], in one pass."""
    n = gate_up.shape[-1] // 2
    x = _rows(gate_up)
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    block = 1024
    if x.shape[0]:
        _silu_mul_kernel[(x.shape[0], triton.cdiv(n, block))](
            x, out, x.stride(0), out.stride(0), n, BLOCK=block
        )
    return out


# ---- KV cache write -------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    K, V, KC, VC, Slots, stride_kt, stride_vt, ROW: tl.constexpr, BLOCK: tl.constexpr
):
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    tl.store(KC + slot * ROW + offs, tl.load(K + t * stride_kt + offs, mask=mask), mask=mask)
    tl.store(VC + slot * ROW + offs, tl.load(V + t * stride_vt + offs, mask=mask), mask=mask)


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """k, v [T, Hk, D] (each token's heads contiguous) into caches [NB, bs, Hk, D]."""
    row = k.shape[1] * k.shape[2]
    if (
        k.stride(1) != k.shape[2]
        or v.stride(1) != v.shape[2]
        or k.stride(2) != 1
        or v.stride(2) != 1
    ):
        return portable.write_kv(k_cache, v_cache, k, v, slot_mapping)
    if k.shape[0]:
        _write_kv_kernel[(k.shape[0],)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k.stride(0),
            v.stride(0),
            ROW=row,
            BLOCK=triton.next_power_of_2(row),
        )
