r"""End-to-end serving benchmark against a running cluster, as a user measures it:
requests arrive at a rate, and what counts is what the client sees.

    pdserve bench --endpoint tcp://127.0.0.1:5600 --input-len 1024 --output-len 128 \
        --num-prompts 200 --request-rate 8,16,24,inf [--slo ttft_ms=500,tpot_ms=20] \
        [--save-json out.json] [--plot out.png]
    pdserve bench --base-url http://127.0.0.1:8000 ...     the same through the OpenAI API

Over ZeroMQ (--endpoint) it speaks pdserve's protocol; over HTTP (--base-url) it
streams /v1/completions with server-sent events, as an OpenAI client does, so the
two interfaces can be compared on one cluster.

Workloads: random token ids (--input-len / --output-len, spread by --range-ratio)
or a JSONL file of {"prompt": str} or {"prompt_token_ids": [...]} lines, each with
an optional "output_len". Arrivals: Poisson at each --request-rate (inf: all at
once), at most --max-concurrency in flight. One JSON line per rate on stdout, and a
table of every rate on stderr once the sweep is done: request and
token throughput; mean / median / p90 / p99 of TTFT, TPOT, ITL and end-to-end
latency (ms); goodput under --slo; errors; and the medians of the cluster's own
TTFT parts (queue, prefill, KV transfer, decode admission); the frontend's CPU
time per streamed token (all it did meanwhile, other clients included). Over
ZeroMQ also the mean prefill and decode batches. --plot draws latency against the
achieved rate on a log axis, each point labelled with the rate offered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from common.runtime.process import HelpFormat
from frontend.client import AsyncClient
from launch.bench.report import PARTS, Outcome, cluster_record, plot, samples, summarize, table_of
from launch.bench.table import show


@dataclass
class Job:
    prompt: str | None
    prompt_token_ids: list[int] | None
    output_len: int
    max_tokens: int  # asked for; past output_len, the client stops reading at
    # output_len tokens and the request is aborted there
    extra: dict = field(default_factory=dict)  # --extra: fields added to the request

    def is_read(self, num_tokens: int) -> bool:
        """The client has read what it wants of a request that would go on."""
        return self.max_tokens > self.output_len and num_tokens >= self.output_len


def make_jobs(
    a: argparse.Namespace, vocab_size: int, rng: random.Random, prefix: list[int], num: int
) -> list[Job]:
    """num requests. Random ids are drawn afresh on every call, so no rate of a sweep
    finds the prompts of another in a prefix cache; prefix (--prefix-len) is shared."""
    if a.dataset:
        jobs: list[Job] = []
        for line in Path(a.dataset).read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                n = int(d.get("output_len", a.output_len))
                jobs.append(
                    Job(d.get("prompt"), d.get("prompt_token_ids"), n, max(n, a.max_tokens or 0))
                )
        if not jobs:
            raise SystemExit(f"pdserve bench: {a.dataset} holds no prompts")
        return [Job(**{**vars(jobs[i % len(jobs)]), "extra": a.extra}) for i in range(num)]

    def spread(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - a.range_ratio)), int(n * (1 + a.range_ratio))))

    jobs = []
    for _ in range(num):
        ids, n = (
            prefix + [rng.randrange(vocab_size) for _ in range(spread(a.input_len))],
            spread(a.output_len),
        )
        jobs.append(Job(None, ids, n, max(n, a.max_tokens or 0), a.extra))
    return jobs


async def one(client: AsyncClient, job: Job, ignore_eos: bool) -> Outcome:
    """One request over ZeroMQ."""
    out = Outcome(len(job.prompt_token_ids or ()), time.perf_counter())
    try:
        async for o in client.generate(
            job.prompt,
            prompt_token_ids=job.prompt_token_ids,
            max_tokens=job.max_tokens,
            ignore_eos=ignore_eos,
            request_id=uuid.uuid4().hex,
            **job.extra,
        ):
            if o.token_ids:
                out.chunk_at.append(time.perf_counter())
                out.num_tokens += len(o.token_ids)
                if job.is_read(out.num_tokens):
                    break  # leaving the stream aborts the request on the cluster
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


async def one_http(http: HttpTarget, job: Job, ignore_eos: bool) -> Outcome:
    """One request through the OpenAI API: a streamed /v1/completions."""
    out = Outcome(len(job.prompt_token_ids or ()), time.perf_counter(), interface="http")
    body = {
        "model": http.model,
        "prompt": job.prompt if job.prompt is not None else job.prompt_token_ids,
        "max_tokens": job.max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        **job.extra,
    }
    try:
        async with http.session.post(http.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.json()).get('error', {}).get('message')}"
            else:
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.error = event["error"].get("message")
                    for choice in event.get("choices") or ():
                        if choice.get("token_ids"):
                            out.chunk_at.append(time.perf_counter())
                            out.num_tokens += len(choice["token_ids"])
                    if job.is_read(out.num_tokens):
                        break  # closing the stream aborts the request on the cluster
                    if event.get("usage"):
                        out.input_len = event["usage"].get("prompt_tokens", out.input_len)
                    timings = event.get("timings") or {}
                    out.parts.update({k: timings[k] for k in PARTS if timings.get(k) is not None})
    except Exception as e:  # a timeout or a dropped connection counts as an error, not a crash
        out.error = f"{type(e).__name__}: {e}"
    out.ended_at = time.perf_counter()
    return out


@dataclass
class HttpTarget:
    url: str
    model: str
    session: object  # aiohttp.ClientSession


def _bar(rate: float, done: int, total: int, started: float) -> str:
    width = 30
    filled = int(width * done / total)
    elapsed = time.perf_counter() - started
    return (
        f"\r  rate {rate:g} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {elapsed:6.1f}s"
    )


async def run_rate(
    target,
    jobs: list[Job],
    rate: float,
    max_concurrency: int | None,
    ignore_eos: bool,
    rng: random.Random,
    show: bool,
) -> tuple[list[Outcome], float]:
    """target: an AsyncClient (ZeroMQ) or an HttpTarget."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    send = one_http if isinstance(target, HttpTarget) else one
    done = 0
    started = time.perf_counter()

    async def gated(job: Job) -> Outcome:
        nonlocal done
        if gate is None:
            result = await send(target, job, ignore_eos)
        else:
            async with gate:
                result = await send(target, job, ignore_eos)
        done += 1
        if show:
            print(_bar(rate, done, len(jobs), started), end="", file=sys.stderr, flush=True)
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


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"rates are numbers or inf, comma-separated: {text!r}"
        ) from None
    if any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError("every request rate must be > 0")
    return rates


