"""Decode steps that yield to prefill passes in flight (CorePool.begin(want, yields=True)),
on a fake clock over one table: on a host of few cores the two take turns on all of them
rather than run side by side on half, for at most YIELD_S a step."""

from __future__ import annotations

import numpy as np
import pytest

from common.engine import cores
from common.engine.core_table import YIELD_S
from common.engine.cores import MAX_NODES, NUM_COLS, CorePool


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(table, clock, budget=2, share=1, cap=2, pid=1):
    return CorePool(
        "t", budget, share, cap, lambda n: None, clock=clock, is_alive=lambda *_: True,
        table=table, pid=pid,
    )  # fmt: skip


def held(table) -> int:
    return int(table[:, cores.HELD].sum())


def run_layers(monkeypatch, clock, pool, num_layers, layer_s=0.01, on_end=None):
    """While the caller waits in begin(), `pool`'s pass runs num_layers layers and ends."""
    seen = []

    def a_layer(_s):
        clock.now += layer_s
        if pool.held and len(seen) < num_layers:
            pool.between_layers()
            seen.append(pool.held)
            if len(seen) == num_layers:
                pool.end()
                if on_end:
                    on_end()

    monkeypatch.setattr(cores.time, "sleep", a_layer)
    return seen


def test_a_decode_step_waits_for_the_prefill_pass_and_then_runs_on_every_core(host, monkeypatch):
    table, clock, prefill, decode = host
    assert prefill.begin(2) == 2  # decode idle: its share is lent
    seen = run_layers(monkeypatch, clock, prefill, num_layers=20)
    assert decode.begin(2, yields=True) == 2
    # NOTE: the pass kept both cores to its end: the yielder was not owed its share
    assert seen == [2] * 20 and prefill.figures.num_shrinks == 0
    f = decode.stats()
    assert f["num_core_yields"] == 1 and f["core_yield_s"] == pytest.approx(0.2, abs=0.02)
    assert f["num_core_waits"] == 0 and held(table) == 2


def test_the_two_take_turns_and_a_prefill_pass_takes_its_share_back_at_once(host, monkeypatch):
    """A prefill pass that begins during a step gets its share at the step's next layer
    (prefill first, as before); the step after waits for the pass, which grows back to
    every core as soon as the yielder steps aside."""
    table, clock, prefill, decode = host
    assert decode.begin(2, yields=True) == 2  # nothing in flight: at once, no yield
    assert decode.stats()["num_core_yields"] == 0
    run_layers(monkeypatch, clock, decode, num_layers=1)
    assert prefill.begin(2) == 1 and decode.held == 0  # the step gave one back, then ended
    clock.now += cores.LINGER_S / 2  # decode's next step, while it still lingers
    seen = run_layers(monkeypatch, clock, prefill, num_layers=5)
    assert decode.begin(2, yields=True) == 2
    assert seen[0] == 2  # the pass grew into the yielder's core at its next layer
    assert decode.figures.num_yields == 1 and held(table) == 2


def test_a_step_yields_for_at_most_yield_s_then_takes_its_share_back(host, monkeypatch):
    table, clock, prefill, decode = host
    assert prefill.begin(2) == 2
    layers = []

    def a_long_pass(_s):  # a pass that never ends, a layer every 10 ms
        clock.now += 0.01
        layers.append(clock.now)
        prefill.between_layers()

    monkeypatch.setattr(cores.time, "sleep", a_long_pass)
    t0 = clock.now
    assert decode.begin(2, yields=True) == 1
    assert YIELD_S <= clock.now - t0 < YIELD_S + 0.05
    assert prefill.held == 1 and prefill.figures.num_shrinks == 1 and held(table) == 2
    assert decode.figures.num_yields == 1 and decode.figures.num_waits == 1


def test_a_step_that_fits_beside_the_passes_in_flight_runs_at_once(monkeypatch):
    """Sixteen cores, eight owed each: a step that wants four runs beside a pass on eight;
    one whose pass holds what it asked for (a node capped at one) leaves the rest free."""
    monkeypatch.setattr(cores.time, "sleep", lambda _s: pytest.fail("waited"))
    table, clock = np.zeros((MAX_NODES, NUM_COLS)), Clock()
    prefill = make(table, clock, budget=16, share=8, cap=16, pid=1)
    decode = make(table, clock, budget=16, share=8, cap=16, pid=2)
    clock.now += 1.0
    decode.begin(4)
    assert prefill.begin(16) == 8  # decode busy: its share kept
    decode.end()
    assert decode.begin(4, yields=True) == 4
    decode.end()
    prefill.end()

    table, clock = np.zeros((MAX_NODES, NUM_COLS)), Clock()
    capped, decode = make(table, clock, cap=1, pid=1), make(table, clock, pid=2)
    clock.now += 1.0
    assert capped.begin(2) == 1
    assert decode.begin(2, yields=True) == 1 and decode.figures.num_yields == 0


