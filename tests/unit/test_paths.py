"""Prefill on the decode node and the per-request choice of path (--disaggregate): the
rule on a fake clock against figures the test sets, and the router's choices (through
start_cluster.sh, token for token: tests/cluster/test_paths_cluster.py)."""

from __future__ import annotations

import os
import types

import pytest

from frontend import paths
from frontend.paths import Figures, PathChooser

RATE = 10_000.0  # prompt tokens/s, both nodes


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _figures(**kw) -> Figures:
    base = dict(prompt_len=32, prefill_rate=RATE, kv_token_bytes=4096, link_rate=1e8, step_s=0.005)
    return Figures(**{**base, **kw})


def _route(chooser: PathChooser, f: Figures, decode: str, can_local: bool = True):
    """As the frontend routes a request (frontend/server.py): decide, and the request goes
    that way, so the decision is recorded."""
    choice = chooser.decide(f, decode, can_local)
    chooser.record(choice, decode)
    return choice


def test_a_short_prompt_behind_long_ones_is_prefilled_on_its_decode_node():
    chooser = PathChooser("auto", FakeClock())
    # 8,000 tokens wait on the prefill node: 0.8 s there, against 3.2 ms here.
    c = _route(chooser, _figures(prefill_queued=8000, num_running=4), "decode-0")
    assert c.path == "local" and c.why == "sooner on the decode node"
    assert c.local_s == pytest.approx(2 * (32 / RATE + 0.005) + 0.005)
    assert c.disaggregated_s == pytest.approx(2 * 8032 / RATE + 32 * 4096 / 1e8 + 0.005)
    assert c.timings()["path"] == "local" and c.timings()["predicted_local_ms"] == pytest.approx(
        c.local_s * 1e3
    )


def test_an_idle_prefill_node_and_a_free_handoff_keep_the_disaggregated_path():
    chooser = PathChooser("auto", FakeClock())
    # Nothing queued, a link that costs nothing: a decode node with sequences running
    # pays a step per chunk and gains nothing.
    c = _route(chooser, _figures(prompt_len=2048, link_rate=0.0, num_running=8), "decode-0")
    assert c.path == "disaggregated" and c.why == "sooner through the prefill node"
    # The measured handoff cost tips a short prompt to its idle decode node...
    chooser.observe_handoff("decode-0", 32, 0.02)
    assert _route(chooser, _figures(), "decode-0").path == "local"
    # ... but a long prompt's handoff time says nothing of that fixed cost.
    chooser.observe_handoff("decode-1", 4096, 5.0)
    assert "decode-1" not in chooser.handoff_s


def test_layerwise_hides_the_transfer_behind_the_prefill():
    f = _figures(prompt_len=4096, link_rate=4096 * 4096 / 0.3)  # 0.3 s of KV, 0.41 s of prefill
    whole, _, _ = paths.predict(f)
    layerwise, _, _ = paths.predict(
        _figures(prompt_len=4096, link_rate=f.link_rate, is_layerwise=True)
    )
    assert whole[1] - whole[0] == pytest.approx(0.3 + 0.005)
    assert layerwise[1] - layerwise[0] == pytest.approx(0.005)  # all of it hidden


def test_local_prompts_take_at_most_a_share_of_a_busy_decode_node():
    clock = FakeClock()
    chooser = PathChooser("auto", clock)
    busy = _figures(
        prompt_len=256, prefill_queued=100_000, num_running=8
    )  # 10 s behind on the prefill node
    cost = 256 / RATE
    num_fit = int(paths.LOCAL_SHARE * paths.LOCAL_WINDOW_S / cost)
    for _ in range(num_fit):
        assert _route(chooser, busy, "decode-0").path == "local"
    c = _route(chooser, busy, "decode-0")
    assert c.path == "disaggregated" and c.why == "the decode node has no time to spare"
    assert _route(chooser, busy, "decode-1").path == "local"  # another node's window is its own
    assert (
        _route(chooser, _figures(prompt_len=256, prefill_queued=100_000), "decode-0").path
        == "local"
    )  # idle
    clock.now += paths.LOCAL_WINDOW_S + 0.01
    assert _route(chooser, busy, "decode-0").path == "local"
    assert chooser.stats()["decisions"]["disaggregated: the decode node has no time to spare"] == 1


class _TimedWorker:
    """A worker whose every local pass takes pass_s on the test's clock."""

    spec = types.SimpleNamespace(vocab_size=512)
    max_model_len = 1024

    def __init__(self, clock: FakeClock, pass_s: float):
        self.clock, self.pass_s = clock, pass_s

    def prefill(self, chunks):
        self.clock.now += self.pass_s
        return [7] * len(chunks), None