def parse_slo(text: str) -> dict:
    slo = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in ("ttft_ms", "tpot_ms", "e2e_ms") or not value:
            raise argparse.ArgumentTypeError(
                f"--slo takes ttft_ms=, tpot_ms=, e2e_ms=; got {item!r}"
            )
        slo[key] = float(value)
    return slo


CLUSTER_FIGURES = {
    "num_prefill_tokens": "prefill",
    "num_prefill_passes": "prefill",
    "num_prefill_chunks": "prefill",
    "num_decode_rows": "decode",
    "num_decode_steps": "decode",
    "num_preemptions": "decode",
}


async def cluster_figures(target) -> dict:
    """Running counts summed over the nodes of each role (CLUSTER_FIGURES), from
    heartbeats, once two readings 0.6 s apart agree, and the frontend's CPU seconds.
    Over HTTP only the CPU seconds (process_cpu_seconds_total from /metrics)."""
    if isinstance(target, HttpTarget):
        return {"frontend_cpu_s": await http_cpu_s(target)}

    async def read() -> dict:
        stats = await target.stats(timeout_s=10)
        return {
            k: sum(s.get(k, 0) for s in stats.nodes.values() if s.get("role") == role)
            for k, role in CLUSTER_FIGURES.items()
        }

    last, deadline = await read(), time.monotonic() + 5
    while time.monotonic() < deadline:
        await asyncio.sleep(0.6)  # a heartbeat is 0.5 s
        now = await read()
        if now == last:
            break
        last = now
    return {
        **last,
        "frontend_cpu_s": ((await target.stats(timeout_s=10)).frontend or {}).get("cpu_s"),
    }


