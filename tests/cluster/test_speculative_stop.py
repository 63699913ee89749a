"""Speculative decoding through launch/start_cluster.sh, on a cluster of its own (a fresh
draft chooser): a stop string completed inside a verify step's tokens ends the request's
tokens there."""

from __future__ import annotations

import asyncio

import pytest

from frontend.client import AsyncClient

# NOTE: its module-scoped cluster fixture, made anew for this module (a fresh chooser)
from tests.cluster.test_speculative_cluster import _all_blocks_free as all_blocks_free
from tests.cluster.test_speculative_cluster import cluster  # noqa: F401, F811
from tests.cluster_util import wait_for

pytestmark = pytest.mark.cluster


def test_a_stop_string_inside_a_verified_run_ends_the_tokens_there(cluster, tiny_model):  # noqa: F811
    """A token forced (logit_bias) after a prompt of it said again and again: prompt lookup's
    drafts are all taken, and the stop string's last token comes inside a verify step's run.
    The request's tokens, and its usage, end at it, as one token a step would end them.
    NOTE: a cluster of its own: its chooser is fresh, and verifies the drafts the handoff
    seeds at once (other tests' misses turn it down, and a suite's load may keep it so)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    marks = [t for t in range(len(tok)) if len(s := tok.decode([t])) == 1 and s.isalnum()][:4]
    # NOTE: long enough for the chooser's probe, should earlier tests have turned it down
    num_tokens = 45

    async def run():
        async with AsyncClient(cluster.endpoint) as client:
            return await asyncio.gather(
                *[
                    client.complete(
                        prompt_token_ids=[t] * 12,
                        max_tokens=2 * num_tokens,
                        ignore_eos=True,
                        logit_bias={str(t): 100},
                        stop=[tok.decode([t]) * num_tokens],
                    )
                    for t in marks
                ]
            )

    before = cluster.stats()["decode-0"]["num_drafted_tokens"]
    for r, t in zip(asyncio.run(run()), marks):
        assert (r.token_ids, r.finish_reason, r.text) == ([t] * num_tokens, "stop", "")
        assert r.usage["completion_tokens"] == num_tokens
    wait_for(
        lambda: cluster.stats()["decode-0"]["num_drafted_tokens"] > before, 10, "drafts verified"
    )
    wait_for(lambda: all_blocks_free(cluster), 10, "every block back")
