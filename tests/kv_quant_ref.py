"""The reference for an 8-bit KV cache: transformers' own Qwen3 with a cache that applies
per-token, per-head quantize-dequantize to each K and V it stores, written out here from
the format's definition (kernels/kv_quant.py's docstring), not from pdserve's code:
scale = max |x| over a head's row / QMAX (127 for int8, 448 for fp8 e4m3; 1 for a row of
zeros); int8 rounds x / scale to nearest, fp8 converts it to e4m3; x' = value * scale."""

from __future__ import annotations

import torch
from transformers import DynamicCache

QMAX = {"int8": 127.0, "fp8": 448.0}


def quantize_dequantize(x: torch.Tensor, kv_format: str) -> torch.Tensor:
    """x [..., D] as the format keeps it, back in x's dtype."""
    qmax = QMAX[kv_format]
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = (xf / scale).clamp(-qmax, qmax)
    values = y.round() if kv_format == "int8" else y.to(torch.float8_e4m3fn).float()
    return (values * scale).to(x.dtype)


class QuantizedReferenceCache(DynamicCache):
    """A DynamicCache whose stored keys and values ([B, H, T, D], after RoPE) went through
    quantize_dequantize: attention reads them, the step's own tokens' included."""

    def __init__(self, kv_format: str, **kwargs):
        super().__init__(**kwargs)
        self.kv_format = kv_format

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(
            quantize_dequantize(key_states, self.kv_format),
            quantize_dequantize(value_states, self.kv_format),
            layer_idx,
            *args,
            **kwargs,
        )


class WireReferenceCache(DynamicCache):
    """The reference for int8 on the KV wire (--kv-wire-dtype int8): the prompt's own pass
    attends to its exact keys and values (the prefill node computes them so), but keeps
    them quantize-dequantized (what lands on the decode node); each token decoded after is
    kept exact."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.prompt_done: set[int] = set()

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx in self.prompt_done:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self.prompt_done.add(layer_idx)
        super().update(
            quantize_dequantize(key_states, "int8"),
            quantize_dequantize(value_states, "int8"),
            layer_idx,
            *args,
            **kwargs,
        )
        return key_states, value_states
