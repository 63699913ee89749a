"""End-to-end serving benchmark against a running cluster, as a user measures it:
requests arrive at a rate, and what counts is what the client sees.

    python -m launch.bench_serving --endpoint tcp://127.0.0.1:5600 --input-len 1024 \
        --output-len 128 --num-prompts 200 --request-rate 8,16,24,inf [--slo ttft_ms=500,tpot_ms=20]

Workloads: random token ids (--input-len / --output-len, spread by --range-ratio)
or a JSONL file of {"prompt": str} or {"prompt_token_ids": [...]} lines, each with
an optional "output_len". Arrivals: Poisson at each --request-rate (inf: all at
once), at most --max-concurrency in flight. One JSON line per rate: request and
token throughput; mean / median / p90 / p99 of TTFT, TPOT, ITL and end-to-end
latency (ms); goodput under --slo; errors; and the medians of the cluster's own
TTFT parts (queue, prefill, KV transfer, decode admission).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from frontend.client import AsyncClient

PARTS = ("queue_ms", "prefill_ms", "kv_transfer_ms", "kv_write_ms", "kv_commit_ms",
         "decode_admission_ms")


@dataclass
class Job:
    prompt: str | None
    prompt_token_ids: list[int] | None
    output_len: int


@dataclass
class Outcome:
    input_len: int
    sent_at: float
    chunk_at: list[float] = field(default_factory=list)   # arrival of each output carrying tokens
    num_tokens: int = 0
    ended_at: float = 0.0
    error: str | None = None
    parts: dict = field(default_factory=dict)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_at[0] - self.sent_at if self.chunk_at else None

    @property
    def tpot_s(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.chunk_at[-1] - self.chunk_at[0]) / (self.num_tokens - 1)


def make_jobs(a: argparse.Namespace, vocab_size: int, rng: random.Random) -> list[Job]:
    if a.dataset:
        jobs = []
        for line in Path(a.dataset).read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                jobs.append(Job(d.get("prompt"), d.get("prompt_token_ids"),
                                int(d.get("output_len", a.output_len))))
        if not jobs:
            raise SystemExit(f"bench_serving: {a.dataset} holds no prompts")
        return [jobs[i % len(jobs)] for i in range(a.num_prompts)]

    def spread(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - a.range_ratio)), int(n * (1 + a.range_ratio))))
    return [Job(None, [rng.randrange(vocab_size) for _ in range(spread(a.input_len))], spread(a.output_len))
            for _ in range(a.num_prompts)]


async def one(client: AsyncClient, job: Job, ignore_eos: bool) -> Outcome:
    out = Outcome(len(job.prompt_token_ids or ()), time.perf_counter())
    try:
        async for o in client.generate(job.prompt, prompt_token_ids=job.prompt_token_ids,
                                       max_tokens=job.output_len, ignore_eos=ignore_eos,
                                       request_id=uuid.uuid4().hex):
            if o.token_ids:
                out.chunk_at.append(time.perf_counter())
                out.num_tokens += len(o.token_ids)
            if o.timings:
                out.parts.update({k: o.timings[k] for k in PARTS if o.timings.get(k) is not None})
            if o.is_finished:
                if o.finish_reason == "error" or (o.finish_reason == "abort" and o.error):
                    out.error = o.error or o.finish_reason
                if o.usage:
                    out.input_len = o.usage.get("prompt_tokens", out.input_len)
    except Exception as e:  # a timeout or a dropped connection counts as an error, not a crash
        out.error = f"{type(e).__name__}: {e}"
    out.ended_at = time.perf_counter()
    return out


async def run_rate(client: AsyncClient, jobs: list[Job], rate: float, max_concurrency: int | None,
                   ignore_eos: bool, rng: random.Random, show: bool) -> tuple[list[Outcome], float]:
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    done = 0

    async def gated(job: Job) -> Outcome:
        nonlocal done
        if gate is None:
            result = await one(client, job, ignore_eos)
        else:
            async with gate:
                result = await one(client, job, ignore_eos)
        done += 1
        if show:
            print(f"\r  rate {rate:g}: {done}/{len(jobs)} done", end="", file=sys.stderr, flush=True)
        return result

    start = time.perf_counter()
    tasks = []
    for job in jobs:
        tasks.append(asyncio.create_task(gated(job)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    outcomes = await asyncio.gather(*tasks)
    if show:
        print(file=sys.stderr)
    return outcomes, time.perf_counter() - start


def _dist(values_s: list[float]) -> dict:
    """mean / median / p90 / p99 in milliseconds."""
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    v = sorted(x * 1e3 for x in values_s)

    def pct(p: float) -> float:
        return round(v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))], 3)
    return {"mean": round(statistics.fmean(v), 3), "median": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(outcomes: list[Outcome], duration_s: float, rate: float, slo: dict) -> dict:
    ok = [o for o in outcomes if o.error is None]
    num_out = sum(o.num_tokens for o in ok)
    num_in = sum(o.input_len for o in ok)
    itl = [b - a for o in ok for a, b in zip(o.chunk_at, o.chunk_at[1:])]

    def meets(o: Outcome) -> bool:
        return (o.ttft_s is not None and o.ttft_s * 1e3 <= slo.get("ttft_ms", float("inf"))
                and (o.tpot_s is None or o.tpot_s * 1e3 <= slo.get("tpot_ms", float("inf")))
                and (o.ended_at - o.sent_at) * 1e3 <= slo.get("e2e_ms", float("inf")))
    parts = {p: statistics.median(vals) if (vals := [o.parts[p] for o in ok if p in o.parts]) else None
             for p in PARTS}
    errors = sorted({o.error for o in outcomes if o.error})
    return {
        "request_rate": "inf" if rate == float("inf") else rate, "num_requests": len(outcomes),
        "completed": len(ok), "errors": len(outcomes) - len(ok), "error_kinds": errors[:5],
        "duration_s": round(duration_s, 3),
        "request_throughput": round(len(ok) / duration_s, 3),
        "output_tokens_per_s": round(num_out / duration_s, 1),
        "total_tokens_per_s": round((num_in + num_out) / duration_s, 1),
        "goodput": round(sum(meets(o) for o in ok) / duration_s, 3) if slo else None,
        "slo": slo or None,
        "ttft_ms": _dist([o.ttft_s for o in ok if o.ttft_s is not None]),
        "tpot_ms": _dist([o.tpot_s for o in ok if o.tpot_s is not None]),
        "itl_ms": _dist(itl),
        "e2e_ms": _dist([o.ended_at - o.sent_at for o in ok]),
        "cluster_ttft_parts_median_ms": parts,
    }


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates are numbers or inf, comma-separated: {text!r}") from None
    if any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError("every request rate must be > 0")
    return rates


def parse_slo(text: str) -> dict:
    slo = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in ("ttft_ms", "tpot_ms", "e2e_ms") or not value:
            raise argparse.ArgumentTypeError(f"--slo takes ttft_ms=, tpot_ms=, e2e_ms=; got {item!r}")
        slo[key] = float(value)
    return slo


async def main_async(a: argparse.Namespace) -> list[dict]:
    async with AsyncClient(a.endpoint, idle_timeout_s=a.request_timeout) as client:
        stats = await client.stats(timeout_s=10)
        if not stats.is_ready:
            raise SystemExit(f"bench_serving: the cluster at {a.endpoint} has no live prefill/decode pair")
        model = stats.model or {}
        rng = random.Random(a.seed)
        jobs = make_jobs(a, int(model.get("vocab_size") or 1000), rng)
        nodes = {n: (s.get("role"), s.get("device"), s.get("kv_transfer")) for n, s in stats.nodes.items()
                 if s.get("is_alive")}
        if a.num_warmup:
            await run_rate(client, jobs[: a.num_warmup], float("inf"), None, a.ignore_eos, rng, False)
        records = []
        for rate in a.request_rate:
            outcomes, duration = await run_rate(client, jobs, rate, a.max_concurrency, a.ignore_eos,
                                                rng, not a.quiet)
            record = {"bench": "serving", "target": a.endpoint, "model": model.get("name"),
                      "nodes": nodes, "input_len": a.input_len if not a.dataset else None,
                      "output_len": a.output_len, "max_concurrency": a.max_concurrency,
                      **summarize(outcomes, duration, rate, a.slo)}
            print(json.dumps(record), flush=True)
            records.append(record)
        return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.bench_serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5600", help="the cluster's client endpoint")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths spread by ± this fraction")
    p.add_argument("--dataset", default=None, help="a JSONL file of prompts instead of random ids")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    p.add_argument("--num-warmup", type=int, default=4, help="requests sent (at once) before timing")
    p.add_argument("--request-rate", type=parse_rates, default=[float("inf")],
                   help="requests/s, Poisson arrivals; a comma list sweeps; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the output length (default on)")
    p.add_argument("--slo", type=parse_slo, default={}, help="e.g. ttft_ms=500,tpot_ms=20")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds of silence per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-json", default=None, help="also write every rate's record to this file")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    a = p.parse_args(argv)
    if not 0 <= a.range_ratio < 1 or a.input_len < 1 or a.output_len < 1 or a.num_prompts < 1:
        p.error("need --input-len, --output-len, --num-prompts >= 1 and 0 <= --range-ratio < 1")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    try:
        import uvloop
        records = uvloop.run(main_async(a))
    except ImportError:
        records = asyncio.run(main_async(a))
    if a.save_json:
        Path(a.save_json).write_text(json.dumps(records, indent=1))
    return 1 if any(r["errors"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
