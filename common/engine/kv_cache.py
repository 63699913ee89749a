"""The KV cache: how many blocks the memory budget gives, and the one tensor that holds
them [L, 2, num_blocks, block_size, Hk, D] (D + 4 where 8-bit: kernels/kv_quant.py),
allocated by the device's platform."""

from __future__ import annotations

import torch

from common.base.config import WorkerConfig
from common.base.model_spec import ModelSpec
from common.kv.blocks import cache_shape, kv_cache_blocks
from kernels import kv_quant


def allocate_kv_cache(
    platform, spec: ModelSpec, cfg: WorkerConfig, dtype: torch.dtype
) -> torch.Tensor:
    """As many blocks as cfg's budget gives (the CPU default where none is set on a host,
    else a fraction of the device's free memory), null block included; in the model's dtype,
    or 8-bit with each row's scale beside it (cfg.kv_cache_dtype, kernels/kv_quant.py)."""
    budget = cfg.kv_cache_memory
    if budget is None and platform.is_host:
        budget = cfg.cpu_kv_cache_memory
    row = kv_quant.row_size(spec.head_dim, cfg.kv_cache_dtype)
    dtype = kv_quant.FORMATS.get(cfg.kv_cache_dtype, dtype)
    token_bytes = 2 * spec.num_layers * spec.num_kv_heads * row * dtype.itemsize
    num_blocks = kv_cache_blocks(
        token_bytes, cfg.block_size, platform.free_memory(), budget, cfg.kv_cache_fraction
    )
    shape = cache_shape(spec.num_layers, num_blocks, cfg.block_size, spec.num_kv_heads, row)
    return platform.allocate(shape, dtype, cfg.is_cache_in_shm)


def format_name(dtype_name: str) -> str:
    """A cache's dtype, as the KV link names it ("int8", "bfloat16"), as --kv-cache-dtype
    names its format: the 8-bit ones by name, any other as its dtype."""
    names = {str(d).removeprefix("torch."): name for name, d in kv_quant.FORMATS.items()}
    return names.get(dtype_name, dtype_name)


def describe_dtype(dtype_name: str) -> str:
    """format_name, the 8-bit formats with the flag that makes them."""
    name = format_name(dtype_name)
    return f"{name} (8-bit KV, --kv-cache-dtype {name})" if is_quantized_dtype(dtype_name) else name


def is_quantized_dtype(dtype_name: str) -> bool:
    return format_name(dtype_name) in kv_quant.FORMATS
