"""Ascend NPU ops through torch_npu's fused kernels, behind the same op functions.

Importing this module fails where torch_npu is missing; kernels/backends.py then
keeps the portable ops. These ops take sequence lengths on the host: the worker
passes its host mirror of the decode lengths (host_seq_lens), so nothing is read
back from the device to call them.

NOTE: written against torch_npu's documented signatures; it has not yet run on
Ascend hardware (see the README's hardware table).
"""

from __future__ import annotations

import torch
import torch_npu  # noqa: F401  (registers the npu device and the ops)

from kernels import portable

_CAUSAL_MASK: dict[torch.device, torch.Tensor] = {}


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """k, v [T, Hk, D] into caches [num_blocks, block_size, Hk, D] (ND layout)."""
    torch_npu._npu_reshape_and_cache(
        key=k.contiguous(),
        value=v.contiguous(),
        key_cache=k_cache,
        value_cache=v_cache,
        slot_indices=slot_mapping.to(torch.int32),
    )


def qk_norm_rope_write_kv(
    q, k, v, q_weight, k_weight, cos_sin, positions, eps, k_cache, v_cache, slot_mapping
):
    q, k = portable.qk_norm_rope(q, k, q_weight, k_weight, cos_sin, positions, eps)
    write_kv(k_cache, v_cache, k, v, slot_mapping)
    return q


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, host_seq_lens=None):
    """The fused paged attention for one query per sequence; it reads the lengths
    from the host, so without the host mirror the portable op serves."""
    if host_seq_lens is None:
        return portable.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = torch.empty_like(q)
    torch_npu._npu_paged_attention(
        query=q.contiguous(),
        key_cache=k_cache,
        value_cache=v_cache,
        num_kv_heads=k_cache.shape[2],
        num_heads=q.shape[1],
        scale_value=scale,
        block_table=block_tables.to(torch.int32),
        context_lens=host_seq_lens.to(torch.int32),
        out=out,
    )
    return out


def _causal_mask(device: torch.device) -> torch.Tensor:
    # sparse_mode=3 takes a fixed 2048 x 2048 upper-triangular mask and applies it causally.
    if device not in _CAUSAL_MASK:
        _CAUSAL_MASK[device] = torch.triu(
            torch.ones(2048, 2048, dtype=torch.bool, device=device), 1
        )
    return _CAUSAL_MASK[device]


def prefill_attention(
    q, k_cache, v_cache, block_tables, query_lens, context_lens, scale, meta=None
):
    """Fresh prompts (no cached context) go through the fused inference attention in
    the packed TND layout; chunks after cached context use the portable op."""
    if any(context_lens):
        return portable.prefill_attention(
            q, k_cache, v_cache, block_tables, query_lens, context_lens, scale
        )
    num_kv_heads, d = k_cache.shape[2], k_cache.shape[3]
    block_size = k_cache.shape[1]
    ks, vs = [], []
    for i, n in enumerate(query_lens):
        blocks = block_tables[i, : (n + block_size - 1) // block_size].long()
        ks.append(k_cache[blocks].reshape(-1, num_kv_heads, d)[:n])
        vs.append(v_cache[blocks].reshape(-1, num_kv_heads, d)[:n])
    cumulative = torch.tensor(query_lens).cumsum(0).tolist()
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q.contiguous(),
        torch.cat(ks),
        torch.cat(vs),
        num_heads=q.shape[1],
        num_key_value_heads=num_kv_heads,
        input_layout="TND",
        scale=scale,
        atten_mask=_causal_mask(q.device),
        sparse_mode=3,
        actual_seq_lengths=cumulative,
        actual_seq_lengths_kv=cumulative,
    )
    return out
