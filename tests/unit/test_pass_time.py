"""A prefill pass's predicted end (common/engine/pass_time.py), which the decode steps
sharing its cores read from the core table: on the cores it holds as they change, a stop it
was taken back for not counted as run, and its node's rate in the core-seconds it held."""

from __future__ import annotations

import pytest

from common.engine import cores
from common.engine.pass_time import PassTime


def test_a_pass_granted_fewer_cores_is_predicted_to_run_longer(host):
    """The end is predicted on the cores the pass was granted: beside a step holding its
    share, a pass on one core runs twice as long as on two."""
    table, clock, prefill, decode = host
    prefill.pass_time.token_cost_s = 0.002
    assert decode.begin(1, yields=True) == 1  # a step on its share
    assert prefill.begin(2, num_tokens=100) == 1  # what is free
    assert table[prefill.row, cores.END] == pytest.approx(clock.now + 0.2)


def test_a_pass_that_shrinks_moves_its_end_and_counts_the_cores_it_held(host):
    """The end was predicted once, on the cores first granted: a pass that then shrank to
    one ran twice as long as written, and steps took it for one about to end. It moves
    with each change of cores, and the node's rate counts the core-seconds held."""
    table, clock, prefill, decode = host
    prefill.pass_time.token_cost_s = 0.002
    assert prefill.begin(2, num_tokens=1000) == 2  # 2 core-seconds: 1 s on two
    clock.now += 0.2  # 0.4 core-seconds done, 1.6 left
    table[decode.row, [cores.HELD, cores.STAMP]] = 1, clock.now  # a step took its share
    prefill.between_layers()
    assert prefill.held == 1
    assert table[prefill.row, cores.END] == pytest.approx(clock.now + 1.6)
    clock.now += 1.6
    prefill.end()
    assert prefill.pass_time.token_cost_s == pytest.approx(0.002)  # (0.4 + 1.6) / 1000


def test_pass_time_predicts_from_the_core_seconds_a_pass_held():
    t = PassTime()
    assert t.begin(100, 2, now=10.0) == 0  # no rate yet: not known
    assert t.resize(1, now=10.5) == 0  # 1 core-second, then on one core
    t.end(now=11.5)  # 1 + 1 core-seconds for 100 tokens
    assert t.token_cost_s == pytest.approx(0.02) and not t.is_running
    assert t.begin(100, 2, now=20.0) == pytest.approx(21.0)  # 2 core-seconds on 2
    assert t.resize(1, now=20.5) == pytest.approx(21.5)  # 1 core-second left, on one


def test_a_pass_whose_row_was_taken_back_writes_its_end_and_prompts_again(host, monkeypatch):
    """A prefill node stopped past another's deadline loses its row; the row it claims
    when it runs again held no end and no prompts, so a step waited YIELD_S for a pass it
    should have run beside. The pass writes them again with its new row, its end not
    counting the stop as run (else one stopped past its end read as about to end)."""
    table, clock, prefill, decode = host
    prefill.pass_time.token_cost_s = 0.01
    assert prefill.begin(2, num_tokens=1000, num_seqs=1) == 2  # 5 s on two cores
    table[prefill.row] = 0  # taken back while it was stopped
    decode.begin(1)
    decode.end()
    clock.now += 6.0  # stopped past the deadline, and past the pass's predicted end
    prefill.between_layers()
    assert table[prefill.row, cores.SEQS] == 1 and table[prefill.row, cores.WANT] == 2
    # 10 core-seconds in all, none of them run: the stop ran nothing
    assert table[prefill.row, cores.END] == pytest.approx(clock.now + 10.0 / prefill.held)

    def a_layer(_s):
        clock.now += 0.01
        prefill.between_layers()

    monkeypatch.setattr(cores.time, "sleep", a_layer)
    assert decode.begin(2, yields=True, num_seqs=4) == 1  # beside it, not waiting it out
    assert decode.figures.num_yields == 0


def test_a_pass_that_looks_at_no_layer_and_is_taken_back_counts_as_run(host):
    """A lanes pass never looks between layers: borrowing past another's deadline, its row
    is taken back while it runs. Its time counts in full (it was running, not stopped),
    and the row's pass columns are not rewritten at its end."""
    table, clock, prefill, decode = host
    prefill.pass_time.token_cost_s = 0.004
    assert prefill.begin(2, num_tokens=1000, num_seqs=3) == 2
    clock.now += 3.0
    table[prefill.row] = 0  # taken back
    prefill.end()
    assert prefill.pass_time.token_cost_s == pytest.approx(0.005)  # (0.004 + 6 / 1000) / 2
    assert table[prefill.row, cores.END] == 0 and table[prefill.row, cores.SEQS] == 0


def test_a_stop_after_a_layer_is_not_run(host):
    """A layer looked at on the table's fast path, then a stop past the deadline: the
    rewritten end counts the pass as run to that layer, and nothing after it."""
    table, clock, prefill, decode = host
    prefill.pass_time.token_cost_s = 0.002
    assert prefill.begin(2, num_tokens=1000, num_seqs=1) == 2  # 2 core-seconds
    clock.now += 0.5
    prefill.between_layers()  # 1 core-second run
    clock.now += 5.0
    table[prefill.row] = 0  # stopped, taken back
    prefill.between_layers()
    assert table[prefill.row, cores.END] == pytest.approx(clock.now + 1.0 / prefill.held)
