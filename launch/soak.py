"""Soak: a cluster under steady mixed load for a while, its memory watched.

    python -m launch.soak [--duration 600] [--concurrency 24] [--model DIR] [--base-port 5700]
                          [--cluster-arg ARG]...

Starts launch/start_cluster.sh (CURVE keys, restarts on; --cluster-arg adds
options, e.g. two nodes of each role and a decode KV budget small enough to
preempt), then keeps --concurrency streams going: most finish by length, some
share a prefix with others, some ask for far more tokens than they read (the
client aborts them: what preemption admits for), some are aborted mid-stream,
some hit short deadlines, some are invalid, and stats calls run beside them.
Every 30 s a JSON line gives each process's resident memory; the last line sums
up: outcomes by kind, unexpected errors, memory growth per process (from the
first sample after warm-up), and whether every KV block came back. Exits 1 on an
unexpected error or a leaked block.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from common.process import HelpFormat
from frontend.client import AsyncClient, Client

ROOT = Path(__file__).resolve().parents[1]
COUNTED = ("num_preemptions", "num_swapped", "num_recomputed", "num_prefix_hit_tokens",
           "num_prefix_evictions", "num_handoffs", "num_failed")   # summed over the nodes in the summary


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _pids(endpoint: str) -> dict[str, int]:
    with Client(endpoint) as c:
        s = c.stats()
    return {"frontend": s.frontend["pid"], **{n: v["pid"] for n, v in s.nodes.items()}}


async def _one(client: AsyncClient, rng: random.Random, vocab: int, max_model_len: int,
               outcomes: Counter) -> None:
    kind = rng.choices(["length", "shared", "long", "abort", "deadline", "invalid"],
                       [50, 15, 10, 12, 5, 8])[0]
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 120))]
    if kind == "shared":   # one of a few long prefixes: prefix caching and cache-aware routing
        prefix = random.Random(rng.randrange(4)).choices(range(vocab), k=96)
        prompt, kind = prefix + prompt[:rng.randint(1, 24)], "length"
    if kind == "invalid":
        r = await client.complete(prompt_token_ids=prompt, max_tokens=rng.choice([0, 10**9]))
        outcomes["invalid" if r.finish_reason == "error" else "unexpected"] += 1
        return
    max_tokens, read_len = rng.randint(8, 96), 4
    if kind == "long":
        max_tokens, read_len, kind = max_model_len - len(prompt), rng.randint(8, 96), "abort"
    timeout = 0.3 if kind == "deadline" else None
    rid, n = f"soak-{rng.getrandbits(48):x}", 0
    async for out in client.generate(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                                     timeout_s=timeout, request_id=rid):
        n += len(out.token_ids)
        if kind == "abort" and n >= read_len and not out.is_finished:
            await client.abort(rid)
            kind = "aborted"
        if out.is_finished:
            # An abort or a deadline may lose the race with the last token.
            expected = {"length": ("length",), "abort": ("length",), "aborted": ("abort", "length"),
                        "deadline": ("abort", "length")}[kind]
            ok = out.finish_reason in expected
            outcomes[out.finish_reason if ok else f"unexpected {out.finish_reason}: {out.error}"] += 1


async def _load(endpoint: str, duration_s: float, concurrency: int, model: dict, pids: dict,
                outcomes: Counter) -> list[dict]:
    samples: list[dict] = []
    end = time.monotonic() + duration_s
    async with AsyncClient(endpoint, idle_timeout_s=60) as client:
        async def worker(i: int) -> None:
            local = random.Random(i)
            while time.monotonic() < end:
                try:
                    await _one(client, local, model["vocab_size"], model["max_model_len"], outcomes)
                except Exception as e:  # noqa: BLE001 - counted and reported, the soak goes on
                    outcomes[f"unexpected {type(e).__name__}: {e}"] += 1

        async def sampler() -> None:
            while time.monotonic() < end:
                await client.stats()
                sample = {"t_s": round(duration_s - (end - time.monotonic()), 1),
                          "rss_mb": {n: _rss_mb(p) for n, p in pids.items()},
                          "outcomes": dict(outcomes)}
                samples.append(sample)
                print(json.dumps(sample), flush=True)
                await asyncio.sleep(30)
        await asyncio.gather(sampler(), *(worker(i) for i in range(concurrency)))
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.soak", description=__doc__,
                                formatter_class=HelpFormat)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--model", default=None, help="default: the tiny model start_cluster makes")
    p.add_argument("--base-port", type=int, default=5700)
    p.add_argument("--cluster-arg", action="append", default=[], metavar="ARG",
                   help="passed on to start_cluster.sh, e.g. --cluster-arg=--num-decode --cluster-arg=2")
    a = p.parse_args(argv)
    cmd = ["bash", str(ROOT / "launch/start_cluster.sh"), "--base-port", str(a.base_port),
           "--max-batch-size", "32", *(["--model", a.model] if a.model else []), *a.cluster_arg]
    cluster = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True)
    try:
        line = cluster.stdout.readline().decode()
        if not line.startswith("PDSERVE_ENDPOINT="):
            print("soak: the cluster did not start", file=sys.stderr)
            return 1
        endpoint = line.strip().split("=", 1)[1]
        with Client(endpoint) as c:
            stats = c.stats()
        # A long request asks for all a decode node could ever hold: more is refused.
        model = {**stats.model, "max_model_len": min(
            [stats.model["max_model_len"]] + [n["token_capacity"] for n in stats.nodes.values()
                                              if n["role"] == "decode"])}
        pids = _pids(endpoint)
        outcomes: Counter = Counter()
        samples = asyncio.run(_load(endpoint, a.duration, a.concurrency, model, pids, outcomes))
        time.sleep(3)   # the last aborts and deadlines reach the nodes
        with Client(endpoint) as c:
            nodes = c.stats().nodes
        is_free = all(n["num_free_blocks"] == n["num_usable_blocks"] and not n.get("num_reserved_blocks")
                      and not n.get("swapped_bytes") and not n.get("num_preempted") for n in nodes.values())
        first = samples[1] if len(samples) > 1 else samples[0]   # after the first 30 s of warm-up
        final = {n: _rss_mb(pid) for n, pid in pids.items()}
        unexpected = {k: v for k, v in outcomes.items() if k.startswith("unexpected")}
        counts = {k: sum(n.get(k, 0) for n in nodes.values()) for k in COUNTED}
        print(json.dumps({"summary": True, "duration_s": a.duration, "concurrency": a.concurrency,
                          "outcomes": dict(outcomes), "nodes": counts,
                          "num_unexpected": sum(unexpected.values()),
                          "rss_mb_first": first["rss_mb"], "rss_mb_last": final,
                          "rss_growth_mb": {n: round(final[n] - first["rss_mb"][n], 1)
                                            for n in final if final[n] and first["rss_mb"].get(n)},
                          "is_every_block_free": is_free}), flush=True)
        return 0 if is_free and not unexpected else 1
    finally:
        if cluster.poll() is None:
            os.killpg(cluster.pid, signal.SIGTERM)
            cluster.wait(60)


if __name__ == "__main__":
    sys.exit(main())
