"""The paged KV cache: sizing, and the block allocator schedulers use.

The cache itself is one tensor the worker owns:
    kv_cache [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]
Block 0 is the null block: padding rows of a decode batch write there, so it is
never handed out.
"""
from __future__ import annotations

import torch

from common.model_spec import ModelSpec

NULL_BLOCK = 0


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "npu":
        return torch.npu.mem_get_info(device)[0]  # type: ignore[attr-defined]
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_cache_blocks(spec: ModelSpec, block_size: int, dtype: torch.dtype, device: torch.device,
                    memory_bytes: int | None, memory_fraction: float) -> int:
    """How many blocks fit in memory_bytes, or else in memory_fraction of the device's free memory."""
    block_bytes = spec.kv_bytes_per_token(torch.tensor([], dtype=dtype).element_size()) * block_size
    budget = memory_bytes if memory_bytes is not None else int(free_device_memory(device) * memory_fraction)
    num_blocks = budget // block_bytes
    if num_blocks < 2:
        raise ValueError(f"KV cache budget of {budget} bytes holds {num_blocks} blocks of "
                         f"{block_bytes} bytes; at least 2 are needed")
    return int(num_blocks)


class BlockAllocator:
    """A free list of block ids with reservations.

    A reservation promises blocks to a sequence before it needs them, so a
    running sequence never fails for lack of blocks while its ids are still
    taken one at a time as it grows.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() hands out low ids first
        self._is_free = [True] * num_blocks
        self._is_free[NULL_BLOCK] = False
        self.num_reserved = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Free blocks not promised to anyone."""
        return len(self._free) - self.num_reserved

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    def allocate(self, n: int) -> list[int]:
        if n > self.num_available:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_available} available")
        return [self._take() for _ in range(n)]

    def reserve(self, n: int) -> None:
        if n > self.num_available:
            raise MemoryError(f"asked to reserve {n} KV blocks, {self.num_available} available")
        self.num_reserved += n

    def allocate_reserved(self) -> int:
        if self.num_reserved < 1:
            raise RuntimeError("no reserved block to allocate")
        self.num_reserved -= 1
        return self._take()

    def unreserve(self, n: int) -> None:
        if n > self.num_reserved:
            raise RuntimeError(f"unreserving {n} blocks, only {self.num_reserved} reserved")
        self.num_reserved -= n

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if b == NULL_BLOCK or not 0 < b < self.num_blocks or self._is_free[b]:
                raise RuntimeError(f"double free or bad block id {b}")
            self._is_free[b] = True
            self._free.append(b)

    def _take(self) -> int:
        b = self._free.pop()
        self._is_free[b] = False
        return b