async def http_cpu_s(target: HttpTarget) -> float | None:
    """The frontend's process_cpu_seconds_total, as its /metrics says; None if absent."""
    try:
        async with target.session.get(target.url + "/metrics") as r:
            text = await r.text()
    except Exception:  # noqa: BLE001 - a figure, not the benchmark's outcome
        return None
    for line in text.splitlines():
        if line.startswith("process_cpu_seconds_total "):
            return float(line.split()[1])
    return None


@asynccontextmanager
async def open_target(a: argparse.Namespace):
    """(target, model info, live nodes) for the ZeroMQ endpoint or the HTTP base URL."""
    if a.base_url:
        import aiohttp

        url = a.base_url.rstrip("/").removesuffix("/v1")
        timeout = aiohttp.ClientTimeout(total=None, sock_read=a.request_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                async with session.get(url + "/health") as r:
                    if r.status != 200:
                        raise SystemExit(
                            f"pdserve bench: {url}/health says {r.status}: no live "
                            f"prefill/decode pair"
                        )
                async with session.get(url + "/v1/models") as r:
                    card = (await r.json())["data"][0]
            except aiohttp.ClientError as e:
                raise SystemExit(f"pdserve bench: nothing answers at {url}: {e}") from None
            model = {
                "name": card["id"],
                "vocab_size": card.get("vocab_size"),
                "max_model_len": card.get("max_model_len"),
            }
            yield HttpTarget(url, card["id"], session), model, None
        return
    async with AsyncClient(a.endpoint, idle_timeout_s=a.request_timeout) as client:
        try:
            await client.connect()  # NOTE: a few seconds, one line: not a traceback
        except TimeoutError as e:
            raise SystemExit(f"pdserve bench: {e}") from None
        stats = await client.stats(timeout_s=10)
        if not stats.is_ready:
            raise SystemExit(
                f"pdserve bench: the cluster at {a.endpoint} has no live prefill/decode pair"
            )
        nodes = {
            n: (s.get("role"), s.get("device"), s.get("kv_transfer"))
            for n, s in stats.nodes.items()
            if s.get("is_alive")
        }
        yield client, stats.model or {}, nodes


async def main_async(a: argparse.Namespace) -> tuple[list[dict], list[list[Outcome]]]:
    async with open_target(a) as (target, model, nodes):
        max_len = model.get("max_model_len")
        asked = max(a.output_len, a.max_tokens or 0)
        if max_len and not a.dataset and a.prefix_len + a.input_len + asked > max_len:
            raise SystemExit(
                f"pdserve bench: --prefix-len {a.prefix_len} + --input-len "
                f"{a.input_len} + "
                f"{asked} output tokens exceeds the model's max_model_len {max_len}; "
                f"shorten them"
            )
        rng = random.Random(a.seed)
        vocab = int(a.vocab_size or model.get("vocab_size") or 1000)
        prefix = [rng.randrange(vocab) for _ in range(a.prefix_len)]
        if a.num_warmup:  # NOTE: with --prefix-len this also puts the prefix in the cache
            await run_rate(
                target,
                make_jobs(a, vocab, rng, prefix, a.num_warmup),
                float("inf"),
                None,
                a.ignore_eos,
                rng,
                False,
            )
        records, runs = [], []
        for rate in a.request_rate:
            before = await cluster_figures(target)
            outcomes, duration = await run_rate(
                target,
                make_jobs(a, vocab, rng, prefix, a.num_prompts),
                rate,
                a.max_concurrency,
                a.ignore_eos,
                rng,
                not a.quiet,
            )
            cluster = cluster_record(before, await cluster_figures(target), outcomes)
            record = {
                "bench": "serving",
                "interface": "http" if a.base_url else "zmq",
                "target": a.base_url or a.endpoint,
                "model": model.get("name"),
                "nodes": nodes,
                "input_len": a.input_len if not a.dataset else None,
                "prefix_len": a.prefix_len,
                "output_len": a.output_len,
                "max_tokens": a.max_tokens,
                "max_concurrency": a.max_concurrency,
                "extra": a.extra,
                **cluster,
                **summarize(outcomes, duration, rate, a.slo),
            }
            print(json.dumps(record), flush=True)
            records.append(record)
            runs.append(outcomes)
        return records, runs


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object of request fields")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pdserve bench", description=__doc__, formatter_class=HelpFormat
    )
    p.add_argument(
        "--endpoint", default="tcp://127.0.0.1:5600", help="the cluster's ZeroMQ client endpoint"
    )
    p.add_argument(
        "--base-url",
        default=None,
        help="benchmark the OpenAI API at this URL instead (e.g. http://127.0.0.1:8000)",
    )
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens (random ids)")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="draw random ids below this (default: the vocabulary the server reports; "
        "a server that reports none, as vLLM, needs it)",
    )
    p.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="random ids every prompt starts with, before its --input-len own ones "
        "(a shared system prompt: what prefix caching saves)",
    )
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="ask for this many tokens, and stop reading each request after its "
        "--output-len (the request is aborted there): what the decode node must "
        "admit for, against what it generates",
    )
    p.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths spread by ± this fraction"
    )
    p.add_argument("--dataset", default=None, help="a JSONL file of prompts instead of random ids")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    p.add_argument(
        "--num-warmup", type=int, default=4, help="requests sent (at once) before timing"
    )
    p.add_argument(
        "--request-rate",
        type=parse_rates,
        default=[float("inf")],
        help="requests/s, Poisson arrivals; a comma list sweeps; inf sends all at once",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument(
        "--extra",
        type=_json_object,
        default={},
        metavar="JSON",
        help='fields added to every request: over HTTP in OpenAI\'s names ({"logprobs": 5}, '
        '{"response_format": ...}), over ZeroMQ in the protocol\'s (docs/protocol.md)',
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the output length (default on)",
    )
    p.add_argument("--slo", type=parse_slo, default={}, help="e.g. ttft_ms=500,tpot_ms=20")
    p.add_argument(
        "--request-timeout", type=float, default=120.0, help="seconds of silence per request"
    )
    p.add_argument("--seed", type=int, default=0, help="for the prompts and the arrival times")
    p.add_argument("--save-json", default=None, help="also write every rate's record to this file")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="latency against throughput and the TTFT / TPOT distributions (matplotlib)",
    )
    p.add_argument(
        "--replot",
        default=None,
        metavar="FILE.json",
        help="with --plot: draw from a --save-json file instead of running",
    )
    p.add_argument("--quiet", action="store_true", help="no progress line")
    a = p.parse_args(argv)
    if (
        not 0 <= a.range_ratio < 1
        or a.input_len < 1
        or a.output_len < 1
        or a.num_prompts < 1
        or a.prefix_len < 0
        or (a.vocab_size is not None and a.vocab_size < 1)
    ):
        p.error("need --input-len, --output-len, --num-prompts >= 1 and 0 <= --range-ratio < 1")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if a.max_tokens is not None and a.max_tokens < a.output_len:
        p.error("--max-tokens must be >= --output-len")
    if a.plot:
        try:
            import matplotlib  # noqa: F401  (fail before the run, not after it)
        except ImportError:
            p.error(
                f"--plot needs matplotlib, not installed here: {sys.executable} -m pip "
                f"install matplotlib"
            )
    if a.replot:
        if not a.plot:
            p.error("--replot needs --plot FILE.png")
        plot(a.plot, json.loads(Path(a.replot).read_text()))
        print(f"pdserve bench: wrote {a.plot}", file=sys.stderr)
        return 0
    try:
        import uvloop

        records, runs = uvloop.run(main_async(a))
    except ImportError:
        records, runs = asyncio.run(main_async(a))
    # The file also holds each request's TTFT and TPOT, so a plot can be drawn later (--replot).
    records = [{**r, "samples": samples(outcomes)} for r, outcomes in zip(records, runs)]
    show(table_of(records))
    if a.save_json:
        Path(a.save_json).write_text(json.dumps(records, indent=1))
    if a.plot:
        plot(a.plot, records)
        print(f"pdserve bench: wrote {a.plot}", file=sys.stderr)
    return 1 if any(r["errors"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
