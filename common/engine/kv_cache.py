"""The KV cache: how many blocks the memory budget gives, and the one tensor that holds
them [L, 2, num_blocks, block_size, Hk, D], allocated by the device's platform."""

from __future__ import annotations

import torch

from common.base.config import WorkerConfig
from common.base.model_spec import ModelSpec
from common.kv.blocks import cache_shape, kv_cache_blocks


def allocate_kv_cache(
    platform, spec: ModelSpec, cfg: WorkerConfig, dtype: torch.dtype
) -> torch.Tensor:
    """As many blocks as cfg's budget gives (the CPU default where none is set on a host,
    else a fraction of the device's free memory), null block included."""
    budget = cfg.kv_cache_memory
    if budget is None and platform.is_host:
        budget = cfg.cpu_kv_cache_memory
    num_blocks = kv_cache_blocks(
        spec, cfg.block_size, dtype, platform.free_memory(), budget, cfg.kv_cache_fraction
    )
    shape = cache_shape(
        spec.num_layers, num_blocks, cfg.block_size, spec.num_kv_heads, spec.head_dim
    )
    return platform.allocate(shape, dtype, cfg.is_cache_in_shm)