def test_the_decode_node_paces_its_local_prompts_to_their_share(monkeypatch):
    """However many prompts are routed to it, a decode node with sequences running spends
    at most LOCAL_SHARE of its time on local passes (after one burst), as measured."""
    from common.base.request import SamplingParams
    from common.kv.blocks import BlockAllocator
    from common.wire.node import PrefillRequest
    from decode_node import local
    from decode_node.scheduler import DecodeScheduler

    clock = FakeClock()
    monkeypatch.setattr(
        local, "time", types.SimpleNamespace(monotonic=clock, perf_counter=clock, time=clock)
    )
    sched = DecodeScheduler(BlockAllocator(200), 16, 64)
    lp = local.LocalPrefill(_TimedWorker(clock, 0.08), sched, max_queue=100)
    for i in range(60):
        lp.add(
            PrefillRequest(
                f"r{i}", [5] * 8, SamplingParams(max_tokens=4), 0.0, "decode-0", "tcp://x"
            ),
            set(),
        )
    # each prompt done joins the running sequences, whose time the share is
    burst = local.LOCAL_SHARE * local.LOCAL_WINDOW_S
    num_burst = sum(lp.run() is not None for _ in range(10))  # no time passes but the passes'
    # the first pass is owed nothing (nothing ran then); paid back as the passes' own time
    # goes by, the burst fits one pass more than 0.3 / 0.08
    assert num_burst == 6 and not lp.is_runnable() and burst < lp.owed_s() <= burst + 0.08
    assert len(sched.running) == num_burst
    # a decode step of 50 ms between turns: the local passes' share of the time comes to LOCAL_SHARE
    start, busy_before = clock.now, lp.busy_s
    while clock.now - start < 10:
        clock.now += 0.05
        lp.run()
    share = (lp.busy_s - busy_before) / (clock.now - start)
    assert local.LOCAL_SHARE * 0.9 < share <= local.LOCAL_SHARE + 0.08 / 10, share
    assert lp.waiting and len(sched.running) == lp.num_prefilled
    # with nothing running there is no share to keep: the rest go at once
    sched.running.clear()
    assert lp.is_runnable() and lp.run() is not None


def test_modes_and_what_needs_a_prefill_node():
    clock = FakeClock()
    queued = _figures(prefill_queued=8000)
    assert _route(PathChooser("always", clock), queued, "d").path == "disaggregated"
    assert _route(PathChooser("never", clock), _figures(), "d").path == "local"
    for mode in ("auto", "never"):
        c = _route(PathChooser(mode, clock), queued, "d", can_local=False)
        assert c.path == "disaggregated" and "prefill node" in c.why
    assert (
        _route(PathChooser("auto", clock), _figures(prefill_rate=0.0), "d").why
        == "no prefill rate measured yet"
    )
    with pytest.raises(ValueError):
        PathChooser("sometimes", clock)
    chooser = PathChooser("never", clock)
    assert chooser.decide(_figures(), "d").path == "local"
    assert chooser.stats()["decisions"] == {}  # deciding alone counts nothing


def test_figures_come_from_the_nodes_stats():
    class Node:
        def __init__(self, name, stats, num_queued_tokens=0, num_active=0):
            self.name, self.stats, self.placement = name, stats, None
            self.num_queued_tokens, self.num_active = num_queued_tokens, num_active

    prefill = Node(
        "prefill-0",
        {
            "num_prefill_tokens": 5000,
            "prefill_busy_s": 0.5,
            "kv_token_bytes": 512,
            "kv_links": {"decode-0": "tcp"},
            "kv_writes": {"tcp": {"bytes_per_s": 2e8}},
            "kv_layerwise": "on",
        },
        num_queued_tokens=300,
    )
    decode = Node(
        "decode-0",
        {
            "device_busy_s": 0.5,
            "num_decode_steps": 100,
            "num_local_prefill_tokens": 0,
            "local_prefill_busy_s": "bad",
        },
        num_queued_tokens=40,
        num_active=3,
    )
    f = paths.figures(100, 84, 68, prefill, decode)
    assert f == Figures(
        100,
        prefill_cached=16,
        prefill_queued=300,
        prefill_rate=10_000.0,
        kv_token_bytes=512,
        link_rate=2e8,
        is_layerwise=True,
        decode_queued=40,
        decode_cached=32,
        decode_rate=0.0,
        step_s=0.005,
        num_running=3,
    )


