"""Prefill on the decode node through start_cluster.sh: prompts prefilled there equal
transformers' tokens, seeded sampling is the same on both paths, `--disaggregate auto`
prefills on an idle decode node once the handoff is measured, aborts and deadlines free
the blocks, and a chat's follow-up finds its history there (the rule on a fake clock:
tests/unit/test_paths.py)."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest

from frontend.client import Client
from tests.cluster_util import Cluster, wait_for
from tests.conftest import clear_prompts

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def never(tiny_model, tmp_path_factory):
    c = Cluster(
        tiny_model, tmp_path_factory.mktemp("logs") / "never.log", "--disaggregate", "never"
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def auto(tiny_model, tmp_path_factory):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("logs") / "auto.log",
        "--disaggregate",
        "auto",
        "--num-decode",
        "2",
    )
    yield c
    c.stop()


def test_prompts_prefilled_on_the_decode_node_match_transformers(never, tiny_model):
    # Past one chunk (256 tokens) too: a prompt in several turns between steps.
    prompts, expected = clear_prompts(
        tiny_model, [list(range(1, 40)), list(range(3, 300)), [5] * 17], NEW_TOKENS, 3
    )
    with Client(never.endpoint) as c:
        for p, ref in zip(prompts, expected):
            r = c.complete(prompt_token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True)
            assert r.error is None and r.token_ids == ref
            assert r.timings["path"] == "local" and r.timings["kv_transfer_ms"] == 0
        # n > 1 and prompt logprobs still go through the prefill node, and say why.
        r = c.complete(
            prompt_token_ids=prompts[0], max_tokens=4, ignore_eos=True, prompt_logprobs=0
        )
        assert (
            r.error is None
            and r.timings["path"] == "disaggregated"
            and "prefill node" in r.timings["path_why"]
        )
    wait_for(
        lambda: never.stats()["decode-0"].get("num_local_prefilled") == 3,
        10,
        "the decode node's count",
    )
    wait_for(
        lambda: all(s["num_free_blocks"] == s["num_usable_blocks"] for s in never.stats().values()),
        10,
        "every block free",
    )


def test_seeded_sampling_is_the_same_on_both_paths(auto, never):
    kw = dict(
        prompt_token_ids=list(range(7, 50)),
        max_tokens=16,
        temperature=1.0,
        top_p=0.9,
        seed=77,
        ignore_eos=True,
    )
    with Client(auto.endpoint) as c:
        through = c.complete(**kw)  # auto, before any rate is measured: through the prefill node
    with Client(never.endpoint) as c:
        local = c.complete(**kw)
    assert (
        through.timings["path"] == "disaggregated"
        and through.timings["path_why"] == "no prefill rate measured yet"
    )
    assert local.timings["path"] == "local"
    assert local.token_ids == through.token_ids and local.text == through.text


def test_auto_prefills_on_an_idle_decode_node_once_the_handoff_is_measured(auto, tiny_model):
    prompts, expected = clear_prompts(
        tiny_model, [[(13 * i + j) % 400 + 1 for j in range(30)] for i in range(8)], NEW_TOKENS, 6
    )
    with Client(auto.endpoint) as c:
        c.complete(prompt_token_ids=[9] * 40, max_tokens=2)  # a rate measured, a handoff timed
        wait_for(
            lambda: c.stats().nodes["prefill-0"].get("num_prefill_tokens"), 10, "a measured prefill"
        )
        got = [
            c.complete(prompt_token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts
        ]
        for r, ref in zip(got, expected):
            assert r.error is None and r.token_ids == ref, r.timings
            assert (
                r.timings["path"] in ("local", "disaggregated")
                and "predicted_local_ms" in r.timings
            )
        # Alone, a distinct prompt is quicker where it decodes: no reservation, write, commit.
        assert sum(r.timings["path"] == "local" for r in got) >= len(got) // 2, [
            r.timings for r in got
        ]
        stats = c.stats()
        frontend = stats.frontend["paths"]
    assert frontend["mode"] == "auto" and frontend["handoff_ms"]
    # One launcher's nodes: one machine, one launcher (so not core-shared, above), CPUs named.
    where = {n: (s["machine"], s["launcher"]) for n, s in stats.nodes.items()}
    assert len(set(where.values())) == 1 and all(where["prefill-0"]), where
    assert all(s["cpus"] for s in stats.nodes.values()), stats.nodes
    metrics = urllib.request.urlopen(auto.http + "/metrics", timeout=10).read().decode()
    assert 'pdserve_paths_total{path="local",why="sooner on the decode node"}' in metrics
    wait_for(
        lambda: (
            sum(s.get("num_local_prefilled", 0) for s in auto.stats().values()) >= len(got) // 2
        ),
        10,
        "the decode nodes' counts",
    )


def test_an_abort_and_a_deadline_on_the_decode_node_free_its_blocks(never):
    """The deadline must fire while the request is on the decode node, however fast the
    machine (one once decoded all 800 tokens inside the deadline): the node is stopped
    from the request's first token until the deadline has ended it at the frontend."""
    pid = never.stats()["decode-0"]["pid"]
    with Client(never.endpoint) as c:
        stream = c.generate(
            prompt_token_ids=list(range(1, 200)), max_tokens=800, ignore_eos=True, timeout_s=2.0
        )
        outs = [next(stream)]
        os.kill(pid, signal.SIGSTOP)
        try:
            outs += list(stream)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert outs[-1].finish_reason == "abort" and "deadline" in (outs[-1].error or "")
        assert sum(len(o.token_ids) for o in outs) < 800
        stream = c.generate(prompt_token_ids=list(range(2, 200)), max_tokens=800, ignore_eos=True)
        next(stream)
        stream.close()  # the client gives it up mid-stream
        bad = c.complete(prompt_token_ids=[10**6], max_tokens=4)
        assert bad.error and bad.finish_reason == "error"
        ok = c.complete(prompt_token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)
        assert ok.error is None and len(ok.token_ids) == 4
    time.sleep(0.1)
    wait_for(
        lambda: all(
            s["num_free_blocks"] == s["num_usable_blocks"] and not s.get("num_local_waiting")
            for s in never.stats().values()
        ),
        10,
        "every block free",
    )


