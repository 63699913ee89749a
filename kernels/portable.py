"""Portable PyTorch implementations of every device op. They run on any device
and are the reference the fast versions are tested against.

Layout of one layer's cache: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
A slot is block_id * block_size + offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Whether torch's oneDNN multiplies bf16 natively on this CPU (AVX512-BF16, AMX; NOTE: it may
# also say so for plain AVX-512, where it is no faster, and no slower, than torch's own).
IS_BF16_NATIVE = (
    torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
)
PACK_BATCH_HINT = 16  # oneDNN's layout hint for a packed linear weight (any batch runs)


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """A CPU weight [N, K] laid out once in oneDNN's layout for onednn_linear (NOTE: the
    batch hint only tunes the layout; measured even from 1 to 1,024 rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) through oneDNN, the weight packed (onednn_pack) or
    plain and contiguous, all in one dtype."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> [..., D]; statistics in fp32, scale in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_cos_sin(
    max_positions: int, head_dim: int, theta: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[max_positions, 2, head_dim] fp32 table of (cos, sin), halves repeated."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos(), emb.sin()), dim=1).to(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm then rotary embedding.
    q [T, Hq, D], k [T, Hk, D], cos_sin [max_pos, 2, D], positions [T]."""
    cs = cos_sin[positions]  # [T, 2, D]
    cos = cs[:, 0, None, :].to(q.dtype)
    sin = cs[:, 1, None, :].to(q.dtype)
    q = rms_norm(q, q_weight, eps)
    k = rms_norm(k, k_weight, eps)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rope_write_kv(
    q, k, v, q_weight, k_weight, cos_sin, positions, eps, k_cache, v_cache, slot_mapping
):
    """qk_norm_rope, then k and v into their cache slots. -> q."""
    q, k = qk_norm_rope(q, k, q_weight, k_weight, cos_sin, positions, eps)
    write_kv(k_cache, v_cache, k, v, slot_mapping)
    return q


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [T, Hk, D] into the caches at slot_mapping [T] (rounded to the cache's dtype)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping.long(), k.to(k_cache.dtype)
    )
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping.long(), v.to(v_cache.dtype)
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    scale: float,
    meta: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for a variable-length batch of prompt chunks whose KV is
    already in the cache. q [T, Hq, D] packs the chunks back to back; chunk i has
    query_lens[i] tokens that follow context_lens[i] cached ones. -> [T, Hq, D]."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens)):
        total = ctx_len + q_len
        blocks = block_tables[i, : (total + block_size - 1) // block_size].long()
        # (a cache in another dtype than q: its KV in q's, as the CPU backend's long chunks ask)
        k = (
            k_cache[blocks]
            .reshape(-1, num_kv_heads, head_dim)[:total]
            .to(q.dtype)
            .transpose(0, 1)[None]
        )
        v = (
            v_cache[blocks]
            .reshape(-1, num_kv_heads, head_dim)[:total]
            .to(q.dtype)
            .transpose(0, 1)[None]
        )
        qi = q[start : start + q_len].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        # NOTE: is_causal aligns the mask top-left; after a cached context the
        # diagonal is shifted by ctx_len, so that case takes an explicit mask. The
        # batch dimension matters: 3-D inputs miss the fused CPU kernel.
        mask = None
        if ctx_len:
            q_pos = torch.arange(ctx_len, total, device=q.device)
            mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            qi, k, v, attn_mask=mask, is_causal=not ctx_len, scale=scale, enable_gqa=True
        )
        out[start : start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    host_seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence over its paged context.
    q [B, Hq, D], block_tables [B, W] (W blocks cover the longest context),
    seq_lens [B] (tokens in the cache, the current one included). -> [B, Hq, D].
    host_seq_lens: the same on the host, for backends whose kernels read it there.
    Every shape is fixed by B and W, so this can be captured in a device graph."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    width = block_tables.shape[1] * block_size
    k = k_cache[block_tables.long()].view(num_seqs, width, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache[block_tables.long()].view(num_seqs, width, num_kv_heads, head_dim).transpose(1, 2)
    mask = torch.arange(width, device=q.device)[None, :] < seq_lens[:, None]  # [B, width]
    o = F.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )  # [B, Hq, 1, D]
    return o[:, :, 0]


def verify_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_queries: int,
    host_seq_lens: torch.Tensor | None = None,
    decode_attention=decode_attention,
) -> torch.Tensor:
    """A verify step's attention: q [B * Q, Hq, D], row i's Q queries together (its next
    input, then its drafts); seq_lens [B] counts row i's tokens with all Q, and query j
    reads the first seq_lens[i] - (Q - 1 - j). -> [B * Q, Hq, D]. Spread over a decode
    attention (the backend's) of B * Q rows, each row's table repeated."""
    steps = torch.arange(num_queries, device=seq_lens.device, dtype=seq_lens.dtype)
    lens = (seq_lens[:, None] - (num_queries - 1) + steps).reshape(-1)
    tables = block_tables.repeat_interleave(num_queries, 0)
    if host_seq_lens is not None:
        host_seq_lens = (host_seq_lens[:, None] - (num_queries - 1) + steps.cpu()).reshape(-1)
    return decode_attention(q, k_cache, v_cache, tables, lens, scale, host_seq_lens)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    num_seqs: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N], in x's dtype (the activations'), with
    the weight in its own (a CPU keeps bf16 weights under fp32 activations). A weight packed
    for oneDNN (pack_linear_weight of a CPU backend) runs through oneDNN's own linear.
    num_seqs: the M rows are that many sequences' (a verify step: each sequence's next
    input and its drafts); a backend that picks its kernel by M picks it by num_seqs, so a
    row comes out as in a plain step of num_seqs rows (kernels/cpu_linear.py). NOTE: here
    torch picks: a library whose sums depend on M may still differ in the last bit."""
    if weight.is_mkldnn:
        bias = None if bias is None else bias.to(weight.dtype)
        return onednn_linear(x.to(weight.dtype), weight, bias).to(x.dtype)
    if x.dtype == weight.dtype:
        return F.linear(x, weight, bias)
    bias = None if bias is None else bias.to(weight.dtype)  # held in x's dtype (qwen3.py)
    out = F.linear(x.to(weight.dtype), weight, bias)
    return out.to(x.dtype)


def pack_linear_weight(weight: torch.Tensor, is_embedding: bool = False) -> torch.Tensor:
    """The weight as linear() reads it fastest. A bf16 weight on a CPU whose oneDNN has bf16
    (IS_BF16_NATIVE) is laid out once for oneDNN: its linear then streams the weight instead
    of laying it out again on every call (1.3-1.6x at 1-64 rows at Qwen3-0.6B's shapes, even
    from 1,024: pdserve bench linear). Any other weight as it is (NOTE: this is also the
    fallback of backends that define none, so it looks at the device). is_embedding: the
    weight is also an embedding table, which embedding() must still read (oneDNN's layout
    cannot be indexed: it stays as it is)."""
    if is_embedding or not (
        IS_BF16_NATIVE
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
    ):
        return weight
    return onednn_pack(weight)


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows of table [V, H] (a tied table is also the lm_head: packed as its backend packs)."""
    return F.embedding(ids, table)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def compute_slot_mapping(
    seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, out: torch.Tensor
) -> None:
    """The slot of each sequence's current token (position seq_lens - 1), into out [B]."""
    pos = (seq_lens - 1).long()
    block = block_tables.gather(
        1, (pos // block_size).clamp_(0, block_tables.shape[1] - 1)[:, None]
    )
    out.copy_(block[:, 0].long() * block_size + pos % block_size)


def advance_step(
    input_ids: torch.Tensor,
    sampled: torch.Tensor,
    seq_lens: torch.Tensor,
    step_inc: torch.Tensor,
    history: torch.Tensor | None = None,
) -> None:
    """After sampling: the sampled ids become the next inputs, each live sequence grows by one.
    step_inc [B] is 1 for live rows and 0 for padding rows. history: each row's tokens
    [>= B, W] (a drafter's), where row b's sampled id is written at position seq_lens[b]
    first. NOTE: W must exceed every seq_lens[b] (the C op skips a position past it)."""
    if history is not None:
        pos = seq_lens[:, None].long()  # [B, 1]
        history[: pos.shape[0]].scatter_(1, pos, sampled[:, None].to(history.dtype))
    input_ids.copy_(sampled)
    seq_lens.add_(step_inc)


def prompt_lookup(
    tokens: torch.Tensor, seq_lens: torch.Tensor, k: int, min_n: int, max_n: int, width: int
) -> torch.Tensor:
    """Drafts [n, k] int64 (-1: none) for rows tokens [n, >= width] int32 of seq_lens [n]
    tokens each (at most width): each row's last m tokens (m from max_n down to min_n, the
    longest found wins) at their latest earlier place that a token follows; the drafts
    are what followed, repeated past the row's end (the suffix recurs every len - start
    tokens: loops and repeated lines)."""
    rows = tokens[:, :width]  # [n, W]
    lens = seq_lens[:, None].long()  # [n, 1]
    start = torch.full_like(lens, -1)  # where each row's drafts begin
    steps = torch.arange(max(k, max_n), device=tokens.device)
    for size in range(max_n, min_n - 1, -1):
        if width <= size:
            continue
        suffix = rows.gather(1, (lens - size + steps[:size]).clamp_(min=0))  # [n, size]
        windows = rows.unfold(1, size, 1)  # [n, W - size + 1, size]
        is_hit = (windows == suffix[:, None, :]).all(-1)  # [n, P]
        # A match must end before the last token: at least one token follows it.
        p = torch.arange(is_hit.shape[1], device=rows.device)
        is_hit &= p[None, :] <= lens - size - 1
        latest = torch.where(is_hit, p[None, :], -1).amax(1, keepdim=True)  # [n, 1]
        start = torch.where((start < 0) & (latest >= 0), latest + size, start)
    period = (lens - start).clamp_(min=1)
    pos = start + steps[:k] % period  # [n, k]
    drafts = rows.gather(1, pos.clamp_(0, width - 1)).long()
    return drafts.masked_fill_(start < 0, -1)
