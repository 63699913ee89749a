"""The benchmarks' own decisions, in this process: a step's floor as a roofline (bytes
over bandwidth or FLOPs over the matmul rate, whichever binds), bandwidth measured on
filled buffers, the KV cache and request lengths each sizes for itself, the memory
check before anything loads, the tables and the plot. The commands themselves run as
documented in tests/cluster/test_docs_run.py."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

from common.base.model_spec import preset_spec
from launch.bench import common, decode, report, serving

# The host: 92 GB/s on filled buffers, 0.219 TFLOP/s.
HOST = {"bandwidth_GBps": 92.0, "matmul_TFLOPs": 0.219}


def test_a_decode_step_is_bound_by_compute_where_its_flops_outweigh_its_bytes():
    """Defect: the decode floor counted bytes alone: batch 8 at the 0.6B shape is ~9.6
    GFLOP a step (~44 ms here) against a 'memory bandwidth' floor of ~27 ms."""
    from launch.bench import floors

    spec = preset_spec("qwen3-0.6b")
    roof = floors.roofline(*floors.decode_cost(spec, 4, 8, 256), HOST)
    assert roof["bound"] == floors.COMPUTE and roof["floor_ms"] == roof["compute_floor_ms"]
    assert 40 < roof["compute_floor_ms"] < 50 and roof["memory_floor_ms"] < roof["compute_floor_ms"]
    one = floors.roofline(*floors.decode_cost(spec, 4, 1, 256), HOST)
    assert one["bound"] == floors.MEMORY and one["floor_ms"] == one["memory_floor_ms"]
    big = floors.roofline(*floors.prefill_cost(spec, 4, 8, 1024), HOST)
    assert big["bound"] == floors.COMPUTE and big["gflop"] > 1000


def test_bandwidth_is_measured_on_filled_buffers(monkeypatch):
    """Defect: the copy read an untouched torch.empty buffer (pages not yet there), which
    reads ~30% faster than memory does: every CPU floor came out too low."""
    copied = []
    real = torch.Tensor.copy_

    def copy_(dst, src, *a, **kw):
        if src.numel() >= 1 << 20:
            copied.append((int(src[0]), int(src[-1]), int(dst[-1])))
        return real(dst, src, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    floors_module = sys.modules[common.measure_floors.__module__]
    monkeypatch.setattr(floors_module, "_matmul_rate", lambda *a: 0.1)
    figures = common.measure_floors("cpu", torch.float32)
    assert len(copied) >= 8 and all(c == (1, 1, 0) or c == (1, 1, 1) for c in copied), copied[:3]
    assert figures["bandwidth_GBps"] > 0


def _args(**kw) -> argparse.Namespace:
    base = dict(
        model=None,
        shape="qwen3-0.6b",
        device="cpu",
        dtype=None,
        kv_cache_memory=None,
        context_len=256,
        steps=16,
        window=1.0,
    )
    return argparse.Namespace(**{**base, **kw})


def test_decode_sizes_its_requests_and_kv_cache_itself():
    """Defect: --shape qwen3-0.6b --batch-sizes 1,8 --steps 16 ended in "decode node
    refused b1-0: needs 208 KV blocks, this decode node has 72": the node got the CPU
    default KV cache whatever the benchmark would hand it."""
    spec, a = preset_spec("qwen3-0.6b"), _args()
    room = spec.max_position_embeddings - a.context_len - 1
    need = {b: decode.tokens_needed(spec, 4, HOST, b, a, room) for b in (1, 8)}
    # Enough to outlast warm-up, the timed steps and the counter window at the floor's pace.
    assert all(n >= decode.WARM_STEPS + a.steps + 1 for n in need.values()) and need[1] >= need[8]
    budget = common.kv_budget(a, spec, 4, [a.context_len + need[8] + 1] * 8, 16)
    per_block = 16 * spec.kv_bytes_per_token(4)
    assert budget // per_block >= 8 * -(-(a.context_len + need[8] + 1) // 16) + 1
    assert common.kv_budget(_args(kv_cache_memory="2GiB"), spec, 4, [100], 16) == 2 * 2**30
    tiny = decode.tokens_needed(spec, 4, {"bandwidth_GBps": 1e9, "matmul_TFLOPs": 1e9}, 1, a, 767)
    assert tiny == 767  # a step this fast: as long as the model allows


def test_a_model_the_host_cannot_hold_is_refused_in_one_line_before_it_loads(monkeypatch):
    """Defect: --shape qwen3-14b with no --device on a CPU host asked for ~56 GB of fp32
    weights on a 23 GB machine, with no check before it started."""
    from launch.cluster import memory_check

    monkeypatch.setattr(memory_check, "available_bytes", lambda: 23 * memory_check.GIB)
    monkeypatch.setattr(sys, "argv", ["pdserve"])
    spec = preset_spec("qwen3-14b")
    with pytest.raises(SystemExit) as e:
        common.check_memory(_args(shape="qwen3-14b"), spec, 4, 2**30)
    msg = str(e.value)
    assert msg.startswith("pdserve: qwen3-14b on cpu needs ~") and "23.0 GiB is available" in msg
    assert "--dtype bfloat16" in msg and "\n" not in msg
    common.check_memory(_args(), preset_spec("qwen3-0.6b"), 4, 2**30)  # fits: no exit


def _record(rate, **kw) -> dict:
    dist = {"mean": 10.0, "median": 9.0, "p90": 12.0, "p99": 15.0}
    return {
        "request_rate": rate,
        "request_throughput": kw.get("rps", 2.0),
        "completed": 10,
        "num_requests": 10,
        "errors": 0,
        "output_tokens_per_s": 100.0,
        "goodput": 1.5,
        "slo": {"ttft_ms": 500.0},
        "ttft_ms": dist,
        "tpot_ms": dist,
        "itl_ms": dist,
        "e2e_ms": dist,
        "model": "m",
        "interface": "zmq",
        "target": "tcp://x",
        "input_len": 32,
        "output_len": 8,
        "samples": {"ttft_ms": [1.0, 2.0], "tpot_ms": [1.0]},
    }


def test_the_serving_sweep_ends_in_a_table_a_person_reads():
    """Defect: one JSON line per rate and no summary a person reads."""
    text = report.table_of([_record(2.0), _record("inf", rps=280.0)])
    lines = text.splitlines()
    assert lines[0].startswith("serving: m over zmq")
    assert "TTFT p50" in lines[2] and "goodput" in lines[2]
    assert lines[4].split()[:4] == ["2.0", "10/10", "0", "2.00"] and lines[5].split()[0] == "inf"


def test_the_plot_puts_rates_on_a_log_axis_each_point_labelled(monkeypatch, tmp_path):
    """Defect: the burst's 280 req/s on a linear axis squashed 2, 4 and 8 req/s into its
    left edge, unlabelled."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    seen = []
    monkeypatch.setattr(plt, "close", seen.append)
    report.plot(
        str(tmp_path / "p.png"),
        [_record(2.0, rps=2.0), _record(8.0, rps=7.5), _record("inf", rps=280.0)],
    )
    ax = seen[0].axes[0]
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.texts] == ["2/s", "8/s", "all at once"]