def test_the_router_sends_a_follow_up_where_its_history_is_cached():
    from common.wire.protocol import NodeReady
    from frontend import router

    def node(name, role, num_active=0):
        ready = NodeReady(
            role,
            name,
            1,
            "e",
            "cpu",
            100,
            16,
            1024,
            kv_endpoint="tcp://x:1" if role == "decode" else "",
        )
        return router.NodeState(ready, name.encode(), 0.0, num_active=num_active)

    nodes = {
        n.name: n for n in (node("p", "prefill"), node("d0", "decode", 2), node("d1", "decode", 1))
    }
    prompt = list(range(1, 300))
    keys: dict = {}
    router.update_prefix(
        nodes["d0"], [router.route_key(h) for h in router.block_hashes(prompt, 16)[:16]], [], True
    )
    # 256 tokens cached on d0 outweigh one more request running there...
    prefill, decode = router.choose(
        nodes, None, len(prompt), router.prefix_keys(nodes, prompt, keys), is_decode_cache=True
    )
    assert decode.name == "d0"
    # ... but not where its cache cannot be used (--disaggregate always), nor for another prompt.
    assert router.choose(nodes, None, len(prompt), keys)[1].name == "d1"
    other = [7] * 300
    assert (
        router.choose(
            nodes, None, len(other), router.prefix_keys(nodes, other, {}), is_decode_cache=True
        )[1].name
        == "d1"
    )


def test_a_full_prefill_node_leaves_local_prompts_a_way():
    from common.wire.protocol import NodeReady
    from frontend import router

    ready = {
        "p": NodeReady("prefill", "p", 1, "e", "cpu", 100, 16, 1024),
        "d": NodeReady(
            "decode", "d", 1, "e", "cpu", 100, 16, 1024, kv_endpoint="tcp://x:1", max_batch_size=8
        ),
    }

    def nodes(queued: int):
        return {
            k: router.NodeState(r, k.encode(), 0.0, num_queued_tokens=queued if k == "p" else 0)
            for k, r in ready.items()
        }

    asked = []

    def is_local(answer):
        def ask(prefill, decode, work_tokens, local_tokens):
            asked.append((prefill.name, decode.name, work_tokens, local_tokens))
            return answer

        return ask

    full = nodes(1000)
    # Without a path to the decode node (always), or when the rule says no: it waits.
    assert router.assign(full, 1000, [1] * 40, {}) is None
    assert router.assign(full, 1000, [1] * 40, {}, is_local(False)) is None and asked == [
        ("p", "d", 40, 40)
    ]
    assert full["d"].num_active == 0 and full["p"].num_routed == 0  # nothing counted
    prefill, decode, work = router.assign(full, 1000, [1] * 40, {}, is_local(True))
    assert prefill is decode is full["d"] and work == 40
    assert (
        full["d"].num_queued_tokens == 40
        and full["d"].num_active == 1
        and full["p"].num_routed == 0
    )
    # With room, the rule is asked the same way and may keep the handoff.
    room = nodes(0)
    assert router.assign(room, 1000, [1] * 40, {}, is_local(False))[0] is room["p"]


def test_decide_counts_nothing_until_recorded():
    chooser = PathChooser("auto", FakeClock())
    busy = _figures(prompt_len=256, prefill_queued=100_000, num_running=8)
    for _ in range(50):
        c = chooser.decide(busy, "decode-0")
    assert c.path == "local" and not chooser.counts and chooser.local_load_s("decode-0", 100.0) == 0
    chooser.record(c, "decode-0")
    assert chooser.counts == {"local: sooner on the decode node": 1}
    assert chooser.local_load_s("decode-0", 100.0) == pytest.approx(256 / RATE)


def test_nodes_whose_launchers_share_cores_keep_prompts_off_running_sequences():
    """Two launchers on one machine, on the same cores: a short prompt behind long ones goes
    local only while the decode node runs nothing (its steps would wait for it, and the
    prefill node's passes take those cores either way)."""
    chooser = PathChooser("auto", FakeClock())
    behind = dict(prefill_queued=8000, is_core_shared=True)
    c = _route(chooser, _figures(num_running=4, **behind), "decode-0")
    assert (c.path, c.why) == (
        "disaggregated",
        "the decode node shares its cores with the prefill node",
    )
    assert c.local_s < c.disaggregated_s  # sooner locally all the same
    assert _route(chooser, _figures(num_running=0, **behind), "decode-0").path == "local"
    # more than one local chunk would hold the idle node's loop from what arrives next
    idle_long = _figures(prompt_len=300, num_running=0, **behind)
    assert _route(chooser, idle_long, "decode-0").path == "disaggregated"
    # ... unless its history is cached there, and one chunk is left to compute
    cached = _figures(prompt_len=300, decode_cached=100, num_running=0, **behind)
    assert _route(chooser, cached, "decode-0").path == "local"
    # the same load where each launcher has cores of its own: local, within its share
    assert _route(chooser, _figures(num_running=4, prefill_queued=8000), "decode-1").path == "local"


