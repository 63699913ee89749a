"""Qwen3 dense: the model as plain functions over kernels/.

Weights are held fused: one [q;k;v] projection and one [gate;up] projection
per layer, so a layer is four matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

import kernels
from common.base.model_spec import ModelSpec
from kernels import kv_quant

MATRICES = ("qkv", "o_proj", "gate_up", "down")  # a layer's matmul weights


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hk) * D, H]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hk) * D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    o_proj: torch.Tensor  # [H, Hq * D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]


@dataclass
class Qwen3Weights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]; the embedding itself when tied

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.norm, self.lm_head]
        for layer in self.layers:
            out += [t for t in vars(layer).values() if t is not None]
        return out

    def num_bytes(self) -> int:
        seen: dict[int, int] = {}
        for t in self.tensors():  # NOTE: by object, not data_ptr: a packed weight has none
            seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())


@dataclass
class Model:
    """A loaded model and the KV cache its forward passes read and write."""

    spec: ModelSpec
    weights: Qwen3Weights
    cos_sin: torch.Tensor  # [max_model_len, D] rotary table
    kv_cache: torch.Tensor  # [L, 2, num_blocks, block_size, Hk, D]


def random_weights(
    spec: ModelSpec, device, dtype, seed: int = 0, std: float = 0.02
) -> Qwen3Weights:
    """Random weights of the exact shape, made on the device (benchmarks: values do not
    change cost)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(
            dtype
        )

    def ones(n):
        return torch.ones(n, device=device, dtype=dtype)

    h, d = spec.hidden_size, spec.head_dim
    layers = [
        LayerWeights(
            input_norm=ones(h),
            qkv=rand(spec.q_size + 2 * spec.kv_size, h),
            qkv_bias=rand(spec.q_size + 2 * spec.kv_size) if spec.has_attention_bias else None,
            q_norm=ones(d),
            k_norm=ones(d),
            o_proj=rand(h, spec.q_size),
            post_norm=ones(h),
            gate_up=rand(2 * spec.intermediate_size, h),
            down=rand(h, spec.intermediate_size),
        )
        for _ in range(spec.num_layers)
    ]
    embed = rand(spec.vocab_size, h)
    lm_head = embed if spec.is_tied_embeddings else rand(spec.vocab_size, h)
    return Qwen3Weights(embed=embed, layers=layers, norm=ones(h), lm_head=lm_head)


