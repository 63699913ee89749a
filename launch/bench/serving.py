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
from contextlib import asynccontextmanager
from pathlib import Path

from common.runtime.process import HelpFormat
from frontend.client import AsyncClient
from launch.bench.load import HttpTarget, make_jobs, run_rate
from launch.bench.report import Outcome, cluster_record, plot, samples, summarize, table_of
from launch.bench.table import show


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
