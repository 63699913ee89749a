"""`pdserve bench mixed`'s summary over runs: each figure's median per mode, the medians'
ratios to the first mode, and the range of each run's own ratios."""

import json

from launch.bench import mixed


def test_ratios_are_each_mode_over_the_first():
    figures = {
        "always": {"a": 10.0, "b": 0.0, "c": None, "d": 4.0},
        "auto": {"a": 5.0, "b": 3.0, "c": 1.0, "d": None},
    }
    assert mixed._ratios(["always", "auto"], figures) == {
        "auto": {"a": 0.5, "b": None, "c": None, "d": None}
    }


def test_a_mode_named_twice_keeps_both_runs_figures():
    assert mixed._labels(["always", "auto", "always", "always"]) == {
        "always": "always",
        "auto": "auto",
        "always#2": "always",
        "always#3": "always",
    }


def test_medians_over_runs_and_the_runs_own_ratio_range(capsys):
    runs = [
        {"always": {"ttft": 10.0, "gap": None}, "auto": {"ttft": 12.0, "gap": 1.0}},
        {"always": {"ttft": 20.0, "gap": 2.0}, "auto": {"ttft": 10.0, "gap": 1.0}},
        {"always": {"ttft": 16.0, "gap": 2.0}, "auto": {"ttft": 8.0, "gap": 1.0}},
    ]
    mixed._print_medians(["always", "auto"], runs)
    out = json.loads(capsys.readouterr().out)
    assert out["runs"] == 3
    assert out["medians"] == {
        "always": {"ttft": 16.0, "gap": None},  # a figure missing in one run has no median
        "auto": {"ttft": 10.0, "gap": 1.0},
    }
    assert out["ratios"] == {"auto": {"ttft": 0.625, "gap": None}}
    # runs' own ratios: 1.2, 0.5, 0.5; "gap" had no ratio in the first run
    assert out["run_ratios"] == {"auto": {"ttft": [0.5, 1.2]}}


def test_one_mode_has_medians_alone(capsys):
    mixed._print_medians(["auto"], [{"auto": {"ttft": 0.1}}, {"auto": {"ttft": 0.2}}])
    out = json.loads(capsys.readouterr().out)
    assert out == {"bench": "mixed", "runs": 2, "medians": {"auto": {"ttft": 0.15}}}
