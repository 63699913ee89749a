"""The prefix cache itself: chained hashes name prefixes; cached blocks are reused, counted
free and evicted least recently used; reservations take idle cached blocks when nothing
else is free; a disabled cache matches nothing (through the nodes:
tests/cluster/test_prefix.py)."""

from __future__ import annotations

import pytest

from common.kv.prefix import PrefixCache, block_hashes, num_reusable_blocks, route_key

BS = 16


def test_chained_hashes_name_prefixes():
    a = block_hashes(list(range(40)), BS)
    assert len(a) == 2  # full blocks only
    b = block_hashes(list(range(32)) + [99] * 8, BS)
    assert a == b  # the partial block is not hashed
    c = block_hashes([1000] + list(range(1, 40)), BS)
    assert c[0] != a[0] and c[1] != a[1]  # a change early changes every later hash
    assert num_reusable_blocks(32, BS) == 1 and num_reusable_blocks(33, BS) == 2
    assert isinstance(route_key(a[0]), int)


def test_cached_blocks_are_reused_counted_free_and_evicted_lru():
    cache = PrefixCache(9)  # 8 usable blocks
    h = block_hashes(list(range(64)), BS)  # 4 blocks
    blocks = cache.allocate(4)
    for b, x in zip(blocks, h):
        cache.publish(b, x)
    assert cache.match(h) == blocks  # in use twice now
    cache.free(blocks)
    cache.free(blocks)
    assert cache.num_free == cache.num_available == 8 and len(cache.idle) == 4
    assert cache.match(h[:2]) == blocks[:2]  # taken back from idle
    cache.free(blocks[:2])
    assert list(cache.idle)[-2:] == blocks[:2]  # most recently used last
    new = cache.allocate(6)  # 4 free + 2 evicted, least recent first
    assert cache.num_evictions == 2 and set(blocks[2:]) <= set(new)
    assert cache.match(h) == blocks[:2]  # the head of the chain, used last, survives
    added, removed = cache.take_updates()
    assert len(added) == 4 and len(removed) == 2
    cache.free(blocks[:2])
    with pytest.raises(RuntimeError, match="double free"):
        cache.free(blocks[:1])
    cache.free(new)
    assert cache.num_free == 8


def test_reserved_blocks_come_from_idle_cached_ones_when_nothing_else_is_free():
    # A decode node's cache: finished sequences' blocks idle in it count as free, and a
    # reservation made against them must get them when its sequence grows.
    cache = PrefixCache(5)  # 4 usable blocks
    blocks = cache.allocate(4)
    for b, x in zip(blocks, block_hashes(list(range(64)), BS)):
        cache.publish(b, x)
    cache.free(blocks)
    assert cache.num_available == 4
    cache.reserve(3)
    taken = [cache.allocate_reserved() for _ in range(3)]
    assert (
        sorted(taken) == sorted(blocks[:3]) and cache.num_evictions == 3
    )  # least recently used first
    assert cache.num_reserved == 0 and cache.num_available == 1


def test_disabled_cache_matches_nothing():
    cache = PrefixCache(9, is_enabled=False)
    h = block_hashes(list(range(32)), BS)
    b = cache.allocate(2)
    cache.publish(b[0], h[0])
    assert cache.match(h) == [] and not cache.hash_of
