"""What a new user meets: the client cleans up after itself, the command line says
when it failed, start-up errors are one actionable line, the `pdserve` command
works, and the serving benchmark runs over both interfaces."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from frontend.client import AsyncClient, Client
from tests.cluster_util import ROOT, Cluster, free_base_port, wait_for

pytestmark = pytest.mark.cluster  # every test here starts processes

# The installed command; where the environment is not the project's own (an
# accelerator image without a registry), the same entry point as a module.
_SCRIPT = Path(sys.executable).parent / "pdserve"
PDSERVE = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "launch.cli"]


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    c = Cluster(tiny_model, tmp_path_factory.mktemp("logs") / "usability.log")
    yield c
    c.stop()


def _idle(cluster) -> bool:
    """No request on any node and every KV block free."""
    nodes = cluster.stats().values()
    return all(
        s["num_free_blocks"] == s["num_usable_blocks"]
        and not s.get("num_reserved_blocks")
        and not s.get("num_running")
        and not s.get("num_prefilling")
        for s in nodes
    )


def _num_running(cluster) -> int:
    with Client(cluster.endpoint) as c:
        return c.stats().frontend["num_running"] + c.stats().frontend["num_waiting"]


def _run(*args, timeout=120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)


# ---- the client aborts what it walks away from ----------------------------------


def test_breaking_out_of_generate_aborts_the_request(cluster):
    with Client(cluster.endpoint) as c:
        for out in c.generate(prompt_token_ids=[1, 2, 3], max_tokens=900, ignore_eos=True):
            if out.token_ids:
                break
        wait_for(lambda: _num_running(cluster) == 0, 30, "the request to be aborted")
    wait_for(lambda: _idle(cluster), 30, "every block freed")


def test_cancelling_an_async_client_task_aborts_the_request(cluster):
    async def run():
        async with AsyncClient(cluster.endpoint) as c:
            started = asyncio.Event()

            async def consume():
                async for out in c.generate(
                    prompt_token_ids=[4, 5, 6], max_tokens=900, ignore_eos=True
                ):
                    started.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(started.wait(), 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The same client still serves: the cancelled stream left nothing behind.
            result = await c.complete(prompt_token_ids=[7, 8], max_tokens=3, ignore_eos=True)
            assert len(result.token_ids) == 3

    asyncio.run(run())
    wait_for(lambda: _num_running(cluster) == 0, 30, "the request to be aborted")
    wait_for(lambda: _idle(cluster), 30, "every block freed")


def test_ctrl_c_on_the_cli_aborts_its_request(cluster):
    p = subprocess.Popen(
        [
            *PDSERVE,
            "client",
            "--endpoint",
            cluster.endpoint,
            "--prompt",
            "x",
            "--max-tokens",
            "900",
            "--ignore-eos",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    p.stdout.read(1)  # it streams ...
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and b"interrupted" in err
    wait_for(lambda: _num_running(cluster) == 0, 30, "the request to be aborted")
    wait_for(lambda: _idle(cluster), 30, "every block freed")


# ---- the command line says when it failed ------------------------------------------


def test_cli_exits_nonzero_when_a_request_fails(cluster):
    ok = _run(
        *PDSERVE, "client", "--endpoint", cluster.endpoint, "--prompt", "hi", "--max-tokens", "2"
    )
    assert ok.returncode == 0, ok.stderr
    bad = _run(
        *PDSERVE, "client", "--endpoint", cluster.endpoint, "--prompt", "hi", "--temperature", "-1"
    )
    assert bad.returncode == 1 and "[error: temperature" in bad.stdout
    long = _run(
        *PDSERVE,
        "client",
        "--endpoint",
        cluster.endpoint,
        "--json",
        "--prompt",
        "hi",
        "--prompt",
        "x " * 2000,
    )
    assert long.returncode == 1
    assert [json.loads(line)["finish_reason"] for line in long.stdout.splitlines()] == [
        "length",
        "error",
    ]


def test_cli_says_fast_when_nothing_answers_and_rejects_a_bad_endpoint():
    port = free_base_port(1)
    t = time.monotonic()
    r = _run(
        *PDSERVE,
        "client",
        "--endpoint",
        f"tcp://127.0.0.1:{port}",
        "--prompt",
        "x",
        "--timeout",
        "2",
    )
    assert r.returncode == 1 and "nothing answers at" in r.stderr and time.monotonic() - t < 30
    assert len(r.stderr.strip().splitlines()) == 1
    r = _run(*PDSERVE, "client", "--endpoint", "localhost:5600", "--prompt", "x")
    assert r.returncode == 2 and "endpoint must be tcp://HOST:PORT" in r.stderr
    assert "Traceback" not in r.stderr
    with pytest.raises(ValueError, match="endpoint must be"):
        Client("127.0.0.1:5600")


def test_help_shows_defaults():
    r = _run(*PDSERVE, "client", "--help")
    assert r.returncode == 0 and "(default: 16)" in " ".join(
        r.stdout.split()
    )  # the library's max_tokens
    for module in ("frontend", "prefill_node", "decode_node"):
        r = _run(sys.executable, "-m", module, "--help")
        assert r.returncode == 0 and "(default:" in r.stdout and "--log-level" in r.stdout
    r = _run(sys.executable, "-m", "prefill_node", "--help")
    assert "--max-num-batched-tokens" in r.stdout and "--gpu-memory-utilization" in r.stdout


# ---- start-up errors are one line that names the fix --------------------------------


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert all(n in r.stderr for n in needles), r.stderr[-3000:]


def test_startup_errors_are_one_actionable_line(tiny_model, tmp_path):
    port = free_base_port(2)
    fe = [
        sys.executable,
        "-m",
        "frontend",
        "--clients",
        f"tcp://127.0.0.1:{port}",
        "--nodes",
        f"tcp://127.0.0.1:{port + 1}",
    ]
    _one_line_error(
        _run(*fe, "--model", "Qwen/Qwen3-0.6B"), "looks like a model id", "downloads nothing"
    )
    _one_line_error(_run(*fe, "--model", str(tmp_path / "missing")), "no model directory at")
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model, bare)
    for f in bare.iterdir():
        if "token" in f.name or f.name in ("vocab.json", "merges.txt"):
            f.unlink()
    _one_line_error(_run(*fe, "--model", str(bare)), "has no tokenizer files")
    node = [sys.executable, "-m", "prefill_node", "--frontend", f"tcp://127.0.0.1:{port + 1}"]
    _one_line_error(
        _run(*node, "--model", str(tmp_path / "missing")), "prefill_node: no model directory"
    )
    import torch

    if not torch.cuda.is_available():
        _one_line_error(
            _run(*node, "--model", str(tiny_model), "--device", "cuda:0"),
            "no usable CUDA device",
            "--device cpu",
        )
    _one_line_error(_run(*fe, "--model", str(tiny_model), "--http-port", "0"), "http_port must be")


def test_the_launcher_names_the_process_that_failed(tiny_model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    base = free_base_port(4)
    r = _run(
        "bash",
        "launch/start_cluster.sh",
        "--model",
        str(tiny_model),
        "--base-port",
        str(base),
        "--http-port",
        str(base + 3),
        "--decode-device",
        "cuda:0",
        "--no-keys",
        timeout=300,
    )
    _one_line_error(r, "no usable CUDA device", "decode-0 (pid")
    assert re.search(r"decode-0 \(pid \d+\) exited with code 2 during start-up", r.stderr)


def test_an_http_port_in_use_is_one_line(tiny_model, cluster):
    port = free_base_port(2)
    r = _run(
        sys.executable,
        "-m",
        "frontend",
        "--model",
        str(tiny_model),
        "--clients",
        f"tcp://127.0.0.1:{port}",
        "--nodes",
        f"tcp://127.0.0.1:{port + 1}",
        "--http-port",
        cluster.http.rsplit(":", 1)[1],
    )
    _one_line_error(r, "cannot serve HTTP on 127.0.0.1", "choose another --http-port")


# ---- the pdserve command and the README --------------------------------------------


def test_the_pdserve_command():  # what the README and docs say: tests/unit/test_docs.py
    if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():
        assert _SCRIPT.exists(), "launch/env.sh installs the pdserve command into .venv"
    r = _run(*PDSERVE)
    assert r.returncode == 2 and "pdserve serve" in r.stdout
    r = _run(*PDSERVE, "serve", "--help")
    assert r.returncode == 0 and "--http-port" in r.stdout


# ---- the serving benchmark -------------------------------------------------------


@pytest.mark.parametrize("interface", ["zmq", "http"])
def test_bench_serving_over_both_interfaces(cluster, tmp_path, interface):
    target = (
        ["--endpoint", cluster.endpoint] if interface == "zmq" else ["--base-url", cluster.http]
    )
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    # zmq, --max-tokens 40: each request asks for 40 tokens and is left after 8 (aborted
    # there). Over HTTP the TTFT parts come at the end of a stream, so it runs to its end.
    asked = ["--max-tokens", "40"] if interface == "zmq" else []
    r = _run(
        *PDSERVE,
        "bench",
        *target,
        "--input-len",
        "32",
        "--prefix-len",
        "32",
        "--output-len",
        "8",
        *asked,
        "--num-prompts",
        "12",
        "--request-rate",
        "20,inf",
        "--num-warmup",
        "2",
        "--slo",
        "ttft_ms=60000,tpot_ms=60000",
        "--save-json",
        str(out_json),
        "--plot",
        str(out_png),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["request_rate"] for x in lines] == [20.0, "inf"]
    for x in lines:
        assert x["interface"] == interface and x["completed"] == 12 and x["errors"] == 0
        assert x["goodput"] > 0 and x["ttft_ms"]["p99"] >= x["ttft_ms"]["median"] > 0
        assert (
            x["output_tokens_per_s"] > 0
            and x["cluster_ttft_parts_median_ms"]["prefill_ms"] is not None
        )
        # NOTE: the rates are rounded and a 12-request run can last ~30 ms, so the product of
        # two rounded figures is only checked loosely; the count itself is exact.
        assert x["num_output_tokens"] == 12 * 8
        assert x["output_tokens_per_s"] * x["duration_s"] == pytest.approx(12 * 8, rel=0.02)
        # The frontend's CPU time: its stats over ZeroMQ, /metrics' process_cpu_seconds_total
        # (10 ms ticks, so possibly 0 for this short run) over HTTP.
        assert (
            x["frontend_cpu_us_per_token"] > 0
            if interface == "zmq"
            else x["frontend_cpu_us_per_token"] >= 0
        )
        if interface == "zmq":  # the decode node's own figures, from its heartbeats
            assert (
                x["max_tokens"] == 40 and x["mean_decode_batch"] >= 1 and x["num_preemptions"] == 0
            )
            assert 1 <= x["mean_prefill_batch"] <= 12
    # Every prompt starts with the same 32 tokens, cached since the warm-up: a prefill
    # node computes the other 32 (over HTTP the figure is not available).
    for x in lines:
        computed = x["prefill_tokens_per_request"]
        assert (computed is None) if interface == "http" else (0 < computed <= 40), computed
    saved = json.loads(out_json.read_text())
    assert [{k: v for k, v in x.items() if k != "samples"} for x in saved] == lines
    assert all(len(x["samples"]["ttft_ms"]) == 12 for x in saved)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "again.png"
    r = _run(*PDSERVE, "bench", "--replot", str(out_json), "--plot", str(again))
    assert r.returncode == 0 and again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_node_benchmarks_fit_the_model_or_say_why(tiny_model):
    """On CPU, with a model limited to 1,024 tokens: defaults cut to fit, or one line."""
    r = _run(
        sys.executable,
        "-m",
        "launch.bench.prefill",
        "--model",
        str(tiny_model),
        "--batch",
        "2",
        "--rounds",
        "1",
        "--device",
        "cpu",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads(r.stdout.splitlines()[-1])
    assert record["prompt_len"] == 1024 - 16 and record["floor"] == "roofline"
    assert record["bound"] in ("matmul rate", "memory bandwidth") and "prefill: " in r.stderr
    r = _run(
        sys.executable,
        "-m",
        "launch.bench.decode",
        "--model",
        str(tiny_model),
        "--max-tokens",
        "5000",
    )
    _one_line_error(r, "--max-tokens 5000 does not fit the model's maximum length")
    r = _run(
        sys.executable,
        "-m",
        "launch.bench.profile",
        "--model",
        str(tiny_model),
        "--batch",
        "1",
        "--decode-steps",
        "2",
        "--top",
        "2",
        timeout=600,
    )
    assert r.returncode == 0 and "== decode batch 1" in r.stdout, r.stderr[-3000:]
    import torch

    if not torch.cuda.is_available():
        _one_line_error(
            _run(sys.executable, "-m", "launch.bench.profile", "--device", "cuda:0"),
            "no usable CUDA device",
        )
