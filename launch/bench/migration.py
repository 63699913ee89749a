"""What a decode node's loss costs a loaded cluster: the same closed-loop load twice
on one cluster (start_cluster.sh, one prefill and two decode nodes, restarts on),
undisturbed and with decode-0 SIGKILLed a third of the way in; TTFT and TPOT of
each run, and for the requests that moved, the time they lost.

    python -m launch.bench.migration [--duration 30] [--concurrency 16] [--prompt-len 128]
                                     [--output-len 128] [--model DIR] [--base-port 5800]

One JSON line: both runs' figures, the device, and the bound a moved request's
wait is measured against (the frontend's --dead-after: the silence before a node
counts as dead, which no move can beat; the rest is a prefill of the prompt and
the tokens streamed, and a handoff).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time

from common.runtime.process import HelpFormat
from frontend.client import AsyncClient, Client
from launch.cluster.run import running_cluster

DEAD_AFTER_S = 3.0  # the frontend's default --dead-after


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(int(q * len(values)), len(values) - 1)], 2)


async def _load(endpoint: str, a, vocab: int, kill_pid: int | None) -> dict:
    """Closed loop: a.concurrency streams, each starting a new request when one ends."""
    rows: list[dict] = []
    end = time.monotonic() + a.duration

    async def stream(client: AsyncClient, rng: random.Random) -> None:
        while time.monotonic() < end:
            prompt = [rng.randrange(vocab) for _ in range(a.prompt_len)]
            t0, first, n, last = time.monotonic(), None, 0, None
            async for out in client.generate(
                prompt_token_ids=prompt, max_tokens=a.output_len, ignore_eos=True
            ):
                if out.token_ids and first is None:
                    first = time.monotonic()
                n += len(out.token_ids)
                last = out
            t1 = time.monotonic()
            rows.append(
                {
                    "ttft_ms": (first - t0) * 1e3 if first else None,
                    "tpot_ms": (t1 - first) * 1e3 / (n - 1) if first and n > 1 else None,
                    "is_ok": last.finish_reason == "length",
                    "error": last.error,
                    "num_migrations": (last.timings or {}).get("num_migrations", 0),
                    "migrated_ms": (last.timings or {}).get("migrated_ms"),
                }
            )

    async def killer() -> None:
        if kill_pid is not None:
            await asyncio.sleep(a.duration / 3)
            os.kill(kill_pid, signal.SIGKILL)

    async with AsyncClient(endpoint, idle_timeout_s=120) as client:
        await asyncio.gather(
            killer(), *(stream(client, random.Random(i)) for i in range(a.concurrency))
        )
    moved = [r for r in rows if r["num_migrations"]]
    done = [r for r in rows if r["is_ok"]]
    return {
        "num_requests": len(rows),
        "num_failed": len(rows) - len(done),
        "errors": sorted({r["error"] for r in rows if r["error"]})[:3],
        "req_per_s": round(len(done) / a.duration, 2),
        "ttft_ms_p50": _pct([r["ttft_ms"] for r in done if r["ttft_ms"]], 0.5),
        "ttft_ms_p99": _pct([r["ttft_ms"] for r in done if r["ttft_ms"]], 0.99),
        "tpot_ms_p50": _pct([r["tpot_ms"] for r in done if r["tpot_ms"]], 0.5),
        "tpot_ms_p99": _pct([r["tpot_ms"] for r in done if r["tpot_ms"]], 0.99),
        "num_moved": len(moved),
        "migrated_ms_p50": _pct([r["migrated_ms"] for r in moved], 0.5),
        "migrated_ms_max": _pct([r["migrated_ms"] for r in moved], 1.0),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pdserve bench migration", description=__doc__, formatter_class=HelpFormat
    )
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per run")
    p.add_argument("--concurrency", type=int, default=16, help="streams kept going")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of each prompt")
    p.add_argument("--output-len", type=int, default=128, help="tokens each request generates")
    p.add_argument("--model", default=None, help="default: the tiny model start_cluster makes")
    p.add_argument("--base-port", type=int, default=5800, help="the cluster's base port")
    a = p.parse_args(argv)
    args = [
        "--num-decode",
        "2",
        "--no-http",
        "--base-port",
        str(a.base_port),
        *(["--model", a.model] if a.model else []),
    ]
    with running_cluster(args, "bench_migration") as endpoint:
        if endpoint is None:
            return 1
        with Client(endpoint) as c:
            stats = c.stats()
        vocab = stats.model["vocab_size"]
        undisturbed = asyncio.run(_load(endpoint, a, vocab, None))
        with Client(endpoint) as c:
            victim = c.stats().nodes["decode-0"]["pid"]
        killed = asyncio.run(_load(endpoint, a, vocab, victim))
        print(
            json.dumps(
                {
                    "bench": "migration",
                    "device": "cpu",
                    "nodes": "1 prefill + 2 decode",
                    "duration_s": a.duration,
                    "concurrency": a.concurrency,
                    "prompt_len": a.prompt_len,
                    "output_len": a.output_len,
                    "undisturbed": undisturbed,
                    "decode_0_killed": killed,
                    "bound": {
                        "dead_after_s": DEAD_AFTER_S,
                        "what": "a moved request waits at least this long (silence before its "
                        "node counts as dead), plus a prefill of its prompt and tokens",
                    },
                }
            ),
            flush=True,
        )
        return 0 if not killed["num_failed"] and not undisturbed["num_failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
