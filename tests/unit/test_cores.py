"""The host's shared cores (common/engine/cores.py): what each node is granted, lent and
given back, on a fake clock over one table, and over a real shared file."""

from __future__ import annotations

import os
import random
import signal
import subprocess

import numpy as np
import pytest

from common.engine import cores, pass_size
from common.engine.cores import LINGER_S, MAX_NODES, NUM_COLS, CorePool


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(table, clock, budget=2, share=1, cap=2, pid=1, dead=()):
    threads = []
    pool = CorePool(
        "t",
        budget,
        share,
        cap,
        threads.append,
        clock=clock,
        is_alive=lambda p, _start: p not in dead,
        table=table,
        pid=pid,
    )
    pool.threads_set = threads
    return pool


def held(table) -> int:
    return int(table[:, cores.HELD].sum())


def test_an_idle_nodes_share_is_lent_and_a_busy_ones_is_not():
    table, clock = np.zeros((MAX_NODES, NUM_COLS)), Clock()
    prefill, decode = make(table, clock, pid=1), make(table, clock, pid=2)
    clock.now += 1.0  # both idle for a while
    assert prefill.begin(2) == 2 and prefill.threads_set[-1] == 2
    assert prefill.stats()["num_lent_passes"] == 1 and held(table) == 2
    prefill.end()
    decode.begin(1)
    decode.end()  # decode just ended a step: busy
    clock.now += LINGER_S / 2
    assert prefill.begin(2) == 1  # its share is kept for it
    prefill.end()
    clock.now += LINGER_S  # decode idle again: lent
    assert prefill.begin(2) == 2


def test_an_owed_share_is_taken_back_at_the_borrowers_next_layer(monkeypatch):
    table, clock = np.zeros((MAX_NODES, NUM_COLS)), Clock()
    prefill, decode = make(table, clock, pid=1), make(table, clock, pid=2)
    clock.now += 1.0
    assert prefill.begin(4) == 2  # capped at 2
    assert decode.figures.num_waits == 0
    layers = []

    def borrower_runs_a_layer(_s):  # while decode waits, prefill's next layer
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
    clock.now += 1.0  # decode idle: prefill grows back
    prefill.between_layers()
    assert prefill.held == 2 and held(table) == 2