def test_a_chat_follow_up_finds_its_history_on_the_decode_node(auto, tiny_model):
    (history,), (turn,) = clear_prompts(
        tiny_model, [[(11 * i + 3 * j) % 400 + 1 for j in range(70)] for i in range(6)], 40, 1
    )
    with Client(auto.endpoint) as c:
        c.complete(prompt_token_ids=[8] * 40, max_tokens=2)  # a rate measured, a handoff timed
        wait_for(
            lambda: c.stats().nodes["prefill-0"].get("num_prefill_tokens"), 10, "a measured prefill"
        )
        first = c.complete(prompt_token_ids=history, max_tokens=40, ignore_eos=True)
        assert first.token_ids == turn
        # The finished turn's full blocks, prompt and outputs, stay on its decode node.
        wait_for(
            lambda: any(
                s.get("num_cached_blocks")
                for n, s in auto.stats().items()
                if n.startswith("decode")
            ),
            10,
            "a decode node to keep the turn's blocks",
        )
        candidates = [history + turn + [(5 * k + j) % 400 + 1 for j in range(12)] for k in range(6)]
        (follow,), (expected,) = clear_prompts(tiny_model, candidates, NEW_TOKENS, 1)
        r = c.complete(prompt_token_ids=follow, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert r.error is None and r.token_ids == expected, r.timings
    # 70 + 39 tokens written: 6 full blocks of 16, all found on that decode node.
    assert r.timings["path"] == "local" and r.usage["cached_tokens"] == 96, (r.timings, r.usage)
