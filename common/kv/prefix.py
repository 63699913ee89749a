"""Prefix caching: full prompt blocks kept after use, found again by a chained hash.

A full block's hash covers its token ids and its parent block's hash, so equal
hashes mean equal prefixes up to that block: h_i = blake2b(h_{i-1} || tokens_i),
16 bytes (a strong hash: a hit is taken without comparing tokens). The frontend
hashes prompts the same way to route a request to the prefill node most likely
to hold its prefix; nodes report their blocks by route_key (the hash's first 8
bytes as an int64), a routing hint only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from common.kv.blocks import BlockAllocator


def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hash of every full block of token_ids."""
    data = np.asarray(token_ids, dtype=np.int32).tobytes()
    step = block_size * 4
    out, h = [], b""
    for i in range(len(token_ids) // block_size):
        h = hashlib.blake2b(h + data[i * step : (i + 1) * step], digest_size=16).digest()
        out.append(h)
    return out


def route_key(h: bytes) -> int:
    return int.from_bytes(h[:8], "little", signed=True)


def num_reusable_blocks(prompt_len: int, block_size: int) -> int:
    """Full blocks a prompt may take from the cache: its last token is always computed,
    since its logits give the first output token."""
    return (prompt_len - 1) // block_size


class PrefixCache(BlockAllocator):
    """A block allocator that keeps computed full blocks by hash.

    A cached block is in use (referenced by prompts being prefilled or handed
    off) or idle; idle ones are evicted least recently used, and only when an
    allocation needs the room, so they count as free: caching never lowers the
    capacity admission sees. Blocks not published stay private and go back to the
    free list when freed.
    """

    def __init__(self, num_blocks: int, is_enabled: bool = True):
        super().__init__(num_blocks)
        self.is_enabled = is_enabled
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.refs: dict[int, int] = {}  # cached block -> users
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, unused; oldest first
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0
        self.added: list[int] = []  # route keys cached / evicted since the frontend last heard
        self.removed: list[int] = []

    @property
    def num_free(self) -> int:
        return super().num_free + len(self.idle)

    @property
    def num_available(self) -> int:
        return super().num_free + len(self.idle) - self.num_reserved

    def allocate(self, n: int) -> list[int]:
        if n > self.num_available:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_available} available")
        while super().num_free < n:
            self._evict()
        return super().allocate(n)

    def allocate_reserved(self) -> int:
        if not super().num_free:  # NOTE: a reservation counts idle cached blocks as free: evict one
            self._evict()
        return super().allocate_reserved()

    def match(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of hashes, each now referenced."""
        found = []
        for h in hashes if self.is_enabled else ():
            b = self.block_of.get(h)
            if b is None:
                break
            self.idle.pop(b, None)
            self.refs[b] = self.refs.get(b, 0) + 1
            found.append(b)
        return found

    def count(self, prompt_len: int, num_hit_tokens: int) -> None:
        """A prompt started with num_hit_tokens of its prompt_len from the cache."""
        self.num_query_tokens += prompt_len
        self.num_hit_tokens += num_hit_tokens

    def publish(self, block_id: int, h: bytes) -> None:
        """A block now fully holds the KV its hash names (its user still holds it)."""
        if not self.is_enabled or h in self.block_of or block_id in self.hash_of:
            return  # NOTE: an equal block computed twice at once: the first one is kept
        self.block_of[h], self.hash_of[block_id] = block_id, h
        self.refs[block_id] = 1
        self.added.append(route_key(h))

    def free(self, block_ids: list[int]) -> None:
        private = []
        for b in block_ids:
            if b not in self.hash_of:
                private.append(b)
                continue
            if self.refs.get(b, 0) < 1:
                raise RuntimeError(f"double free of cached block {b}")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                self.idle[b] = None
        super().free(private)

    def _evict(self) -> None:
        b, _ = self.idle.popitem(last=False)
        h = self.hash_of.pop(b)
        del self.block_of[h]
        self.removed.append(route_key(h))
        self.num_evictions += 1
        super().free([b])

    def take_updates(self) -> tuple[list[int], list[int]]:
        """Route keys added and removed since the last call."""
        out = self.added, self.removed
        if out[0] or out[1]:  # NOTE: asked every loop turn: new lists only after a change
            self.added, self.removed = [], []
        return out

    def snapshot(self) -> list[int]:
        """Every route key cached now (to resynchronize the frontend)."""
        self.added, self.removed = [], []
        return [route_key(h) for h in self.block_of]  # oldest first

    def stats(self) -> dict:
        q = self.num_query_tokens
        return {
            "is_prefix_caching": self.is_enabled,
            "num_cached_blocks": len(self.hash_of),
            "num_idle_cached_blocks": len(self.idle),
            "num_prefix_evictions": self.num_evictions,
            "num_prefix_hit_tokens": self.num_hit_tokens,
            "num_prefix_prompt_tokens": q,
            "prefix_hit_rate": round(self.num_hit_tokens / q, 4) if q else 0.0,
        }
