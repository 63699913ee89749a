"""Triton paged attention for CUDA: decode (split along the context, then reduced) and
prefill (a chunk's queries over its cached context), behind the op functions of
kernels/portable.py; kernels/triton_cuda.py serves them with the other Triton ops."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import portable


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not be rounded to tf32 inside tl.dot, or fp32 results drift.
    return "ieee" if dtype == torch.float32 else "tf32"


# ---- paged decode attention (split along the context) ---------------------------


@triton.jit
def _load_paged_kv(
    KC,
    VC,
    table_row,
    pos,
    valid,
    kv_head,
    stride_slot,
    stride_cache_h,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """The K and V rows [len(pos), D] of one KV head at token positions pos, found
    through the sequence's block-table row; invalid positions read as zeros."""
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    offs = slot[:, None] * stride_slot + kv_head * stride_cache_h + tl.arange(0, D)[None, :]
    k = tl.load(KC + offs, mask=valid[:, None], other=0.0)
    v = tl.load(VC + offs, mask=valid[:, None], other=0.0)
    return k, v


@triton.jit
def _online_softmax_step(q, k, v, keep, m, row_sum, acc, scale, PRECISION: tl.constexpr):
    """Fold one key tile into the running (max, sum, weighted values) of each query row.
    keep [rows, keys] marks the scores that count; every row must keep one key by
    the end of its first tile, or its max stays -inf."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    scores = tl.where(keep, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, row_sum, acc


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_attn_kernel(
    Q,
    KC,
    VC,
    BT,
    SL,
    Out,
    MidO,
    MidML,
    scale,
    stride_qb,
    stride_qh,
    stride_bt,
    stride_slot,
    stride_cache_h,
    num_splits,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(SL + b)
    num_tiles = tl.cdiv(seq_len, TILE)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_start = s * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kvh * G + g
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=(g < G)[:, None],
        other=0.0,
    )
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    t = tl.arange(0, TILE)
    for tile in range(tile_start, tile_end):
        pos = tile * TILE + t
        valid = pos < seq_len
        k, v = _load_paged_kv(
            KC, VC, BT + b * stride_bt, pos, valid, kvh, stride_slot, stride_cache_h, D, BLOCK_SIZE
        )
        m, row_sum, acc = _online_softmax_step(
            q, k, v, valid[None, :], m, row_sum, acc, scale, PRECISION
        )
    if IS_SPLIT:
        # Partial results [B, Hq, S, D] and (max, sum) [B, Hq, S, 2]; an empty split leaves
        # m = -inf.
        row = (b * tl.num_programs(1) * G + heads) * num_splits + s
        tl.store(MidO + row[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
        tl.store(MidML + row * 2, m, mask=g < G)
        tl.store(MidML + row * 2 + 1, row_sum, mask=g < G)
    else:
        out = acc / row_sum[:, None]
        tl.store(
            Out + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=(g < G)[:, None],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    MidO,
    MidML,
    Out,
    stride_ob,
    stride_oh,
    num_heads,
    num_splits,
    S_PAD: tl.constexpr,
    D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    row = (b * num_heads + h) * num_splits + s
    ok = s < num_splits
    m = tl.load(MidML + row * 2, mask=ok, other=float("-inf"))
    row_sum = tl.load(MidML + row * 2 + 1, mask=ok, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
    acc = tl.load(MidO + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(row_sum * w, axis=0)
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty))


def _num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about twice; batches that fill it alone need no split."""
    # (A CPU tensor only reaches here under Triton's interpreter, in tests.)
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    return max(1, min(32, (2 * sms) // max(batch * num_kv_heads, 1)))


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, host_seq_lens=None):
    num_seqs, num_heads, d = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((num_seqs, num_heads, d), dtype=q.dtype, device=q.device)
    splits = _num_splits(num_seqs, num_kv_heads, q.device)
    tile = max(16, min(64, block_size * 4))
    mid_o = mid_ml = out
    if splits > 1:
        mid_o = torch.empty((num_seqs, num_heads, splits, d), dtype=torch.float32, device=q.device)
        mid_ml = torch.empty((num_seqs, num_heads, splits, 2), dtype=torch.float32, device=q.device)
    _decode_attn_kernel[(num_seqs, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        mid_o,
        mid_ml,
        scale,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        splits,
        G=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        D=d,
        BLOCK_SIZE=block_size,
        TILE=tile,
        IS_SPLIT=splits > 1,
        PRECISION=_precision(q.dtype),
    )
    if splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            mid_o,
            mid_ml,
            out,
            out.stride(0),
            out.stride(1),
            num_heads,
            splits,
            S_PAD=max(2, triton.next_power_of_2(splits)),
            D=d,
        )
    return out


# ---- prefill attention: paged, variable length, causal ---------------------------


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_attn_kernel(
    Q,
    KC,
    VC,
    BT,
    Meta,
    Out,
    scale,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_slot,
    stride_cache_h,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (sequence, BLOCK_M queries, head). Keys come from the cache
    through the block table: the chunk's own keys were written there just before,
    and any earlier context is read the same way."""
    seq = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    h = tl.program_id(2)
    q_start = tl.load(Meta + seq)
    q_len = tl.load(Meta + num_seqs + seq)
    ctx = tl.load(Meta + 2 * num_seqs + seq)
    if m0 >= q_len:
        return
    kvh = h // G
    offs_m = m0 + tl.arange(0, BLOCK_M)
    valid_m = offs_m < q_len
    d = tl.arange(0, D)
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=valid_m[:, None],
        other=0.0,
    )
    q_pos = ctx + offs_m
    end = tl.minimum(ctx + m0 + BLOCK_M, ctx + q_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        valid_n = k_pos < end
        k, v = _load_paged_kv(
            KC,
            VC,
            BT + seq * stride_bt,
            k_pos,
            valid_n,
            kvh,
            stride_slot,
            stride_cache_h,
            D,
            BLOCK_SIZE,
        )
        # The first key tile holds position 0, which every query sees.
        keep = (k_pos[None, :] <= q_pos[:, None]) & valid_n[None, :]
        m_i, l_i, acc = _online_softmax_step(q, k, v, keep, m_i, l_i, acc, scale, PRECISION)
    out = acc / l_i[:, None]
    tl.store(
        Out + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=valid_m[:, None],
    )


def prefill_attention(
    q, k_cache, v_cache, block_tables, query_lens, context_lens, scale, meta=None
):
    """q [T, Hq, D] packed chunks; meta [3, B] int32 on the device: each chunk's first
    row in q, its length, and its cached context (made by the worker once per forward)."""
    if meta is None:
        return portable.prefill_attention(
            q, k_cache, v_cache, block_tables, query_lens, context_lens, scale
        )
    num_tokens, num_heads, d = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((num_tokens, num_heads, d), dtype=q.dtype, device=q.device)
    block_m = 64
    grid = (len(query_lens), triton.cdiv(max(query_lens), block_m), num_heads)
    _prefill_attn_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        meta,
        out,
        scale,
        len(query_lens),
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        G=num_heads // num_kv_heads,
        D=d,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=64,
        PRECISION=_precision(q.dtype),
    )
    return out
