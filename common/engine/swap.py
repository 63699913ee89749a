"""Preemption's other half: a sequence's KV leaves the cache for host memory and
comes back into whatever blocks it is given next."""

from __future__ import annotations

import torch

from common.engine.h2d import HostToDevice
from common.kv.blocks import BLOCK_DIM


class SwapSpace:
    def __init__(self, cache: torch.Tensor, h2d: HostToDevice, is_pinned: bool):
        """cache: the KV cache [L, 2, num_blocks, block_size, Hk, D] the blocks leave and
        come back to."""
        self._cache = cache
        self._h2d = h2d
        self._is_pinned = is_pinned
        self._held: dict[str, torch.Tensor] = {}  # key -> [L, 2, n, block_size, Hk, D] on the host
        self.num_swap_bytes = 0  # moved out and in, both ways
        self.swapped_bytes = 0  # held now (an int: the heartbeat's snapshot reads it)

    @torch.inference_mode()
    def swap_out(self, key: str, block_ids: list[int]) -> None:
        """Copy the blocks to host memory, held under key. Returns once the copy is done.
        NOTE: blocking on purpose: the caller frees the blocks at once, and a prefill
        node may write into them through the KV transfer right after."""
        cache = self._cache
        idx = self._h2d.tensor(block_ids, torch.int64)
        s = cache.shape
        host = torch.empty(
            (s[0], s[1], len(block_ids), *s[3:]), dtype=cache.dtype, pin_memory=self._is_pinned
        )
        host.copy_(cache.index_select(BLOCK_DIM, idx))
        self._held[key] = host
        self.num_swap_bytes += host.nbytes
        self.swapped_bytes += host.nbytes

    @torch.inference_mode()
    def swap_in(self, key: str, block_ids: list[int]) -> None:
        """The held blocks back into the cache at block_ids (as many as were swapped
        out); the copy is queued ahead of the next step."""
        cache = self._cache
        host = self._held.pop(key)
        idx = self._h2d.tensor(block_ids[: host.shape[BLOCK_DIM]], torch.int64)
        # NOTE: a pinned source is copied without waiting; the caching host allocator
        # keeps its memory from reuse until the copy is done.
        cache.index_copy_(BLOCK_DIM, idx, self._h2d.tensor(host, cache.dtype))
        self.num_swap_bytes += host.nbytes
        self.swapped_bytes -= host.nbytes

    def drop(self, key: str) -> None:
        """An aborted preempted sequence: its swapped KV is let go."""
        host = self._held.pop(key, None)
        if host is not None:
            self.swapped_bytes -= host.nbytes

    def stats(self) -> dict:
        return {"num_swap_bytes": self.num_swap_bytes, "swapped_bytes": self.swapped_bytes}

    def clear(self) -> None:
        self._held.clear()
        self.swapped_bytes = 0