def test_plot_without_matplotlib_names_a_command_that_installs_it(monkeypatch, capsys):
    """Defect: it said pip install 'pdserve[bench]', which does not install anything."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as e:
        serving.main(["--plot", "out.png"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{sys.executable} -m pip install matplotlib" in err


def test_serving_with_nothing_to_measure_says_so_in_one_line(capsys):
    """Defect: with no cluster running it waited 11 s and printed a 50-line traceback."""
    from tests.cluster_util import free_base_port

    port = free_base_port(1)
    with pytest.raises(SystemExit) as e:
        serving.main(["--endpoint", f"tcp://127.0.0.1:{port}", "--num-prompts", "1", "--quiet"])
    want = f"pdserve bench: nothing answers at tcp://127.0.0.1:{port} within 5s"
    assert str(e.value).startswith(want)


def test_each_decode_row_shows_the_bandwidth_its_floor_was_set_against():
    """A shared host's bandwidth drifted from 44 to 79 GB/s within one batch size's steps,
    and every row was set against one copy before the node started: each row now carries
    the rate around its own steps, and the table shows it."""
    rows = []
    for batch, gbps in ((1, 44.5), (8, 79.3)):
        rows.append(
            {
                "batch": batch,
                "shape": "qwen3-0.6b",
                "device": "cpu",
                "dtype": "bfloat16",
                "context_len": 256,
                "ms_per_step": 30.0,
                "tokens_per_s": batch * 33.3,
                "floor_ms_per_step": 1.22 / gbps * 1e3,
                "floor_fraction": 0.8,
                "bound": "memory bandwidth",
                "bandwidth_GBps": gbps,
                "bandwidth_when": "the mean of one just before and one just after the row's steps",
                "matmul_TFLOPs": 0.9,
                "mean_context_len": 272,
                "h2d_writes_per_steady_step": 0.0,
                "device_idle_share": 0.0,
            }
        )
    text = decode.table_of(rows)
    assert "GB/s" in text.splitlines()[2]
    assert [line.split()[7] for line in text.splitlines()[4:6]] == ["44.5", "79.3"]
    assert "just before and one just after the row's steps" in text


def test_a_host_row_is_set_against_the_bandwidth_around_its_steps_an_accelerator_is_not(
    monkeypatch,
):
    """On a host a copy's bandwidth is measured just before and just after a row's steps,
    and the row's floor takes their mean; an accelerator's would need 2 GiB beside the
    node's memory: it is never measured while the node is up."""
    calls = []
    rates = iter([40.0, 80.0])

    def measure(device):
        calls.append(("measure", device))
        return next(rates)

    def run():
        calls.append(("run",))
        return {"ms_per_step": 1.0}

    monkeypatch.setattr(decode, "measure_bandwidth", measure)
    start = {"bandwidth_GBps": 50.0, "matmul_TFLOPs": 0.9}
    figures, floors = decode.around_steps("cpu", start, run)
    assert figures == {"ms_per_step": 1.0}
    assert calls == [("measure", "cpu"), ("run",), ("measure", "cpu")]
    assert floors["bandwidth_GBps"] == 60.0 and floors["bandwidth_GBps_before_after"] == [40, 80]
    assert floors["bandwidth_GBps_at_start"] == 50.0 and "just before" in floors["bandwidth_when"]
    calls.clear()
    figures, floors = decode.around_steps("cuda:0", start, run)
    assert calls == [("run",)] and floors["bandwidth_GBps"] == 50.0
    assert "bandwidth_GBps_before_after" not in floors
    assert floors["bandwidth_when"] == "measured before the node started"
