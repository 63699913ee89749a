"""Prefix caching on prefill nodes and cache-aware routing: outputs equal
transformers with caching on and off, whatever the prompts share; eviction under
a small KV budget stays exact and frees every block; a repeated prefix goes to
the node that holds it while other work spreads (the cache itself:
tests/unit/test_prefix_cache.py)."""

from __future__ import annotations

import asyncio

import pytest

from frontend.client import AsyncClient, Client
from tests.cluster_util import Processes, free_base_port, wait_for
from tests.conftest import hf_greedy

NEW_TOKENS = 8
BS = 16


# ---- through the nodes -----------------------------------------------------------


def _prompts():
    """Prompts that share 0, some and all full blocks, across chunk boundaries (the
    token budget is 64), with partial and exactly full last blocks."""
    base = [(i * 7 + 3) % 400 for i in range(150)]
    return [
        base[:50],  # 3 full blocks + 2
        base[:50] + [11, 12, 13],  # all 3 of its full blocks cached, more tokens after
        base[:40] + [5] * 20,  # 2 blocks shared, then different
        base[:48],  # exactly 3 full blocks: the last token still computed
        base[:150],  # long: chunks of 64, shares 3 blocks
        base[:140] + [77] * 30,  # shares 8 blocks, past two chunk boundaries
        [399 - t for t in base[:70]],  # shares nothing
        base[:150],  # all 9 reusable blocks
    ]


def _run(tiny_model, tmp_path, extra=(), kv_memory="4MiB"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    procs = Processes(
        tiny_model, free_base_port(), tmp_path, prefill=["--kv-cache-memory", kv_memory, *extra]
    )
    try:
        for role in ("frontend", "prefill", "decode"):
            procs.start(role)
        with Client(procs.clients) as c:
            c.wait_ready(120)
            out = [
                c.complete(prompt_token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True)
                for p in _prompts()
            ]
            # NOTE: figures come from heartbeats: wait until one covers every request.
            stats = wait_for(
                lambda: (
                    (s := c.stats().nodes["prefill-0"]).get("num_handoffs") == len(out)
                    and s["num_free_blocks"] == s["num_usable_blocks"]
                    and s
                ),
                10,
                "a heartbeat after every handoff, with every block free",
            )
        return [r.token_ids for r in out], stats
    finally:
        procs.stop()


@pytest.mark.cluster
def test_prefix_caching_on_and_off_equal_transformers(tiny_model, tmp_path):
    expected = hf_greedy(tiny_model, _prompts(), NEW_TOKENS)
    on, stats_on = _run(tiny_model, tmp_path / "on")
    off, stats_off = _run(tiny_model, tmp_path / "off", ["--no-prefix-caching"])
    assert on == expected and off == expected
    # Hits: 3 + 2 + 3 + 3 + 8 + 9 blocks of 16 tokens, by the reasoning in _prompts.
    assert stats_on["num_prefix_hit_tokens"] == (3 + 2 + 2 + 3 + 8 + 9) * BS
    assert stats_on["prefix_hit_rate"] > 0.3 and stats_on["num_cached_blocks"] > 0
    assert stats_off["num_prefix_hit_tokens"] == 0 and stats_off["num_cached_blocks"] == 0


@pytest.mark.cluster
def test_eviction_under_a_small_budget_stays_exact(tiny_model, tmp_path):
    # 112 KiB of prefill KV: 13 usable blocks, fewer than the 16 distinct full blocks the prompts
    # make.
    out, stats = _run(tiny_model, tmp_path, kv_memory="112KiB")
    assert out == hf_greedy(tiny_model, _prompts(), NEW_TOKENS)
    assert stats["num_prefix_evictions"] > 0
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]


@pytest.mark.cluster
def test_cache_aware_routing_keeps_a_prefix_on_one_node_and_spreads_the_rest(tiny_model, tmp_path):
    procs = Processes(tiny_model, free_base_port(), tmp_path)
    try:
        for role, name in (
            ("frontend", None),
            ("prefill", "prefill-0"),
            ("prefill", "prefill-1"),
            ("decode", None),
        ):
            procs.start(role, name=name)
        with Client(procs.clients) as c:
            c.wait_ready(120, num_nodes=3)
            shared = [(i * 13 + 1) % 400 for i in range(96)]  # 6 full blocks
            assert c.complete(prompt_token_ids=shared + [1], max_tokens=2).error is None
            # NOTE: the decode node reports the finished request's blocks too: a prefill node
            # holds it here.
            holder = wait_for(
                lambda: next(
                    (
                        n
                        for n, s in c.stats().nodes.items()
                        if n.startswith("prefill") and s.get("num_prefix_keys", 0) >= 6
                    ),
                    None,
                ),
                10,
                "the frontend to learn the cached prefix",
            )
            before = {n: s["num_routed"] for n, s in c.stats().nodes.items()}
            for i in range(6):  # one at a time: both nodes idle, the cache decides
                r = c.complete(prompt_token_ids=shared + [i + 2, i + 3], max_tokens=2)
                assert r.error is None
            after = {n: s["num_routed"] for n, s in c.stats().nodes.items()}
            assert after[holder] - before[holder] == 6

            # A burst sharing the prefix: past what the cache saves, the holder's queue
            # sends work to the other node too.
            async def burst():
                async with AsyncClient(procs.clients) as ac:
                    return await asyncio.gather(
                        *[
                            ac.complete(
                                prompt_token_ids=shared + [(i * 31 + k) % 400 for k in range(120)],
                                max_tokens=2,
                            )
                            for i in range(12)
                        ]
                    )

            assert all(r.error is None for r in asyncio.run(burst()))
            final = {n: s["num_routed"] for n, s in c.stats().nodes.items()}
            other = next(n for n in ("prefill-0", "prefill-1") if n != holder)
            assert final[other] - after[other] >= 3 and final[holder] - after[holder] >= 3
            # Heartbeat figures: wait for one that covers the six requests.
            wait_for(
                lambda: c.stats().nodes[holder].get("num_prefix_hit_tokens", 0) >= 6 * 96,
                10,
                "the holder to report its six prefix hits",
            )
    finally:
        procs.stop()
