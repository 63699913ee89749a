"""The load a serving benchmark offers: the requests (random ids or a JSONL dataset), one
request over ZeroMQ or through the OpenAI API as a client sees it (an Outcome: when each
chunk came), and a rate's Poisson arrivals at most --max-concurrency in flight."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from frontend.client import AsyncClient
from launch.bench.report import PARTS, Outcome


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
