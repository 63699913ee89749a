"""The host's shared cores (common/engine/cores.py): what each node is granted, lent and
given back, on a fake clock over one table, and over a real shared file."""
from __future__ import annotations

import random

import numpy as np
import pytest

from common.engine import cores
from common.engine.cores import LINGER_S, MAX_NODES, CorePool


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(table, clock, budget=2, share=1, cap=2, pid=1, dead=()):
    threads = []
    pool = CorePool("t", budget, share, cap, threads.append, clock=clock,
                    is_alive=lambda p: p not in dead, table=table, pid=pid)
    pool.threads_set = threads
    return pool


def held(table) -> int:
    return int(table[:, cores.HELD].sum())


def test_an_idle_nodes_share_is_lent_and_a_busy_ones_is_not():
    table, clock = np.zeros((MAX_NODES, 4)), Clock()
    prefill, decode = make(table, clock, pid=1), make(table, clock, pid=2)
    clock.now += 1.0                                   # both idle for a while
    assert prefill.begin(2) == 2 and prefill.threads_set[-1] == 2
    assert prefill.stats()["num_lent_passes"] == 1 and held(table) == 2
    prefill.end()
    decode.begin(1)
    decode.end()                                       # decode just ended a step: busy
    clock.now += LINGER_S / 2
    assert prefill.begin(2) == 1                       # its share is kept for it
    prefill.end()
    clock.now += LINGER_S                              # decode idle again: lent
    assert prefill.begin(2) == 2


def test_an_owed_share_is_taken_back_at_the_borrowers_next_layer(monkeypatch):
    table, clock = np.zeros((MAX_NODES, 4)), Clock()
    prefill, decode = make(table, clock, pid=1), make(table, clock, pid=2)
    clock.now += 1.0
    assert prefill.begin(4) == 2                       # capped at 2
    assert decode.figures.num_waits == 0
    layers = []

    def borrower_runs_a_layer(_s):                     # while decode waits, prefill's next layer
        clock.now += 0.001
        layers.append(clock.now)
        prefill.between_layers()
        assert held(table) <= 2
    monkeypatch.setattr(cores.time, "sleep", borrower_runs_a_layer)
    assert decode.begin(1) == 1
    assert len(layers) == 1 and prefill.held == 1 and prefill.threads_set[-1] == 1
    assert decode.figures.num_waits == 1 and prefill.figures.num_shrinks == 1
    assert held(table) == 2
    decode.end()
    clock.now += 1.0                                   # decode idle: prefill grows back
    prefill.between_layers()
    assert prefill.held == 2 and held(table) == 2


def test_never_above_the_budget_under_any_order():
    rng = random.Random(7)
    for trial in range(30):
        table, clock = np.zeros((MAX_NODES, 4)), Clock()
        budget = rng.choice([2, 3, 4])
        shares = [1] * budget if trial % 2 else [budget // 2, budget - budget // 2]
        pools = [make(table, clock, budget=budget, share=s, cap=budget, pid=i + 1) for i, s in enumerate(shares)]
        for _ in range(300):
            clock.now += rng.choice([0.0, 0.001, 0.01, 0.1])
            p = rng.choice(pools)
            if p.held:
                rng.choice([p.between_layers, p.end])()
            elif cores.decide(table, budget, p.row, rng.randint(1, budget), clock(), lambda _: True):
                p.begin(rng.randint(1, budget))      # (a pass that would wait is not started here)
            assert held(table) <= budget, (trial, table[: len(pools)])
            assert all(q.held == 0 or q.held >= 1 for q in pools)


def test_every_busy_node_keeps_its_share_at_saturation():
    table, clock = np.zeros((MAX_NODES, 4)), Clock()
    a, b = make(table, clock, budget=4, share=2, cap=4, pid=1), make(table, clock, budget=4, share=2, cap=4, pid=2)
    for _ in range(5):
        assert a.begin(4) == 2 + 2 * (b.held == 0 and clock() - table[b.row, cores.STAMP] >= LINGER_S)
        assert b.begin(4) <= 4 - a.held
        a.end()
        b.end()
        clock.now += 0.001
    assert a.begin(4) == 2 and b.begin(4) == 2


def test_more_nodes_than_cores_each_runs_on_one_and_the_dead_count_for_nothing():
    table, clock = np.zeros((MAX_NODES, 4)), Clock()
    pools = [make(table, clock, budget=2, share=1, cap=2, pid=i + 1, dead={99}) for i in range(3)]
    assert [p.begin(1) for p in pools] == [1, 1, 1]    # none lent: the third runs, as with no table
    for p in pools:
        p.end()
    clock.now += 1.0
    table[10] = (99, 1, 2, clock())                    # a node that died holding two cores
    assert pools[0].begin(2) == 2


def test_bad_pool_options_are_refused():
    from common.base.config import parse_core_pool
    assert parse_core_pool("pdserve-5900:2:1") == ("pdserve-5900", 2, 1)
    for bad in ("x", "x:2", "x:1:2", "x:2:0", "../x:2:1", "x:y:1"):
        with pytest.raises(ValueError, match="--core-pool"):
            parse_core_pool(bad)
    with pytest.raises(ValueError, match=">= 1"):
        CorePool("t", 0, 1, 1, print, table=np.zeros((MAX_NODES, 4)))


def test_two_processes_views_share_one_table(tmp_path):
    name = f"pdserve-test-cores-{random.getrandbits(32):x}"
    clock = Clock()
    a = CorePool(name, 2, 1, 2, lambda n: None, clock=clock, pid=11, is_alive=lambda p: True)
    b = CorePool(name, 2, 1, 2, lambda n: None, clock=clock, pid=12, is_alive=lambda p: True)
    try:
        clock.now += 1.0
        assert a.begin(2) == 2
        assert cores.free_cores(b.table, 2, b.row, clock(), lambda p: True) == 0
        a.end()
    finally:
        a.close()
        b.close()
    import os
    assert not os.path.exists(f"/dev/shm/{name}")   # the last one out removed it


def test_a_pass_is_worth_threads_by_its_size():
    import torch
    from common.base.model_spec import preset_spec
    big = preset_spec("qwen3-0.6b")
    assert cores.threads_worth(big, torch.bfloat16, 0, 1) >= 2          # a decode step streams 1.2 GB
    assert cores.threads_worth(big, torch.bfloat16, 128, 1) >= 2        # a 128-token prompt: ~100 GFLOP
    tiny = big.__class__(**{**vars(big), "num_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                            "num_heads": 2, "num_kv_heads": 1, "head_dim": 32, "vocab_size": 512})
    assert cores.threads_worth(tiny, torch.float32, 430, 1) == 1        # on one core: no barrier per op
    assert cores.threads_worth(tiny, torch.float32, 0, 64) == 1