@dataclass
class AttentionInputs:
    """What attention needs for one forward. Prefill: query_lens/context_lens are
    host lists. Decode: seq_lens is a device tensor and every query_len is 1."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor | None = None  # [B] int32, decode
    host_seq_lens: torch.Tensor | None = None  # the same on the host (for Ascend's kernels)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    prefill_meta: torch.Tensor | None = None  # [3, B] int32: chunk starts, lengths, contexts
    # decode, a verify step: each row's queries (its next input and drafts), the row's
    # seq_lens counting all of them (kernels.verify_attention)
    num_queries: int = 1


def forward(
    spec: ModelSpec,
    w: Qwen3Weights,
    kv_cache: torch.Tensor,
    cos_sin: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attn: AttentionInputs,
    between_layers: Callable[[int], None] | None = None,
    kv_written: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """input_ids, positions [T]; kv_cache [L, 2, num_blocks, block_size, Hk, D].
    Returns the final normed hidden states [T, H]. between_layers(n), if given, runs
    after each layer but the last, n layers done (a CPU node resizes its threads there).
    kv_written(n), if given, runs as soon as layer n - 1's KV write is queued, before its
    attention, the last layer's too: a prefill node pushes those n layers' KV while the
    rest of the layer computes."""
    num_tokens = input_ids.shape[0]
    eps, d = spec.rms_norm_eps, spec.head_dim
    scale = d**-0.5
    # The ops for this device, looked up once per forward (per call, on CPU, the lookup
    # is a visible share of a small step).
    ops = kernels.backend_for(input_ids)
    h = ops.embedding(input_ids, w.embed).to(w.norm.dtype)  # activations: the norms' dtype
    tables = attn.block_tables
    is_quantized = kv_quant.is_quantized(kv_cache)
    # NOTE: where attention does not read 8-bit rows in place, it reads the blocks its step
    # names, dequantized once a layer (kv_quant.py)
    is_dense = is_quantized and (attn.is_prefill or not getattr(ops, "reads_8bit_kv", False))
    if is_dense:
        used, tables = kv_quant.blocks_used(tables)
    residual = None
    # a verify step's rows are its sequences' (several each): ops.linear computes each
    # as in a plain step of its sequences (kernels/portable.py)
    num_seqs = None if attn.is_prefill or attn.num_queries == 1 else num_tokens // attn.num_queries
    for i, layer in enumerate(w.layers):
        if residual is None:
            x, residual = ops.rms_norm(h, layer.input_norm, eps), h
        else:
            x, residual = ops.add_rms_norm(h, residual, layer.input_norm, eps)
        qkv = ops.linear(x, layer.qkv, layer.qkv_bias, num_seqs)
        q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        q = q.view(num_tokens, spec.num_heads, d)
        k = k.view(num_tokens, spec.num_kv_heads, d)
        v = v.view(num_tokens, spec.num_kv_heads, d)
        k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
        if is_quantized:
            q, k = ops.qk_norm_rope(q, k, layer.q_norm, layer.k_norm, cos_sin, positions, eps)
            kv_quant.write_kv(k_cache, v_cache, k, v, attn.slot_mapping)
        else:
            q = ops.qk_norm_rope_write_kv(
                q,
                k,
                v,
                layer.q_norm,
                layer.k_norm,
                cos_sin,
                positions,
                eps,
                k_cache,
                v_cache,
                attn.slot_mapping,
            )
        if kv_written is not None:
            kv_written(i + 1)
        if is_dense:
            k_cache = kv_quant.dense_blocks(k_cache, used, q.dtype)
            v_cache = kv_quant.dense_blocks(v_cache, used, q.dtype)
        if attn.is_prefill:
            o = ops.prefill_attention(
                q,
                k_cache,
                v_cache,
                tables,
                attn.query_lens,
                attn.context_lens,
                scale,
                attn.prefill_meta,
            )
        elif attn.num_queries == 1:
            o = ops.decode_attention(
                q, k_cache, v_cache, tables, attn.seq_lens, scale, attn.host_seq_lens
            )
        else:
            o = ops.verify_attention(
                q,
                k_cache,
                v_cache,
                tables,
                attn.seq_lens,
                scale,
                attn.num_queries,
                attn.host_seq_lens,
            )
        h = ops.linear(o.reshape(num_tokens, spec.q_size), layer.o_proj, None, num_seqs)
        x, residual = ops.add_rms_norm(h, residual, layer.post_norm, eps)
        gate_up = ops.linear(x, layer.gate_up, None, num_seqs)
        h = ops.linear(ops.silu_mul(gate_up), layer.down, None, num_seqs)
        if between_layers is not None and i + 1 < len(w.layers):
            between_layers(i + 1)
    h, _ = ops.add_rms_norm(h, residual, w.norm, eps)
    return h


def compute_logits(
    w: Qwen3Weights, hidden: torch.Tensor, num_seqs: int | None = None
) -> torch.Tensor:
    """hidden [N, H] -> fp32 logits [N, V]. num_seqs: as kernels.linear's."""
    return kernels.linear(hidden, w.lm_head, None, num_seqs).float()


def set_activation_dtype(w: Qwen3Weights, dtype: torch.dtype) -> None:
    """Activations in `dtype` whatever the matrices' (a host computes in fp32 over bf16
    weights): the vectors they meet elementwise (norms, bias) are held in it."""
    for layer in w.layers:
        for name in ("input_norm", "q_norm", "k_norm", "post_norm", "qkv_bias"):
            if getattr(layer, name) is not None:
                setattr(layer, name, getattr(layer, name).to(dtype))
    w.norm = w.norm.to(dtype)


def hold_matrices(w: Qwen3Weights, hold: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Every matrix replaced by hold(it) (Platform.hold), a tied lm_head once: it stays the
    embedding table."""
    for layer in w.layers:
        for name in MATRICES:
            setattr(layer, name, hold(getattr(layer, name)))
    is_tied = w.lm_head is w.embed
    w.embed = hold(w.embed)
    w.lm_head = w.embed if is_tied else hold(w.lm_head)


def pack_matmul_weights(w: Qwen3Weights) -> None:
    """The matmuls' weights laid out once as their device's linear reads them fastest (a CPU
    with bf16 matrix units: their layout; elsewhere as they are). NOTE: a tied lm_head stays
    the embedding table itself, in a layout both read or as it is: never a second copy of
    the largest weight."""
    for layer in w.layers:
        for name in MATRICES:
            setattr(layer, name, kernels.pack_linear_weight(getattr(layer, name)))
    if w.lm_head is w.embed:
        w.embed = w.lm_head = kernels.pack_linear_weight(w.lm_head, is_embedding=True)
    else:
        w.lm_head = kernels.pack_linear_weight(w.lm_head)
