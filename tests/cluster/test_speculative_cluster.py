"""Speculative decoding through launch/start_cluster.sh: a decode node on a CPU verifies
prompt lookup's drafts with no flag given (auto), and answers as transformers does, token
for token (one of them asking for log-probabilities, two with a grammar), says its drafts in
each request's timings and on /metrics, and ends a request at its stop token mid-run."""

from __future__ import annotations

import asyncio
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.client import AsyncClient
from tests.cluster_util import Cluster, wait_for
from tests.conftest import clear_prompts

pytestmark = pytest.mark.cluster

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "cluster.log"
    c = Cluster(tiny_model, log)  # NOTE: no --speculative-config: a CPU node's default
    yield c
    c.stop()


def _metrics(cluster) -> dict:
    """decode-0's samples on /metrics: (name, position label or '') -> value."""
    with urllib.request.urlopen(cluster.http + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {
        (s.name, s.labels.get("position", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("node") == "decode-0"
    }


def _repeating_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of a short random run said a few times: prompt lookup finds its drafts."""
    rng = np.random.RandomState(seed)
    runs = [rng.randint(0, 400, size=int(rng.randint(2, 7))).tolist() for _ in range(n)]
    return [run * int(rng.randint(2, 6)) + run[:1] for run in runs]


def test_verified_drafts_answer_as_transformers(cluster, tiny_model):
    prompts, expected = clear_prompts(tiny_model, _repeating_prompts(24), NEW_TOKENS, 8)

    async def run():
        async with AsyncClient(cluster.endpoint) as client:
            plain = [
                client.complete(prompt_token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True)
                for p in prompts
            ]
            opted_out = client.complete(
                prompt_token_ids=prompts[1], max_tokens=NEW_TOKENS, ignore_eos=True,
                speculative=False,
            )  # fmt: skip
            reported = client.complete(
                prompt_token_ids=prompts[0], max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1
            )  # verified beside the rest: its tokens' log-probabilities come with them
            return await asyncio.gather(*plain, opted_out, reported)

    # NOTE: a try that finds no draft runs plain, and the next comes plain steps later: the
    # prompts again (a few times) until a request's drafts were verified
    for _ in range(4):
        *results, opted_out, reported = asyncio.run(run())
        assert opted_out.token_ids == expected[1]
        for i, (r, ref) in enumerate(zip(results, expected)):
            assert r.error is None, r.error
            assert r.token_ids == ref, f"request {i} diverged"
            assert r.finish_reason == "length" and r.usage["completion_tokens"] == NEW_TOKENS
        assert reported.token_ids == expected[0] and len(reported.logprobs) == NEW_TOKENS
        if any("num_draft_tokens" in (r.timings or {}) for r in results):
            break
    # Each request's timings say its drafts and how many were accepted; the opted-out one
    # had none.
    timed = [r.timings for r in results if "num_draft_tokens" in (r.timings or {})]
    assert timed and all(0 <= t["num_accepted_tokens"] <= t["num_draft_tokens"] for t in timed)
    assert "num_draft_tokens" not in (opted_out.timings or {})
    num_accepted = sum(t["num_accepted_tokens"] for t in timed)
    # NOTE: the node's stats are its last report: waited for until they hold those steps
    stats = wait_for(
        lambda: (
            (s := cluster.stats()["decode-0"]).get("num_verify_steps", 0) > 0
            and s.get("num_accepted_tokens", 0) >= num_accepted
            and s
        ),
        10,
        "the node's stats to count the verified drafts",
    )
    assert stats["num_drafted_tokens"] > 0
    # /metrics: vLLM's spec_decode counts, as the node's heartbeat gives them.
    names = {
        "num_draft_tokens": "num_drafted_tokens",
        "num_accepted_tokens": "num_accepted_tokens",
        "num_drafts": "num_drafts",
    }

    # NOTE: how many drafts it accepts is its controller's choice (it rests where drafts
    # miss, as the random model's loops make them): drafted ones are counted for certain.
    def metrics_agree() -> bool:
        m, stats = _metrics(cluster), cluster.stats()["decode-0"]
        per_pos = [v for (n, pos), v in m.items() if n.endswith("accepted_tokens_per_pos_total")]
        return sum(per_pos) == stats["num_accepted_tokens"] and all(
            m[(f"pdserve_spec_decode_{k}_total", "")] == stats[key] for k, key in names.items()
        )

    wait_for(metrics_agree, 10, "/metrics to give the node's speculative decoding counts")
    cluster.log.flush()  # the decode node says so when it is ready
    ready = b"speculative decoding: prompt lookup, up to 4 drafts a step"
    assert ready in open(cluster.log.name, "rb").read()


def test_grammar_rows_beside_verified_ones_answer_as_masked_transformers(cluster, tiny_model):
    """Requests under a regex and a JSON object, beside others whose drafts are verified:
    each as transformers' greedy decoding masked by its matcher, to its end (EOS)."""
    from common.wire.client import Structured
    from tests.unit.test_speculative_grammar import JSON, PROMPTS, REGEX, masked_greedy

    prompts, _ = clear_prompts(tiny_model, _repeating_prompts(24, seed=2), NEW_TOKENS, 6)
    grammars = [(REGEX, PROMPTS[0]), (JSON, PROMPTS[1]), (REGEX, PROMPTS[2])]
    expected = [masked_greedy(tiny_model, prompt, g, NEW_TOKENS) for g, prompt in grammars]

    async def run():
        async with AsyncClient(cluster.endpoint) as client:
            plain = [
                client.complete(prompt_token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True)
                for p in prompts
            ]
            structured = [
                client.complete(
                    prompt_token_ids=prompt,
                    max_tokens=NEW_TOKENS,
                    structured=Structured(g[0], g[1], g[2]),
                )
                for g, prompt in grammars
            ]
            return await asyncio.gather(*structured, *plain)

    results = asyncio.run(run())
    for r, ref in zip(results, expected):
        assert r.error is None, r.error
        assert r.token_ids == ref[: len(r.token_ids)] and len(r.token_ids) >= len(ref) - 1
    wait_for(lambda: _all_blocks_free(cluster), 10, "every block back")


def test_a_stop_token_inside_a_verified_run_ends_the_request_there(cluster, tiny_model):
    prompts, expected = clear_prompts(tiny_model, _repeating_prompts(24, seed=1), NEW_TOKENS, 4)

    async def run():
        async with AsyncClient(cluster.endpoint) as client:
            return await asyncio.gather(
                *[
                    client.complete(
                        prompt_token_ids=p,
                        max_tokens=NEW_TOKENS,
                        ignore_eos=True,
                        stop_token_ids=[ref[9]],
                    )
                    for p, ref in zip(prompts, expected)
                ]
            )

    for r, ref in zip(asyncio.run(run()), expected):
        end = ref.index(ref[9]) + 1
        assert r.token_ids == ref[:end] and r.finish_reason == "stop"
    wait_for(lambda: _all_blocks_free(cluster), 10, "every block back")


def _all_blocks_free(cluster) -> bool:
    return all(
        s["num_free_blocks"] == s["num_usable_blocks"] and not s.get("num_reserved_blocks")
        for s in cluster.stats().values()
    )
