"""The paged KV cache as schedulers see it: its layout, how many blocks a budget holds,
and the block allocator.

The cache itself is one tensor the worker owns:
    kv_cache [num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]
Block 0 is the null block: padding rows of a decode batch write there, so it is
never handed out.
"""

from __future__ import annotations

from array import array

import torch

NULL_BLOCK = 0


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


# The cache layout, read in one place: [L, 2 (k, v), num_blocks, block_size, Hk, D].
BLOCK_DIM, SLOT_DIM = 2, 3


def cache_shape(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)


def is_cache_shape(shape) -> bool:
    return len(shape) == 6 and shape[1] == 2


def num_cache_blocks(shape) -> int:
    return int(shape[BLOCK_DIM])


def cache_block_size(shape) -> int:
    return int(shape[SLOT_DIM])


def block_bytes(cache: torch.Tensor) -> int:
    """One block of the cache across every layer, K and V."""
    return cache[:, :, 0].numel() * cache.element_size()


class BlockAllocator:
    """A free list of block ids with reservations.

    A reservation promises blocks to a sequence before it needs them, so a
    running sequence never fails for lack of blocks while its ids are still
    taken one at a time as it grows. A block may be shared (the n sequences of one
    request read their prompt's full blocks): it counts its holders, and free()
    returns it to the pool when the last lets go.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        # NOTE: arrays of ints, not lists: a collection finds nothing in them to walk (a list
        # of a large cache's ids, made after the start's objects were frozen, was walked
        # whole by each young collection: ~5 ms for 262,144 blocks)
        self._free = array("q", range(num_blocks - 1, NULL_BLOCK, -1))  # pop(): low ids first
        # holders of each block; 0: free (the null block: never handed out)
        self._refs = array("q", [0]) * num_blocks
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

    def share(self, block_ids: list[int]) -> None:
        """One more holder of each of these (taken) blocks."""
        for b in block_ids:
            if not 0 < b < self.num_blocks or not self._refs[b]:
                raise RuntimeError(f"sharing block {b}, which is not taken")
            self._refs[b] += 1

    def num_holders(self, block_id: int) -> int:
        return self._refs[block_id]

    def free(self, block_ids: list[int]) -> None:
        """Each holder frees its blocks once; a block is free again when its last holder does."""
        for b in block_ids:
            if not 0 < b < self.num_blocks or not self._refs[b]:
                raise RuntimeError(f"double free or bad block id {b}")
            self._refs[b] -= 1
            if not self._refs[b]:
                self._free.append(b)

    def _take(self) -> int:
        b = self._free.pop()
        self._refs[b] = 1
        return b


def kv_cache_blocks(
    token_bytes: int,
    block_size: int,
    free_bytes: int,
    memory_bytes: int | None,
    memory_fraction: float,
) -> int:
    """How many blocks of tokens of token_bytes (every layer's K and V) fit in memory_bytes,
    or else in memory_fraction of free_bytes."""
    nbytes = token_bytes * block_size
    budget = memory_bytes if memory_bytes is not None else int(free_bytes * memory_fraction)
    num_blocks = budget // nbytes
    if num_blocks < 2:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds {num_blocks} blocks of "
            f"{nbytes} bytes; at least 2 are needed"
        )
    return int(num_blocks)
