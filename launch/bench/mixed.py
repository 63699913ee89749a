"""A mixed load (long prompts and short ones) across two simulated hosts on a shaped link,
with each --disaggregate mode: the short prompts' time to first token and the long
ones' time per output token; and whether every request's (greedy) tokens are the same in each mode.

    python -m launch.bench.mixed [--model DIR] [--rate-mbit 200] [--long-len 2048]
        [--short-len 32] [--duration 20] [--long-every 2] [--short-every 0.25]
        [--modes always,auto] [--runs 1] [--kv-layerwise auto] [--cores shared|split]   (root)

Host a runs the frontend and a prefill node, host b a decode node (as `pdserve bench
layerwise`: start_cluster.sh on each, b joining a, host a's link shaped with tc tbf).
For each mode the cluster is started fresh and warmed (a few requests of each kind, so
the rates are measured), then for --duration seconds a long prompt arrives every
--long-every seconds and a short one every --short-every, each prompt fresh (no prefix
cache hits), streaming. One JSON line per mode (TTFT p50/p90 of the short prompts and of
their second token, TPOT p50/p90 of the long ones, the paths taken), then the ratios (each
mode over the first): the short prompts should not wait behind the long ones' prefill and
KV, nor the long ones pay for it. With --runs N the modes alternate N times (a fresh
cluster each), each pair's ratios printed, then one line of each figure's median over the
runs, the medians' ratios and the range of the runs' own ratios: where two modes take the
same paths, that range is what one pair of runs can show on this host. The bound for a
short prompt's TTFT is its own prefill on an idle node. Without --model, the 8-layer shape
of `pdserve bench layerwise` (made once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common.runtime.process import HelpFormat
from launch.bench import layerwise

ROOT = Path(__file__).resolve().parents[2]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else float("nan")


def _parts_p50(rows: list[dict]) -> dict:
    names = sorted({k for r in rows for k in r.get("parts", {})})
    return {
        k: round(statistics.median(r["parts"][k] for r in rows if k in r["parts"]), 1)
        for k in names
    }


def _client(endpoint: str, a) -> None:
    """Run on host a: warm up, then the timed mixed load; one JSON line of every request."""
    import numpy as np

    from frontend.client import AsyncClient, Client

    rng = np.random.default_rng(a.seed)

    def prompt(n: int) -> list[int]:
        return rng.integers(1, a.vocab_size - 1, size=n).tolist()

    async def one(
        client, kind: str, prompt_ids: list[int], max_tokens: int, at: float, rows: list, i: int
    ) -> None:
        await asyncio.sleep(max(at - time.monotonic(), 0))
        start, stamps, last, tokens, first = time.monotonic(), [], None, [], None
        async for out in client.generate(
            prompt_token_ids=prompt_ids, max_tokens=max_tokens, ignore_eos=True
        ):
            if out.error:
                raise SystemExit(f"bench mixed: a request failed: {out.error}")
            stamps += [time.monotonic() - start] * len(out.token_ids)
            tokens += out.token_ids
            last, first = out, first or out.timings
        rows.append(
            {
                "i": i,
                "kind": kind,
                "ttft_s": stamps[0],
                "second_s": stamps[1],
                "tpot_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1),
                "steady_tpot_s": (stamps[-1] - stamps[1]) / max(len(stamps) - 2, 1),
                # the longest wait between two of its decoded tokens (a stall behind a prefill
                # pass; the first to the second is the handoff's), None with fewer than two
                "max_gap_s": max(np.diff(stamps[1:]), default=None),
                "path": (last.timings or {}).get("path"),
                "tokens": tokens,
                "parts": {k: v for k, v in (first or {}).items() if k.endswith("_ms")},
            }
        )

    # Every prompt made before any is sent: the same ones, in the same places, in each mode.
    warm = [prompt(n) for _ in range(3) for n in (a.long_len, a.short_len)]
    plan = [
        ("long", prompt(a.long_len), a.long_tokens, i * a.long_every)
        for i in range(int(a.duration / a.long_every))
    ]
    plan += [
        ("short", prompt(a.short_len), a.short_tokens, a.short_every / 2 + i * a.short_every)
        for i in range(int(a.duration / a.short_every))
    ]

    async def run() -> list:
        async with AsyncClient(endpoint, idle_timeout_s=300) as client:
            for i, p in enumerate(warm):  # rates, the handoff's cost, the kernels' first calls
                await one(client, "warm", p, 4, 0, [], i)
            await asyncio.sleep(2.5)  # a heartbeat or two: the frontend has the nodes' rates
            rows: list = []
            t0 = time.monotonic() + 0.1
            await asyncio.gather(
                *[
                    one(client, kind, ids, n, t0 + at, rows, i)
                    for i, (kind, ids, n, at) in enumerate(plan)
                ]
            )
            return rows

    rows = asyncio.run(run())
    with Client(endpoint) as c:
        paths = c.stats().frontend.get("paths")
    print(json.dumps({"rows": rows, "paths": paths}), flush=True)


def split_cpus(cpus: list[int]) -> dict[str, str]:
    """Host a's CPUs and host b's for --cores split: each half of these, b the larger."""
    if len(cpus) < 2:
        raise SystemExit("bench mixed: --cores split needs at least 2 CPUs")
    half = len(cpus) // 2
    return {"a": ",".join(map(str, cpus[:half])), "b": ",".join(map(str, cpus[half:]))}


def _run_mode(a, hosts, model: str, mode: str, logs: Path, label: str) -> dict:
    env = {**os.environ, **layerwise.ENV}
    cpus = split_cpus(sorted(os.sched_getaffinity(0))) if a.cores == "split" else {}
    first, second, endpoint = layerwise.start_hosts(
        hosts,
        "mixed",
        [
            "--model",
            model,
            "--kv-transfer",
            a.kv_transfer,
            "--kv-layerwise",
            a.kv_layerwise,
            "--disaggregate",
            mode,
            "--max-model-len",
            str(a.long_len + a.long_tokens + 64),
            "--no-prefix-caching",
            *a.cluster_arg,
        ],
        logs,
        label,
        cpus,
    )
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    args = ["--client", endpoint, "--vocab-size", str(vocab), "--seed", str(a.seed)]
    for k in (
        "long_len",
        "short_len",
        "long_tokens",
        "short_tokens",
        "duration",
        "long_every",
        "short_every",
    ):
        args += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    pin = ["taskset", "-c", cpus["a"]] if cpus else []
    out = hosts.run(
        "a",
        [*pin, sys.executable, "-m", "launch.bench.mixed", *args],
        timeout_s=1800,
        cwd=ROOT,
        env=env,
    )
    for p in (second, first):  # SIGTERM: each drains and stops
        p.terminate()
        p.wait(60)
    if out.returncode != 0:
        raise SystemExit(f"bench mixed: the client failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        "pdserve bench mixed", description=__doc__, formatter_class=HelpFormat
    )
    p.add_argument(
        "--model", help="a Qwen3 directory (default: bench layerwise's 8-layer shape, made once)"
    )
    p.add_argument("--rate-mbit", type=float, default=200.0, help="host a's link rate")
    p.add_argument(
        "--burst", default=layerwise.BURST, help="the link's token bucket (tc tbf burst)"
    )
    p.add_argument("--long-len", type=int, default=2048, help="tokens of a long prompt")
    p.add_argument("--long-tokens", type=int, default=64, help="max_tokens of a long prompt")
    p.add_argument("--short-len", type=int, default=32, help="tokens of a short prompt")
    p.add_argument("--short-tokens", type=int, default=16, help="max_tokens of a short prompt")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per mode")
    p.add_argument("--long-every", type=float, default=2.0, help="seconds between long prompts")
    p.add_argument("--short-every", type=float, default=0.25, help="seconds between short prompts")
    p.add_argument("--modes", default="always,auto", help="--disaggregate values, in order")
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="the modes this many times, alternating; then each figure's median over the runs",
    )
    p.add_argument("--kv-layerwise", default="auto", help="on both hosts")
    p.add_argument("--kv-transfer", default="tcp", help="the backend between the hosts")
    p.add_argument("--seed", type=int, default=0, help="of the prompts and arrivals")
    p.add_argument(
        "--cores",
        choices=("shared", "split"),
        default="shared",
        help="shared: both hosts' launchers run on (and budget) every CPU; split: each host on "
        "half of them (taskset), as two machines would be",
    )
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
        _client(a.client, a)
        return 0
    if a.runs < 1:
        p.error("--runs takes 1 or more")
    from launch.tools import netns

    why = netns.why_not()
    if why:
        raise SystemExit(f"bench mixed: {why}")
    model = a.model or layerwise.default_model()
    # NOTE: a name no one can take first (run as root; the logs are opened for writing)
    logs = Path(tempfile.mkdtemp(prefix="bench-mixed-"))
    modes = _labels(a.modes.split(","))
    runs: list[dict] = []  # per run: label -> its figures
    tokens: dict = {}
    for run in range(a.runs):
        figures = {}
        for label, mode in modes.items():  # NOTE: alternating: a host's drift hits each mode
            name = label if a.runs == 1 else f"{label}-{run}"  # its logs' and figures' files
            figures[label], tokens[label] = _measure(a, model, mode, logs, run, name)
        runs.append(figures)
        if len(modes) > 1:
            _print_ratios(list(modes), figures, tokens, logs, run)
    if a.runs > 1:
        _print_medians(list(modes), runs)
    return 0


def _labels(modes: list[str]) -> dict[str, str]:
    """label -> mode: a mode named again is labelled by its place (`always,always`: always,
    always#2), so an A/A pair keeps both runs' figures."""
    out: dict[str, str] = {}
    for mode in modes:
        label, k = mode, 1
        while label in out:
            k += 1
            label = f"{mode}#{k}"
        out[label] = mode
    return out


def _measure(a, model: str, mode: str, logs: Path, run: int, name: str) -> tuple[dict, dict]:
    """One fresh cluster in this mode: its figures (one JSON line printed) and each
    request's tokens. name: of its files in logs (its hosts' logs, each request's figures)."""
    from launch.tools import netns

    with netns.Hosts(["a", "b"]) as hosts:
        layerwise.shape_link(hosts, "a", a.rate_mbit, a.burst)
        got = _run_mode(a, hosts, model, mode, logs, name)
    (logs / f"{name}-requests.json").write_text(json.dumps(got["rows"]))  # each request's
    short = [r for r in got["rows"] if r["kind"] == "short"]
    gaps = [r["max_gap_s"] for r in got["rows"] if r["max_gap_s"] is not None]
    long = [r for r in got["rows"] if r["kind"] == "long"]
    f = {
        "short_ttft_ms_p50": round(1e3 * statistics.median(r["ttft_s"] for r in short), 1),
        "short_ttft_ms_p90": round(1e3 * _pct([r["ttft_s"] for r in short], 0.9), 1),
        # the first token decoded: behind the handoff (its reservation, KV and commit)
        "short_second_ms_p50": round(1e3 * statistics.median(r["second_s"] for r in short), 1),
        "short_second_ms_p90": round(1e3 * _pct([r["second_s"] for r in short], 0.9), 1),
        "long_tpot_ms_p50": round(1e3 * statistics.median(r["tpot_s"] for r in long), 2),
        "long_tpot_ms_p90": round(1e3 * _pct([r["tpot_s"] for r in long], 0.9), 2),
        "long_ttft_ms_p50": round(1e3 * statistics.median(r["ttft_s"] for r in long), 1),
        # of the long ones' TPOT: the handoff (first token to second) and the decode steps
        # after it
        "long_handoff_ms_p50": round(
            1e3 * statistics.median(r["second_s"] - r["ttft_s"] for r in long), 1
        ),
        "long_steady_tpot_ms_p90": round(1e3 * _pct([r["steady_tpot_s"] for r in long], 0.9), 2),
        # every request's longest wait between two decoded tokens, at p90
        "max_gap_ms_p90": round(1e3 * _pct(gaps, 0.9), 1) if gaps else None,
    }

    def by_path(rows: list, fn) -> dict:
        return {
            p: fn([r for r in rows if r["path"] == p])
            for p in ("local", "disaggregated")
            if any(r["path"] == p for r in rows)
        }

    record = {
        "bench": "mixed",
        "device": "cpu",
        "mode": mode,
        "run": run,
        "rate_mbit": a.rate_mbit,
        "burst": a.burst,
        "kv_transfer": a.kv_transfer,
        "kv_layerwise": a.kv_layerwise,
        "cores": a.cores,
        "long": [a.long_len, a.long_tokens, a.long_every],
        "short": [a.short_len, a.short_tokens, a.short_every],
        "num_short": len(short),
        "num_long": len(long),
        **f,
        "short_paths": {p: sum(r["path"] == p for r in short) for p in ("local", "disaggregated")},
        # each path's own short TTFT p50 (what a prompt there waited), where any took it
        "short_ttft_ms_p50_by_path": by_path(
            short, lambda rows: round(1e3 * statistics.median(r["ttft_s"] for r in rows), 1)
        ),
        # where that time went: each stage's p50 (the first update's timings)
        "short_parts_ms_p50_by_path": by_path(short, _parts_p50),
        "long_paths": {p: sum(r["path"] == p for r in long) for p in ("local", "disaggregated")},
        "decisions": (got.get("paths") or {}).get("decisions"),
    }
    print(json.dumps(record), flush=True)
    return f, {r["i"]: r["tokens"] for r in got["rows"]}


def _ratios(modes: list[str], figures: dict) -> dict:
    """Each mode's figures over the first mode's."""
    base = figures[modes[0]]
    return {
        m: {
            k: round(v / base[k], 3) if base[k] and v is not None else None
            for k, v in figures[m].items()
        }
        for m in modes[1:]
    }


def _print_ratios(modes: list[str], figures: dict, tokens: dict, logs: Path, run: int) -> None:
    # Greedy: each request's tokens the same whichever path it took.
    same = {m: tokens[m] == tokens[modes[0]] for m in modes[1:]}
    print(
        json.dumps(
            {
                "bench": "mixed",
                "run": run,
                "against": modes[0],
                "tokens_equal": same,
                "ratios": _ratios(modes, figures),
                "logs": str(logs),
            }
        ),
        flush=True,
    )


def _print_medians(modes: list[str], runs: list[dict]) -> None:
    """Over the runs: each mode's median figures (None where a run lacks the figure), their
    ratios, and the range of each run's own ratios, a figure left out there where a run has
    no ratio for it (how far one pair of runs can be trusted on this host)."""
    medians = {
        m: {
            k: round(statistics.median(r[m][k] for r in runs), 3)
            if all(r[m][k] is not None for r in runs)
            else None
            for k in runs[0][m]
        }
        for m in modes
    }
    each = [_ratios(modes, r) for r in runs] if len(modes) > 1 else []
    spread = (
        {
            m: {
                k: [min(e[m][k] for e in each), max(e[m][k] for e in each)]
                for k in each[0][m]
                if all(e[m][k] is not None for e in each)
            }
            for m in modes[1:]
        }
        if each
        else {}
    )
    out = {"bench": "mixed", "runs": len(runs), "medians": medians}
    if len(modes) > 1:
        out |= {"against": modes[0], "ratios": _ratios(modes, medians), "run_ratios": spread}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