def test_core_sharing_is_read_from_where_the_nodes_say_they_run(monkeypatch):
    from common.base.env import LAUNCHER_ENV
    from common.base.placement import (
        format_cpus,
        is_core_shared,
        parse_cpus,
        placement,
        read_placement,
    )

    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    here, there = placement(), placement()
    assert set(here) == {"machine", "launcher", "cpus"}
    assert parse_cpus(here["cpus"]) == frozenset(os.sched_getaffinity(0))
    assert here["launcher"] != there["launcher"]  # started by hand: a launcher of its own
    monkeypatch.setenv(LAUNCHER_ENV, "plan-1")
    assert placement()["launcher"] == placement()["launcher"] == "plan-1"
    # a CPU list longer than a heartbeat's strings may be is left out (else every beat goes)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(0, 4096, 2)))
    assert placement()["cpus"] == ""

    assert format_cpus([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    assert parse_cpus("0-2,5,7-8") == {0, 1, 2, 5, 7, 8} and parse_cpus(" 3") == {3}
    hostile = ["3-1", "x", "-1", "0-8192", "1-2-3", "", "0,", "٠-٣", "1_0", "0--1"]
    hostile += [",".join(["0-8191"] * 2), ",".join(["0-32766"] * 511), "0," * 40_000, None, 7]
    for text in hostile:  # each refused, and quickly: the work counts repeats too
        with pytest.raises(ValueError):
            parse_cpus(text)

    def beat(**kw):
        return {"machine": "m", "launcher": "a", "cpus": "0-3", "num_host_threads": 4, **kw}

    a = read_placement(beat())
    assert a is not None and a.cpus == {0, 1, 2, 3} and a.num_threads == 4
    for bad in (
        beat(machine=["m"]),
        beat(launcher=""),
        beat(cpus="0-99999"),
        beat(num_host_threads=True),
        beat(num_host_threads=-1),
        {},
    ):
        assert read_placement(bad) is None, bad

    def shared(**kw):
        return is_core_shared(a, read_placement(beat(launcher="b", **kw)))

    assert shared(cpus="2-5")  # 8 threads on the 6 CPUs 0-5
    assert shared(cpus="0-3")
    assert not shared(cpus="4-7")  # split cores
    assert not shared(cpus="0-7", num_host_threads=4)  # 8 threads on 8 CPUs: room for each
    assert not shared(num_host_threads=0)  # the other computes on an accelerator
    assert not is_core_shared(a, read_placement(beat()))  # one launcher: its plan shares them
    assert not is_core_shared(a, read_placement(beat(machine="n", launcher="b")))
    assert not is_core_shared(a, None)

    class Node:
        def __init__(self, name, stats):
            self.name, self.stats, self.placement = name, stats, read_placement(stats)
            self.num_queued_tokens = self.num_active = 0

    hostile = beat(kv_links={"d": ["tcp"]}, kv_writes={"tcp": 1})  # a list once raised here
    f = paths.figures(10, 10, 10, Node("p", hostile), Node("d", beat(launcher="b")))
    assert f.is_core_shared and f.link_rate == 0.0
    for mode in ("auto", "off"):  # an int past a float's range once overflowed in the rule
        huge = beat(
            kv_links={"d": "tcp"},
            kv_writes={"tcp": {"bytes_per_s": 1.0}},
            kv_token_bytes=1e308,
            kv_layerwise=mode,
            num_prefill_tokens=100,
            prefill_busy_s=1.0,
        )
        f = paths.figures(10, 10, 10, Node("p", huge), Node("d", beat()))
        c = PathChooser("auto", FakeClock()).decide(f, "d")  # its KV would take ages: local
        assert (c.path, f.kv_token_bytes) == ("local", paths.MAX_TOKEN_BYTES)
    assert not paths.figures(10, 10, 10, Node("p", beat()), Node("d", beat())).is_core_shared
