"""A cluster's log as an operator reads it: every line names its process, the counts
agree, the frontend's periodic line comes while it works, an idle cluster says one
line and then nothing, HTTP requests are in the access log, an ordinary drain warns
of nothing; and each HTTP response says where its time went."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from frontend.client import Client
from tests.cluster_util import ROOT, Cluster, post_json, wait_for

pytestmark = pytest.mark.cluster
LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} (\S+) +(DEBUG|INFO|WARNING|ERROR) (.*)$")
NAMES = ("frontend", "prefill-0", "decode-0")
INTERVAL_S = 1.0  # PDSERVE_LOG_INTERVAL for this cluster


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the cluster's processes inherit it
        mp.setenv("PDSERVE_LOG_INTERVAL", str(INTERVAL_S))
        c = Cluster(tiny_model, tmp_path_factory.mktemp("logs") / "operator.log")
    c.served = tiny_model.name  # the model name HTTP clients give
    yield c
    c.stop()


def _log(cluster) -> list[tuple[str, str, str]]:
    """(name, level, message) of every line a pdserve process logged."""
    cluster.log.flush()
    text = open(cluster.log.name, encoding="utf-8", errors="replace").read()
    return [m.groups() for m in map(LINE.match, text.splitlines()) if m]


def _periodic(lines, name: str) -> list[str]:
    marks = {"frontend": "req/s | running", "prefill-0": "prompt tok/s |", "decode-0": "tok/s, "}
    return [msg for who, _, msg in lines if who == name and marks[name] in msg]


def test_the_log_names_each_process_says_its_figures_and_falls_quiet_when_idle(cluster):
    """Defects: lines carried the role, not the node's name; idle nodes logged a zero line
    every interval; no periodic frontend line; no access log; "2 thread(s)" against
    "1 torch thread"; "32768 KV blocks" against "free 32767/32767"."""
    status, body = post_json(
        cluster.http + "/v1/completions",
        {"model": cluster.served, "prompt": "hi", "max_tokens": 64, "ignore_eos": True},
    )
    assert status == 200, body
    with Client(cluster.endpoint) as c:
        c.complete_many(
            [dict(prompt_token_ids=[i + 1] * 40, max_tokens=200, ignore_eos=True) for i in range(8)]
        )

    # Busy: each process's periodic line; then each says once that it is idle.
    def all_idle() -> bool:
        lines = _log(cluster)
        return all(any(m.endswith("| idle now") for m in _periodic(lines, n)) for n in NAMES)

    wait_for(all_idle, 60, "every process to say it is idle")
    quiet_from = len(_log(cluster))
    time.sleep(4 * INTERVAL_S)  # four intervals of an idle cluster
    lines = _log(cluster)
    assert lines and all(who.split("/")[0] in NAMES for who, _, _ in lines), sorted(
        {who for who, _, _ in lines}
    )
    assert (
        _periodic(lines[quiet_from:], "frontend")
        == _periodic(lines[quiet_from:], "decode-0")
        == _periodic(lines[quiet_from:], "prefill-0")
        == []
    )
    busy = [m for m in _periodic(lines, "frontend") if not m.endswith("idle now")]
    assert busy and re.match(
        r"[\d.]+ req/s \| running \d+, waiting \d+ \| prompt \d+ tok/s, "
        r"generation \d+ tok/s \| KV cache [\d.]+% used \| prefix-cache hit "
        r"rate ([\d.]+%|-)$",
        busy[0],
    )
    assert any(
        re.search(r'"POST /v1/completions HTTP/1.1" 200 [\d.]+ ms$', m)
        for who, _, m in lines
        if who == "frontend/access"
    )
    # The counts each process gives of itself agree with the launcher's and each other's.
    launcher = open(cluster.log.name).read()
    threads = re.search(r"each cpu decode node (\d+ threads?)", launcher)[1]
    ready = next(m for who, _, m in lines if who == "decode-0" and m.startswith("ready on"))
    assert f"({threads} on cores" in ready
    assert "matmul" in ready or "portable (torch)" in ready  # the kernels it chose, in words
    blocks = int(re.search(r": (\d+) KV blocks", ready)[1])
    assert any(
        m.startswith("decode node decode-0 ready (pid") and f"{blocks} KV blocks" in m
        for who, _, m in lines
        if who == "frontend"
    )
    assert all(re.search(rf"free blocks \d+/{blocks}\b", m) for m in _periodic(lines, "decode-0"))


def test_each_http_response_says_where_its_time_went(cluster):
    """Defect: no client could see a request's server-side phases (queue, prefill, KV
    transfer, decode) to trace a missed SLO to its phase."""
    body = {"model": cluster.served, "prompt": "hello", "max_tokens": 8, "ignore_eos": True}
    req = urllib.request.Request(
        cluster.http + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        timing = r.headers["Server-Timing"]
    phases = dict(re.findall(r"(\w+);dur=([\d.]+)", timing))
    assert {"queue", "prefill", "kv_transfer", "decode", "total"} <= set(phases), timing
    assert float(phases["total"]) >= float(phases["decode"])
    for options in ({}, {"stream_options": {"include_usage": True}}):
        req = urllib.request.Request(
            cluster.http + "/v1/chat/completions",
            json.dumps(
                {
                    "model": cluster.served,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8,
                    "stream": True,
                    **options,
                }
            ).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            events = [
                json.loads(x[6:])
                for x in r.read().decode().split("\n\n")
                if x.startswith("data: {")
            ]
        assert [bool(e.get("timings")) for e in events].count(True) == 1, options
        last = events[-1]["timings"]
        assert {"queue_ms", "prefill_ms", "decode_ms", "total_ms"} <= set(last), last


def test_an_ordinary_drain_warns_of_nothing(cluster):
    """Defect: draining a node logged a WARNING about a KV link "made again"."""
    with Client(cluster.endpoint) as c:
        c.complete(prompt_token_ids=[5] * 20, max_tokens=4)

    def num_ready() -> int:
        return sum(
            who == "frontend" and m.startswith("decode node decode-0 ready")
            for who, _, m in _log(cluster)
        )

    before = num_ready()
    r = subprocess.run(
        [sys.executable, "-m", "launch.cli", "drain", "decode-0", "--endpoint", cluster.endpoint],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.startswith("draining decode-0:"), r.stderr
    wait_for(lambda: num_ready() > before, 120, "decode-0 started again by the launcher")
    with Client(cluster.endpoint) as c:  # a request through the new decode-0: the KV link again
        assert c.complete(prompt_token_ids=[6] * 20, max_tokens=4).finish_reason == "length"
    warnings = [m for _, level, m in _log(cluster) if level == "WARNING"]
    assert not warnings, warnings