def test_never_above_the_budget_under_any_order():
    rng = random.Random(7)
    for trial in range(30):
        table, clock = np.zeros((MAX_NODES, NUM_COLS)), Clock()
        budget = rng.choice([2, 3, 4])
        shares = [1] * budget if trial % 2 else [budget // 2, budget - budget // 2]
        pools = [
            make(table, clock, budget=budget, share=s, cap=budget, pid=i + 1)
            for i, s in enumerate(shares)
        ]
        for _ in range(300):
            clock.now += rng.choice([0.0, 0.001, 0.01, 0.1])
            p = rng.choice(pools)
            if p.held:
                rng.choice([p.between_layers, p.end])()
            elif cores.decide(
                table, budget, p.row, rng.randint(1, budget), clock(), lambda *_: True
            ):
                p.begin(rng.randint(1, budget))  # (a pass that would wait is not started here)
            assert held(table) <= budget, (trial, table[: len(pools)])
            assert all(q.held == 0 or q.held >= 1 for q in pools)


def test_every_busy_node_keeps_its_share_at_saturation():
    table, clock = np.zeros((MAX_NODES, NUM_COLS)), Clock()
    a, b = (
        make(table, clock, budget=4, share=2, cap=4, pid=1),
        make(table, clock, budget=4, share=2, cap=4, pid=2),
    )
    for _ in range(5):
        assert a.begin(4) == 2 + 2 * (
            b.held == 0 and clock() - table[b.row, cores.STAMP] >= LINGER_S
        )
        assert b.begin(4) <= 4 - a.held
        a.end()
        b.end()
        clock.now += 0.001
    assert a.begin(4) == 2 and b.begin(4) == 2


def test_more_nodes_than_cores_each_runs_on_one_and_the_dead_count_for_nothing():
    table, clock = np.zeros((MAX_NODES, NUM_COLS)), Clock()
    pools = [make(table, clock, budget=2, share=1, cap=2, pid=i + 1, dead={99}) for i in range(3)]
    assert [p.begin(1) for p in pools] == [1, 1, 1]  # none lent: the third runs, as with no table
    for p in pools:
        p.end()
    clock.now += 1.0
    table[10] = (99, 1, 2, clock(), 0, 2, 0, 0)  # a node that died holding two cores
    assert pools[0].begin(2) == 2


def test_bad_pool_options_are_refused():
    from common.base.config import parse_core_pool

    assert parse_core_pool("pdserve-5900:2:1") == ("pdserve-5900", 2, 1)
    for bad in ("x", "x:2", "x:1:2", "x:2:0", "../x:2:1", "x:y:1"):
        with pytest.raises(ValueError, match="--core-pool"):
            parse_core_pool(bad)
    with pytest.raises(ValueError, match=">= 1"):
        CorePool("t", 0, 1, 1, print, table=np.zeros((MAX_NODES, NUM_COLS)))


def test_two_processes_views_share_one_table(tmp_path):
    name = f"pdserve-test-cores-{random.getrandbits(32):x}"
    clock = Clock()
    a = CorePool(name, 2, 1, 2, lambda n: None, clock=clock, pid=11, is_alive=lambda *_: True)
    b = CorePool(name, 2, 1, 2, lambda n: None, clock=clock, pid=12, is_alive=lambda *_: True)
    try:
        clock.now += 1.0
        assert a.begin(2) == 2
        assert cores.free_cores(b.table, 2, b.row, clock(), lambda *_: True) == 0
        a.end()
    finally:
        a.close()
        b.close()
    import os

    assert not os.path.exists(f"/dev/shm/{name}")  # the last one out removed it


def test_a_pass_is_worth_threads_by_its_size():
    import torch

    from common.base.model_spec import preset_spec

    big = preset_spec("qwen3-0.6b")
    assert pass_size.threads_worth(big, torch.bfloat16, 0, 1) >= 2  # a decode step streams 1.2 GB
    assert (
        pass_size.threads_worth(big, torch.bfloat16, 128, 1) >= 2
    )  # a 128-token prompt: ~100 GFLOP
    tiny = big.__class__(
        **{
            **vars(big),
            "num_layers": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "num_kv_heads": 1,
            "head_dim": 32,
            "vocab_size": 512,
        }
    )
    assert (
        pass_size.threads_worth(tiny, torch.float32, 430, 1) == 1
    )  # on one core: no barrier per op
    assert pass_size.threads_worth(tiny, torch.float32, 0, 64) == 1


# ---- a table others can touch, rows that make no sense, borrowers that never give back


@pytest.fixture
def sleeper():
    """A live process that is no pdserve node."""
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def test_rows_that_make_no_sense_count_for_nothing(bounded):
    """A NaN row made begin() raise (int(nan)); a negative pid was signalled (kill(-1)
    asks of every process). Every such row is ignored, never raised on, and may be
    claimed."""
    table = np.zeros((MAX_NODES, NUM_COLS))
    asked = []
    bad = [
        (np.nan,) * NUM_COLS,
        (-1, 1, 2, 0, 0, 0, 0, 0),
        (1e30, 1, 2, 0, 0, 0, 0, 0),
        (7, 1, np.inf, 0, 0, 0, 0, 0),
        (7, 1, 1e9, 0, 0, 0, 0, 0),
        (7, 0.5, 2, 0, 0, 0, 0, 0),
        (7, 1, 2, 1e12, 0, 0, 0, 0),
        (7, 1, 2, 0, -5, 0, 0, 0),
        (7, 1, 2, 0, 0, 1e9, 0, 0),
        (7, 1, 2, 0, 0, 0.5, 0, 0),
    ]
    table[MAX_NODES - len(bad) :] = bad
    pool = CorePool(
        "t",
        2,
        1,
        2,
        lambda n: None,
        clock=bounded,
        table=table,
        pid=1,
        is_alive=lambda p, s: asked.append(p) or True,
    )
    assert pool.begin(2) == 2 and pool.figures.num_waits == 0
    pool.between_layers()
    assert pool.held == 2 and asked == []
    table[: MAX_NODES - len(bad)] = (5, 1, 0, bounded(), 0, 0, 0, 0)  # the sane rows all taken
    assert CorePool(
        "t", 2, 1, 2, print, clock=bounded, table=table, pid=2, is_alive=lambda *_: True
    ).row == MAX_NODES - len(bad)  # a junk row is claimed


def _borrower_row(table: np.ndarray, pid: int, start: int, clock) -> None:
    table[5] = (pid, 1, 2, clock(), start, 2, 0, 0)  # holds both cores, one past its share


@pytest.mark.parametrize("is_stopped", [True, False])
def test_a_borrower_that_never_gives_back_is_waited_for_until_the_deadline(
    bounded, sleeper, is_stopped
):
    """A borrower's row whose process lives but never gives its cores back (a node
    SIGSTOPped, or a pid that is no pdserve node) made begin() wait for ever, and every
    node on the host with it. It is waited for until the deadline, then its row is
    taken back and the node runs."""
    table = np.zeros((MAX_NODES, NUM_COLS))
    _borrower_row(table, sleeper.pid, cores.process_start(sleeper.pid), bounded)
    if is_stopped:
        os.kill(sleeper.pid, signal.SIGSTOP)
    pool = CorePool("t", 2, 1, 2, lambda n: None, clock=bounded, table=table, deadline_s=2.0)
    began = bounded.now
    assert pool.begin(2) == 2  # all free once the row is taken back
    assert 2.0 <= bounded.now - began < 2.1 and pool.figures.num_waits == 1
    assert pool.stats()["num_core_reclaims"] == 1 and table[5, cores.PID] == 0
    assert cores.is_same_process(sleeper.pid, int(cores.process_start(sleeper.pid)))


def test_a_pid_used_again_by_another_process_counts_for_nothing(bounded, sleeper):
    """A dead node's row whose pid the kernel gave to another process counted as a live
    borrower: begin() waited on it. It counts for nothing at once."""
    table = np.zeros((MAX_NODES, NUM_COLS))
    _borrower_row(table, sleeper.pid, cores.process_start(sleeper.pid) - 1, bounded)
    pool = CorePool("t", 2, 1, 2, lambda n: None, clock=bounded, table=table)
    assert pool.begin(2) == 2 and pool.figures.num_waits == 0
    assert pool.row == 0  # (claimed first: row 5 stays as it was)


def test_a_borrower_past_the_deadline_claims_a_row_again_and_gives_back(bounded):
    """A slow borrower whose row was taken back runs on: at its next layer it claims a
    row again and gives back what the other is owed; the budget holds."""
    table = np.zeros((MAX_NODES, NUM_COLS))
    borrower, owed = make(table, bounded, pid=1), make(table, bounded, pid=2)
    bounded.now += 1.0
    assert borrower.begin(2) == 2
    assert owed.begin(1) == 1 and owed.figures.num_reclaims == 1  # the borrower never ran
    borrower.between_layers()
    assert borrower.held == 1 and table[borrower.row, cores.PID] == 1 and held(table) == 2
    borrower.end()
    owed.end()
    assert sorted(table[:, cores.PID][table[:, cores.PID] > 0]) == [1, 2]
