"""A client run inside a simulated host (launch/tools/netns.py), printing JSON lines.

python -m tests.netns_client ENDPOINT complete PROMPTS_JSON MAX_TOKENS
python -m tests.netns_client ENDPOINT streams PROMPTS_JSON MAX_TOKENS
    (prints {"started": true} first)
python -m tests.netns_client ENDPOINT stats
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from frontend.client import AsyncClient, Client


def _row(outs) -> dict:
    last = outs[-1]
    return {
        "tokens": [t for o in outs for t in o.token_ids],
        "reason": last.finish_reason,
        "error": last.error,
        "num_migrations": (last.timings or {}).get("num_migrations", 0),
    }


async def _streams(endpoint: str, prompts: list, max_tokens: int, announce: bool) -> list[dict]:
    async with AsyncClient(endpoint, idle_timeout_s=60) as client:
        started = [asyncio.Event() for _ in prompts]

        async def one(i: int):
            outs = []
            async for out in client.generate(
                prompt_token_ids=prompts[i], max_tokens=max_tokens, ignore_eos=True
            ):
                started[i].set()
                outs.append(out)
            return outs, time.monotonic()

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        if announce:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            print(json.dumps({"started": True, "at": time.monotonic()}), flush=True)
        return [{**_row(outs), "ended_at": t} for outs, t in await asyncio.gather(*tasks)]


def main() -> None:
    endpoint, what = sys.argv[1], sys.argv[2]
    if what == "stats":
        with Client(endpoint) as c:
            s = c.stats()
        print(json.dumps({"nodes": s.nodes, "frontend": s.frontend, "is_ready": s.is_ready}))
        return
    prompts, max_tokens = json.loads(sys.argv[3]), int(sys.argv[4])
    print(
        json.dumps(
            {"results": asyncio.run(_streams(endpoint, prompts, max_tokens, what == "streams"))}
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
