"""The CPU kernels seen from processes of their own: a kernel that cannot be built leaves
the portable op and says why, bad thread flags are one line, and `pdserve bench attention`
times both kernels (the kernels themselves: tests/unit/test_cpu_kernels.py)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.cluster_util import ROOT

HAS_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler: the portable ops serve")


def _kernels_backend_in_a_fresh_process(env: dict) -> subprocess.CompletedProcess:
    code = (
        "import torch; from common.engine.platform import configure_kernels; configure_kernels(); "
        "from kernels.backends import backend_for; from kernels import portable; "
        "print(backend_for(torch.zeros(1)).decode_attention is portable.decode_attention)"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        timeout=120,
    )


@pytest.mark.cluster
def test_an_unbuildable_kernel_leaves_the_portable_op_and_says_why(tmp_path):
    done = _kernels_backend_in_a_fresh_process({"CC": "false", "PDSERVE_HOME": str(tmp_path)})
    assert done.stdout.strip() == "True", done.stderr
    assert "fast cpu kernels unavailable" in done.stderr and "failed" in done.stderr
    done = _kernels_backend_in_a_fresh_process({"PDSERVE_DISABLE_CPU_KERNELS": "1"})
    assert done.stdout.strip() == "True" and "PDSERVE_DISABLE_CPU_KERNELS" in done.stderr


@pytest.mark.parametrize(
    "flag,match",
    [
        (["--threads", "0"], "--threads must be >= 1"),
        (["--cpus", "x-y"], "--cpus takes core numbers"),
    ],
)
@pytest.mark.cluster
def test_bad_thread_flags_are_one_line(tiny_model, flag, match):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefill_node",
            "--frontend",
            "tcp://127.0.0.1:1",
            "--model",
            str(tiny_model),
            *flag,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert (
        done.returncode == 2 and match in done.stderr and len(done.stderr.strip().splitlines()) == 1
    )


@needs_cc
@pytest.mark.cluster
def test_the_attention_benchmark_times_both_kernels_a_line_a_length():
    """`pdserve bench attention`: the C kernel and torch's for a short and a long chunk after
    a context, each line with the floor to read them against."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.bench.attention",
            "--query-lens",
            "32,300",
            "--context-len",
            "40",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [x["query_len"] for x in records] == [32, 300] and all(
        x["context_len"] == 40 for x in records
    )
    assert all(x["c_kernel_ms"] > 0 and x["torch_ms"] > 0 and x["floor_ms"] > 0 for x in records)
