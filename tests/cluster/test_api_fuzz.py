"""The OpenAI API fuzzed from its own OpenAPI document: schemathesis reads /openapi.json
from a running cluster and sends what it generates from the schemas (bodies that fit
them, and bodies that break them) to the completions, chat, tokenize and detokenize
routes. No case is a server error, every refusal is OpenAI's shape, a stream running
meanwhile keeps its pace, and every process is still the one that started.

The cases are the same on every run (derandomized), so a failure reproduces."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.cluster_util import ROOT, Cluster, is_alive, python_children_of

pytestmark = pytest.mark.cluster
ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
# Cases per route and mode: about a minute in all on two cores.
NUM_CASES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 20}
STREAM_TOKENS = 200


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("fuzz") / "c.log",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "8",
    )
    yield c
    c.stop()


# Streams of STREAM_TOKENS tokens, one after another, in a process of its own (so that
# generating cases here takes no time from it): it says "alone" once two have run, and at
# a line on its stdin ends with the stream under way, then prints each gap between a
# stream's outputs (with the monotonic time it ended) and any error.
STREAMS = """
import asyncio, json, sys, time
from frontend.client import AsyncClient

async def main(endpoint, num_tokens):
    gaps, errors, num_streams = [], [], 0
    is_stopped = asyncio.Event()
    asyncio.get_running_loop().add_reader(sys.stdin.fileno(), is_stopped.set)
    async with AsyncClient(endpoint, idle_timeout_s=120) as client:
        while not is_stopped.is_set():
            last = None
            async for out in client.generate(prompt_token_ids=[5, 6, 7, 8], max_tokens=num_tokens,
                                             ignore_eos=True):
                now = time.monotonic()
                if last is not None:
                    gaps.append((now, now - last))
                last = now
                errors += [out.error] if out.error else []
            num_streams += 1
            if num_streams == 2:
                print("alone", flush=True)
    print(json.dumps({"gaps": gaps, "errors": errors}), flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def _line(proc: subprocess.Popen, timeout_s: float) -> str:
    if not select.select([proc.stdout], [], [], timeout_s)[0]:
        raise AssertionError(f"the streams said nothing in {timeout_s}s")
    return proc.stdout.readline().decode()


def _largest_gap(gaps: list, start: float, end: float) -> float:
    return max((g for t, g in gaps if start <= t <= end), default=0.0)


def _pids(cluster) -> dict:
    """The processes that serve: each node's and the frontend's, by what the frontend says."""
    from frontend.client import Client

    with Client(cluster.endpoint) as c:
        stats = c.stats()
    return {"frontend": stats.frontend["pid"], **{n: s["pid"] for n, s in stats.nodes.items()}}


def _integral(value):
    """value with each float that is a whole number as an int. NOTE: JSON Schema's integers
    include 2.0, which the server refuses where it asks for an integer (as it always did):
    a case meant to fit the schema sends 2."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return {k: _integral(v) for k, v in value.items()} if isinstance(value, dict) else value


def _fuzz(base_url: str, operation, mode: GenerationMode, num: int, seen) -> None:
    """num cases of operation in mode, each sent and its answer checked; seen(status) of each."""

    @settings(
        max_examples=num,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        if mode is GenerationMode.POSITIVE:
            case.body = _integral(case.body)
        response = case.call(base_url=base_url, timeout=120)
        seen(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])
        assert response.status_code in (200, 400, 404), (response.status_code, response.text)
        if response.status_code != 200:  # OpenAI's shape, the status in it
            assert response.json()["error"]["code"] == response.status_code

    fuzz()


def _fuzz_all(base_url: str, schema) -> tuple[dict, dict]:
    """Every route fuzzed in both modes: (cases by route and mode, cases by status)."""
    counts, statuses = {}, {}
    for route in ROUTES:
        for mode, num in NUM_CASES.items():
            counts[(route, mode.value)] = 0

            def seen(status: int, key=(route, mode.value)) -> None:
                counts[key] += 1
                statuses[status] = statuses.get(status, 0) + 1

            _fuzz(base_url, schema[route]["POST"], mode, num, seen)
    return counts, statuses


def test_the_api_fuzzed_from_its_openapi_document(cluster, capsys, record_property):
    started = python_children_of(cluster.proc.pid)
    pids = _pids(cluster)
    schema = schemathesis.openapi.from_url(cluster.http + "/openapi.json")
    streams = subprocess.Popen(
        [sys.executable, "-c", STREAMS, cluster.endpoint, str(STREAM_TOKENS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert _line(streams, 120).strip() == "alone"
        fuzz_start = time.monotonic()
        counts, statuses = _fuzz_all(cluster.http, schema)
        fuzz_end = time.monotonic()
        streams.stdin.write(b"stop\n")
        streams.stdin.flush()
        report = json.loads(_line(streams, 120))
    finally:
        streams.kill()
        streams.wait()
    total = sum(counts.values())
    before = _largest_gap(report["gaps"], 0, fuzz_start)
    during = _largest_gap(report["gaps"], fuzz_start, fuzz_end)
    record_property("schemathesis_cases", total)
    with capsys.disabled():
        each = ", ".join(f"{r} {m}: {n}" for (r, m), n in counts.items())
        print(
            f"\nschemathesis: {total} cases in {fuzz_end - fuzz_start:.0f}s ({each}); "
            f"statuses {statuses}; the stream beside: largest gap between tokens "
            f"{before * 1e3:.0f} ms alone, {during * 1e3:.0f} ms while fuzzed"
        )
    assert all(counts.values()), counts
    assert not report["errors"], report["errors"]
    assert during < max(1.0, 5 * before), (during, before)
    assert _pids(cluster) == pids and all(map(is_alive, started)), "a process was restarted"