def test_a_yielder_never_takes_the_host_past_its_budget():
    import random

    rng = random.Random(11)
    for trial in range(30):
        table, clock = np.zeros((MAX_NODES, NUM_COLS)), Clock()
        budget = rng.choice([2, 3, 4])
        pools = [make(table, clock, budget=budget, share=1, cap=budget, pid=i + 1) for i in
                 range(rng.choice([2, 3]))]  # fmt: skip
        for _ in range(300):
            clock.now += rng.choice([0.0, 0.001, 0.01, 0.1])
            p = rng.choice(pools)
            want = rng.randint(1, budget)
            passes = cores.passes_in_flight(table, budget, p.row, clock(), lambda *_: True)
            look = (table, budget, p.row, want, clock(), lambda *_: True, passes, set(passes))
            if p.held:
                rng.choice([p.between_layers, p.end])()
            elif cores.decide_yielding(*look) > 0:
                p.begin(want, yields=True)  # (a step that would wait is not started here)
            assert held(table) <= budget, (trial, table[: len(pools)])


def test_a_step_that_fits_in_its_share_takes_it_back_rather_than_wait(host, monkeypatch):
    """A tiny model's step is worth one core: it waited out whole passes of small prompts
    (sat430 on the tiny model lost a fifth of its requests/s). Within its share it takes
    that back at the pass's next layer, as a step that asks without yielding does."""
    table, clock, prefill, decode = host
    assert prefill.begin(2) == 2
    seen = run_layers(monkeypatch, clock, prefill, num_layers=20)
    assert decode.begin(1, yields=True) == 1
    assert seen == [1] and decode.figures.num_yields == 0 and decode.figures.num_waits == 1
    assert held(table) == 2


def test_a_yielding_step_calls_while_waiting_between_its_looks(host, monkeypatch):
    """A decode node blocked in a yield answered no grant: a prefill node whose write goes
    layer by layer waited a whole pass and a step for its next prompt's reservation (queue
    205 ms at the median). The node's hook runs between the looks, with the poll's time."""
    table, clock, prefill, decode = host
    assert prefill.begin(2) == 2
    monkeypatch.setattr(cores.time, "sleep", lambda _s: pytest.fail("slept, not read"))
    reads = []

    def read_links(timeout_s):  # the node reads its links; meanwhile the pass goes on
        reads.append(timeout_s)
        clock.now += timeout_s
        if len(reads) == 5:
            prefill.end()

    assert decode.begin(2, True, read_links) == 2
    assert reads == [cores.YIELD_POLL_S] * 5 and decode.figures.num_yields == 1


def test_a_step_waits_out_one_pass_not_the_next_that_begins_in_the_gap(host, monkeypatch):
    """A step that waited for a pass missed the gap before the next one (a prefill node
    with a queue begins again within microseconds) and waited that one out too: steps of
    up to 2 s each while prefill was busy. It waits for the pass it saw, then takes its
    share back from the next at that one's next layer."""
    table, clock, prefill, decode = host
    assert prefill.begin(2) == 2
    layers = []

    def passes_back_to_back(_s):
        clock.now += 0.01
        layers.append(prefill.held)
        if len(layers) == 10:  # the pass ends, the next begins at once
            prefill.end()
            assert prefill.begin(2) == 2
        elif len(layers) > 10:
            prefill.between_layers()

    monkeypatch.setattr(cores.time, "sleep", passes_back_to_back)
    t0 = clock.now
    assert decode.begin(2, yields=True) == 1
    assert clock.now - t0 < 0.2 and prefill.held == 1 and held(table) == 2
    assert decode.figures.num_yields == 1 and decode.figures.num_waits == 1


def test_a_pass_that_outlives_yield_s_is_waited_for_once(host, monkeypatch):
    """A prefill pass short of what it asked (it began beside a step) whose node then
    stopped made every later step wait YIELD_S: its row holds no more than its share, so
    it is never taken back. The first step waits YIELD_S; the next ones do not wait."""
    table, clock, prefill, decode = host
    decode.begin(1)
    assert prefill.begin(2) == 1  # decode busy: its share kept
    decode.end()
    clock.now += 1.0  # the prefill node stops here, holding one core of the two it asked

    def time_passes(_s):
        clock.now += 0.01

    monkeypatch.setattr(cores.time, "sleep", time_passes)
    t0 = clock.now
    assert decode.begin(2, yields=True) == 1
    assert YIELD_S <= clock.now - t0 < YIELD_S + 0.05
    decode.end()
    for _ in range(3):
        t0 = clock.now
        assert decode.begin(2, yields=True) == 1 and clock.now == t0
        decode.end()


