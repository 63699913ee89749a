"""KV pushed layer by layer against whole writes, across two simulated hosts whose link
is shaped so that a long prompt's transfer is comparable to its prefill.

    python -m launch.bench.layerwise [--model DIR] [--rate-mbit 200] [--prompt-lens 256,1024,2048]
        [--num-requests 5] [--kv-transfer tcp] [--flag=--kv-layerwise --modes off,on]
                                                                    (root: simulated hosts)

Host a runs the frontend and a prefill node, host b a decode node (`start_cluster.sh`
on each, b joining a), each host a network namespace of its own (launch/tools/netns.py);
host a's link is shaped with `tc qdisc ... tbf` to --rate-mbit. For each
`--kv-layerwise` mode (off, then on) the cluster is started fresh, and requests go one at
a time (light load: no queueing), each prompt fresh (no prefix cache hits), streaming:
the time to the first token (the prefill node's) and to the second (the first one the
decode node samples, after the KV landed). One JSON line per mode and prompt length,
then one with the ratios (on / off) of the medians: where layer by layer pays, its
second token comes at about max(prefill, transfer) instead of their sum. --flag compares
another prefill node flag's values the same way (--flag=--kv-wire-dtype --modes same,auto:
int8 on the wire; the ratios are then the last mode's over the first's), and each request's
wire format and why are counted from its timings.
Without --model, a random Qwen3 of 8 layers (hidden 256, 2 KV heads of 64, fp32: 8 KiB
of KV a token) is made on first use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from common.base.parse import DTYPES
from common.runtime.process import HelpFormat

ROOT = Path(__file__).resolve().parents[2]
SHAPE = [
    "--layers",
    "8",
    "--hidden-size",
    "256",
    "--intermediate-size",
    "768",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "64",
    "--max-position-embeddings",
    "8192",
]


def _client(
    endpoint: str, prompt_lens: list[int], num_requests: int, seed: int, vocab_size: int
) -> None:
    """Run on host a: each request alone; print one JSON line of (len, first s, second s)."""
    import numpy as np

    from frontend.client import AsyncClient

    rng = np.random.default_rng(seed)

    async def run() -> list:
        rows = []
        async with AsyncClient(endpoint, idle_timeout_s=120) as client:
            for n in prompt_lens:
                for _ in range(num_requests):
                    prompt = rng.integers(1, vocab_size - 1, size=n).tolist()
                    start, times, num_tokens, wire = time.monotonic(), [], 0, ""
                    async for out in client.generate(
                        prompt_token_ids=prompt, max_tokens=4, ignore_eos=True
                    ):
                        if out.error:
                            raise SystemExit(f"bench layerwise: a request failed: {out.error}")
                        num_tokens += len(out.token_ids)
                        while len(times) < min(num_tokens, 2):
                            times.append(time.monotonic() - start)
                        t = out.timings or {}
                        wire = wire or (
                            f"{t['kv_wire']}: {t['kv_wire_why']}" if t.get("kv_wire") else ""
                        )
                    rows.append((n, *times[:2], wire))
        return rows

    rows = asyncio.run(run())
    from frontend.client import Client

    with Client(endpoint) as c:
        nodes = c.stats().nodes
    writes = {name: s.get("kv_writes") for name, s in nodes.items() if s.get("role") == "prefill"}
    print(json.dumps({"rows": rows, "kv_writes": writes}), flush=True)


BURST = "256kb"


def shape_link(hosts, name: str, rate_mbit: float, burst: str = BURST) -> None:
    """What leaves host `name` goes at rate_mbit (a token bucket of `burst`, 100 ms of queue).
    NOTE: a bucket smaller than a 64 KiB GSO packet and its headers makes tbf cut each one
    into 1,500-byte packets in software, a cost per byte on both simulated hosts' CPUs many
    times what a NIC that segments in hardware leaves them (see docs/BENCHMARKS.md)."""
    subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            hosts.ns(name),
            "tc",
            "qdisc",
            "add",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            f"{rate_mbit}mbit",
            "burst",
            burst,
            "latency",
            "100ms",
        ],
        check=True,
        capture_output=True,
    )


ENV = {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "UCX_TLS": "tcp"}


def start_hosts(
    hosts, bench: str, args: list[str], logs: Path, label: str, cpus: dict | None = None
) -> tuple:
    """start_cluster.sh with args on host a (frontend, a prefill node) and on host b (a decode
    node, joining a); -> (host a's launcher, host b's, the client endpoint on a).
    cpus: host -> the CPUs its launcher runs on (taskset -c; default: every CPU)."""
    env = {**os.environ, **ENV}
    cpus = cpus or {}

    def pinned(name: str) -> list[str]:
        return ["taskset", "-c", cpus[name]] if cpus.get(name) else []

    common = [
        "bash",
        str(ROOT / "launch/start_cluster.sh"),
        "--no-keys",
        "--no-http",
        "--base-port",
        "5600",
        *args,
    ]
    first = hosts.popen(
        "a",
        [
            *pinned("a"),
            *common,
            "--host",
            hosts.addr("a"),
            "--name-prefix",
            "a-",
            "--num-prefill",
            "1",
            "--num-decode",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=open(logs / f"a-{label}.log", "wb"),
        cwd=ROOT,
        env=env,
    )
    endpoint = f"tcp://{hosts.addr('a')}:5600"
    if first.stdout.readline().decode().strip() != f"PDSERVE_ENDPOINT={endpoint}":
        raise SystemExit(f"bench {bench}: host a did not start (see {logs}/a-{label}.log)")
    join = f"tcp://{hosts.addr('a')}:5601"
    second = hosts.popen(
        "b",
        [
            *pinned("b"),
            *common,
            "--host",
            hosts.addr("b"),
            "--name-prefix",
            "b-",
            "--join",
            join,
            "--num-prefill",
            "0",
            "--num-decode",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=open(logs / f"b-{label}.log", "wb"),
        cwd=ROOT,
        env=env,
    )
    if second.stdout.readline().decode().strip() != f"PDSERVE_JOINED={join}":
        raise SystemExit(f"bench {bench}: host b did not join (see {logs}/b-{label}.log)")
    return first, second, endpoint


def _run_mode(a, hosts, model: str, mode: str, logs: Path) -> list:
    env = {**os.environ, **ENV}
    first, second, endpoint = start_hosts(
        hosts,
        "layerwise",
        [
            "--model",
            model,
            "--kv-transfer",
            a.kv_transfer,
            a.flag,
            mode,
            "--max-model-len",
            str(max(a.prompt_lens) + 64),
            "--no-prefix-caching",
            *(["--dtype", a.dtype] if a.dtype else []),
            *a.cluster_arg,
        ],
        logs,
        mode,
    )
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    out = hosts.run(
        "a",
        [
            sys.executable,
            "-m",
            "launch.bench.layerwise",
            "--client",
            endpoint,
            "--prompt-lens",
            ",".join(map(str, [64] + a.prompt_lens)),
            "--num-requests",
            str(a.num_requests),
            "--seed",
            str(a.seed),
            "--vocab-size",
            str(vocab),
        ],
        timeout_s=1800,
        cwd=ROOT,
        env=env,
    )
    for p in (second, first):  # SIGTERM: each drains and stops
        p.terminate()
        p.wait(60)
    if out.returncode != 0:
        raise SystemExit(f"bench layerwise: the client failed: {out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(
        json.dumps({"bench": "layerwise", "mode": mode, "kv_writes": got["kv_writes"]}), flush=True
    )
    return [r for r in got["rows"] if r[0] != 64]  # 64: warm-up


def default_model() -> str:
    """The 8-layer shape above, made on first use."""
    home = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
    model = str(home / "layerwise-qwen3")
    if not (Path(model) / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "launch.make_tiny_model", model, *SHAPE], check=True, cwd=ROOT
        )
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        "pdserve bench layerwise", description=__doc__, formatter_class=HelpFormat
    )
    p.add_argument(
        "--model", help="a Qwen3 directory (default: the 8-layer shape above, made once)"
    )
    p.add_argument("--rate-mbit", type=float, default=200.0, help="host a's link rate")
    p.add_argument("--burst", default=BURST, help="the link's token bucket (tc tbf burst)")
    p.add_argument(
        "--prompt-lens",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[256, 1024, 2048],
        help="comma-separated: one run each",
    )
    p.add_argument("--num-requests", type=int, default=5, help="per prompt length and mode")
    p.add_argument("--kv-transfer", default="tcp", help="the backend between the hosts")
    p.add_argument("--flag", default="--kv-layerwise", help="the prefill node flag the modes set")
    p.add_argument("--modes", default="off,on", help="--flag's values, in order")
    p.add_argument("--seed", type=int, default=0, help="of the prompts")
    p.add_argument("--dtype", help="the nodes' --dtype (default: the CPU's, float32)")
    p.add_argument(
        "--cluster-arg",
        action="append",
        default=[],
        help="passed to start_cluster.sh on both hosts (repeat: --cluster-arg=--prefill-arg ...)",
    )
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--vocab-size", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.client:
        _client(a.client, a.prompt_lens, a.num_requests, a.seed, a.vocab_size)
        return 0
    from launch.tools import netns

    why = netns.why_not()
    if why:
        raise SystemExit(f"bench layerwise: {why}")
    model = a.model or default_model()
    # NOTE: a name no one can take first (run as root; the logs are opened for writing)
    logs = Path(tempfile.mkdtemp(prefix="bench-layerwise-"))
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    # a CPU node's default: fp32
    dtype_bytes = DTYPES[a.dtype].itemsize if a.dtype in DTYPES else 4
    kv_bytes_per_token = (
        cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    )
    medians: dict[str, dict[int, tuple[float, float]]] = {}
    for mode in a.modes.split(","):
        with netns.Hosts(["a", "b"]) as hosts:
            shape_link(hosts, "a", a.rate_mbit, a.burst)
            rows = _run_mode(a, hosts, model, mode, logs)
        medians[mode] = {}
        for n in a.prompt_lens:
            firsts = [r[1] for r in rows if r[0] == n]
            seconds = [r[2] for r in rows if r[0] == n]
            medians[mode][n] = (statistics.median(firsts), statistics.median(seconds))
            transfer_ms = n * kv_bytes_per_token * 8 / (a.rate_mbit * 1e6) * 1e3
            print(
                json.dumps(
                    {
                        "bench": "layerwise",
                        "device": "cpu",
                        "mode": mode,
                        "prompt_len": n,
                        "rate_mbit": a.rate_mbit,
                        "burst": a.burst,
                        "kv_transfer": a.kv_transfer,
                        "num_requests": len(firsts),
                        "first_token_ms_p50": round(1e3 * medians[mode][n][0], 1),
                        "second_token_ms_p50": round(1e3 * medians[mode][n][1], 1),
                        # the bound: the prefill (its first token) or the KV at the link's rate
                        "transfer_ms_at_link_rate": round(transfer_ms, 1),
                        "bound_second_token_ms": round(
                            max(1e3 * medians[mode][n][0], transfer_ms), 1
                        ),
                        "first_token_ms": [round(1e3 * x, 1) for x in firsts],
                        "second_token_ms": [round(1e3 * x, 1) for x in seconds],
                        # per request, where its link could carry int8: format: why
                        "kv_wire": dict(Counter(r[3] for r in rows if r[0] == n and r[3])),
                    }
                ),
                flush=True,
            )
    modes = a.modes.split(",")
    if len(modes) > 1:
        last, first = modes[-1], modes[0]
        ratios = {
            n: {
                "first_token": round(medians[last][n][0] / medians[first][n][0], 3),
                "second_token": round(medians[last][n][1] / medians[first][n][1], 3),
            }
            for n in a.prompt_lens
        }
        print(
            json.dumps(
                {
                    "bench": "layerwise",
                    "flag": a.flag,
                    f"ratios_{last}_{first}": ratios,
                    "logs": str(logs),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
