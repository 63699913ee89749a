"""Device ops behind one function each. Every function picks the fastest
implementation for its tensors' device (backend_for gives them all at once);
`portable` is always there: the reference, and what serves where no faster
backend loads."""

from __future__ import annotations

from kernels.backends import backend_for, describe
from kernels.portable import rotary_cos_sin  # table set-up, not a hot op: the portable one

__all__ = [
    "add_rms_norm",
    "advance_step",
    "compute_slot_mapping",
    "decode_attention",
    "describe",
    "embedding",
    "linear",
    "pack_linear_weight",
    "prefill_attention",
    "prompt_lookup",
    "qk_norm_rope",
    "qk_norm_rope_write_kv",
    "rms_norm",
    "rotary_cos_sin",
    "silu_mul",
    "verify_attention",
    "write_kv",
]


def rms_norm(x, weight, eps):
    return backend_for(x).rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps):
    return backend_for(x).add_rms_norm(x, residual, weight, eps)


def qk_norm_rope(q, k, q_weight, k_weight, cos_sin, positions, eps):
    return backend_for(q).qk_norm_rope(q, k, q_weight, k_weight, cos_sin, positions, eps)


def qk_norm_rope_write_kv(
    q, k, v, q_weight, k_weight, cos_sin, positions, eps, k_cache, v_cache, slot_mapping
):
    return backend_for(q).qk_norm_rope_write_kv(
        q, k, v, q_weight, k_weight, cos_sin, positions, eps, k_cache, v_cache, slot_mapping
    )


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    return backend_for(k).write_kv(k_cache, v_cache, k, v, slot_mapping)


def verify_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale, num_queries, host_seq_lens=None
):
    return backend_for(q).verify_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, num_queries, host_seq_lens
    )


def prefill_attention(
    q, k_cache, v_cache, block_tables, query_lens, context_lens, scale, meta=None
):
    return backend_for(q).prefill_attention(
        q, k_cache, v_cache, block_tables, query_lens, context_lens, scale, meta
    )


def linear(x, weight, bias=None, num_seqs=None):
    """num_seqs: the rows are that many sequences' (a verify step's several rows each): the
    kernel is picked as for a call of num_seqs rows (see portable.linear)."""
    return backend_for(x).linear(x, weight, bias, num_seqs)


def pack_linear_weight(weight, is_embedding=False):
    """Once, at load: a linear weight [N, K] laid out as its device's linear() reads it
    fastest (the same tensor where nothing is faster); is_embedding: a layout its
    embedding() also reads, or the weight as it is."""
    return backend_for(weight).pack_linear_weight(weight, is_embedding)


def embedding(ids, table):
    return backend_for(table).embedding(ids, table)


def silu_mul(gate_up):
    return backend_for(gate_up).silu_mul(gate_up)


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, host_seq_lens=None):
    return backend_for(q).decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, host_seq_lens
    )


def compute_slot_mapping(seq_lens, block_tables, block_size, out):
    return backend_for(seq_lens).compute_slot_mapping(seq_lens, block_tables, block_size, out)


def advance_step(input_ids, sampled, seq_lens, step_inc, history=None):
    return backend_for(input_ids).advance_step(input_ids, sampled, seq_lens, step_inc, history)


def prompt_lookup(tokens, seq_lens, k, min_n, max_n, width):
    """Drafts [n, k] from each row's own tokens (speculative decoding's prompt lookup)."""
    return backend_for(tokens).prompt_lookup(tokens, seq_lens, k, min_n, max_n, width)