def test_a_stopped_pass_stays_stuck_when_another_outlives_yield_s(monkeypatch):
    """The stuck passes were replaced, not added to: a long pass of a second node made the
    first, stopped one, be waited for again, 2 s after every long pass. Three nodes."""
    table, clock = np.zeros((MAX_NODES, NUM_COLS)), Clock()
    long = make(table, clock, budget=3, share=2, cap=3, pid=1)
    stopped, decode = (make(table, clock, budget=3, share=1, cap=3, pid=p) for p in (2, 3))
    clock.now += 1.0
    assert long.begin(2) == 2
    assert stopped.begin(2) == 1  # short of what it asked; its node stops here
    monkeypatch.setattr(cores.time, "sleep", lambda _s: setattr(clock, "now", clock.now + 0.01))

    def a_step(waits: bool) -> None:
        t0 = clock.now
        decode.begin(3, yields=True)
        assert (clock.now - t0 >= YIELD_S) == waits, clock.now - t0
        decode.end()
        long.end()
        clock.now += 2 * cores.LINGER_S

    a_step(waits=True)  # neither pass ends
    assert long.begin(2) == 2  # a new long pass, which outlives YIELD_S too
    a_step(waits=True)
    a_step(waits=False)  # the stopped pass alone is in flight: not waited for again


def test_a_step_granted_at_its_first_look_counts_no_yield(host):
    """The yield figures counted every step that wanted more than its share, on a clock
    that moved between two reads."""
    table, clock, prefill, decode = host
    ticks = iter(range(100))
    decode.clock = lambda: 200.0 + next(ticks) * 1e-4  # a clock that always moves
    for _ in range(5):
        assert decode.begin(2, yields=True) == 2
        decode.end()
    assert decode.figures.num_yields == 0 and decode.figures.yield_s == 0


def test_a_pass_writes_its_predicted_end_and_a_step_waits_for_a_short_one(host, monkeypatch):
    """A prefill pass writes when it should end, at its node's measured core-seconds a
    token (none before its first pass); a step waits out a pass that ends soon."""
    table, clock, prefill, decode = host
    assert prefill.begin(2, num_tokens=100) == 2  # its first pass: no rate, no end known
    assert table[prefill.row, cores.END] == 0
    clock.now += 0.1  # 100 tokens in 0.1 s on 2 cores: 2 ms of a core a token
    prefill.end()
    assert (
        prefill.pass_time.token_cost_s == pytest.approx(0.002)
        and table[prefill.row, cores.END] == 0
    )
    clock.now += 1.0
    assert prefill.begin(2, num_tokens=100) == 2  # predicted 100 * 2 ms / 2 cores = 0.1 s
    assert table[prefill.row, cores.END] == pytest.approx(clock.now + 0.1)
    seen = run_layers(monkeypatch, clock, prefill, num_layers=10)
    assert decode.begin(2, yields=True) == 2 and seen == [2] * 10
    assert decode.figures.num_yields == 1


def test_a_step_runs_beside_a_long_pass_for_no_more_sequences_than_its_own(host, monkeypatch):
    """A step waited out a whole prefill pass (up to 2 s for a long prompt's), and its
    sequences' next token as long. A pass predicted to run past YIELD_AHEAD_S for no more
    sequences than the step's batch (their first tokens against its next ones) is not
    waited for: the step runs at once on its share, taken back at the pass's next layer."""
    table, clock, prefill, decode = host
    prefill.pass_time.token_cost_s = 0.002
    assert prefill.begin(2, num_tokens=1000, num_seqs=1) == 2  # 1 s on two cores
    assert table[prefill.row, cores.END] == pytest.approx(clock.now + 1.0)
    layers = []

    def a_layer(_s):
        clock.now += 0.01
        layers.append(clock.now)
        prefill.between_layers()

    monkeypatch.setattr(cores.time, "sleep", a_layer)
    assert decode.begin(2, yields=True, num_seqs=1) == 1
    assert len(layers) == 1 and decode.figures.num_yields == 0 and prefill.held == 1


def test_a_step_waits_out_a_long_pass_for_more_sequences_than_its_own(host, monkeypatch):
    """A pass of many prompts (a burst's) is waited for (YIELD_S at most): their first tokens
    count for more than the step's few sequences' next ones (and the batch fills)."""
    table, clock, prefill, decode = host
    prefill.pass_time.token_cost_s = 0.002
    assert prefill.begin(2, num_tokens=1000, num_seqs=8) == 2
    seen = run_layers(monkeypatch, clock, prefill, num_layers=30)
    assert decode.begin(2, yields=True, num_seqs=2) == 2 and seen == [2] * 30
    assert decode.figures.num_yields == 1
