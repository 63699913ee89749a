"""Goodput as the field measures it: AIPerf's command from docs/openai_api.md, run as
written against a cluster's OpenAI API, and pdserve's own `pdserve bench --slo` beside
it (vLLM's `bench serve --goodput`). AIPerf lives in an environment of its own
(launch/run_tests.sh puts it at .venv/tools/aiperf)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster_util import ROOT, Cluster

pytestmark = pytest.mark.cluster
AIPERF = Path(sys.prefix) / "tools" / "aiperf" / "bin" / "aiperf"


def _documented(tool: str) -> list[str]:
    """The page's command for a tool, its lines joined, as argv."""
    text = (ROOT / "docs" / "openai_api.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    block = next(b for b in blocks if b.lstrip().startswith(tool))
    return shlex.split(block.replace("\\\n", " "))


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    c = Cluster(tiny_model, tmp_path_factory.mktemp("logs") / "goodput.log")
    yield c
    c.stop()


def test_aiperf_measures_goodput_against_pdserve_as_documented(cluster, tiny_model, tmp_path):
    if not AIPERF.exists():
        pytest.skip(f"no AIPerf at {AIPERF}: bash launch/run_tests.sh installs it")
    argv = _documented("aiperf")
    fill = {
        "http://127.0.0.1:8000": cluster.http,
        "/path/to/model": str(tiny_model),
        "OUT": str(tmp_path),
        "tiny-qwen3": tiny_model.name,
    }
    argv = [fill.get(x, x) for x in argv]
    # The page's SLOs are a GPU's; the tiny model on a busy CPU gets a minute each.
    slo = argv.index("--goodput") + 1
    argv[slo] = "time_to_first_token:60000 inter_token_latency:60000"
    # NOTE: the random tiny model may pick its end token first (about one request in 500):
    # an answer of no text, which AIPerf counts as an error
    argv += ["--extra-inputs", '{"ignore_eos": true}']
    done = subprocess.run(
        [str(AIPERF), *argv[1:], "--ui-type", "none"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    summary = json.loads(next(tmp_path.rglob("profile_export_aiperf.json")).read_text())
    assert summary["request_count"]["avg"] == summary["completed_request_count"]["avg"] == 16
    assert summary["error_summary"] == [] and summary["is_complete"]
    # Every request met the (generous) SLOs: all of them count towards goodput.
    assert summary["good_request_count"]["avg"] == 16 and summary["goodput"]["avg"] > 0


def test_pdserve_bench_measures_goodput_under_an_slo(cluster):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.cli",
            "bench",
            "--base-url",
            cluster.http,
            "--input-len",
            "32",
            "--output-len",
            "8",
            "--num-prompts",
            "8",
            "--request-rate",
            "inf",
            "--num-warmup",
            "1",
            "--slo",
            "ttft_ms=60000,tpot_ms=60000",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (record,) = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert record["goodput"] > 0 and record["completed"] == 8
    assert "goodput: requests/s meeting {'ttft_ms': 60000.0, 'tpot_ms': 60000.0}" in r.stderr
