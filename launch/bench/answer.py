"""How long answering a large request holds the frontend's loop: a whole answer's JSON as
the frontend encodes it (frontend/json_body.py, a turn for the loop's other work every
YIELD_CHARS) against one json.dumps of it (aiohttp's json_response, what it did before).

    pdserve bench answer [--repeats 7]

Answers of the shapes the OpenAI API gives, with made-up token texts: n choices with echo
and a long prompt's logprobs (top 5), chat choices with top 20 (one of 4,000 tokens, 64 of
64), and batches (a harness's prompts, n each): short choices with echo and top 20 before
long ones, 4,096 short choices, 10,000 choices with their token ids. One JSON line per shape
on stdout, then a table on stderr: each side's longest hold of the loop (for one json.dumps,
all of it) and its whole time, the best of --repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from common.runtime.process import HelpFormat
from frontend import json_body
from launch.bench.common import emit
from launch.bench.table import cell, show, table


def _completions(num_choices: int, num_tokens: int, top: int) -> dict:
    logprobs = {
        "tokens": [f" tok{i}" for i in range(num_tokens)],
        "token_logprobs": [None] + [-1.0 - i / 7 for i in range(num_tokens - 1)],
        "top_logprobs": [None]
        + [{f" tok{i + j}": -0.5 * j - 0.01 for j in range(top)} for i in range(num_tokens - 1)],
        "text_offset": list(range(0, 6 * num_tokens, 6)),
    }
    choice = {"text": "x" * 6 * num_tokens, "logprobs": logprobs, "finish_reason": "length"}
    return {
        "object": "text_completion",
        "choices": [{"index": i, **choice} for i in range(num_choices)],
    }


def _chat(num_tokens: int, top: int) -> dict:
    def entry(i: int) -> dict:
        return {"token": f" tok{i}", "logprob": -0.25, "bytes": [32, 116, 111, 107]}

    content = [
        {**entry(i), "top_logprobs": [entry(i + j) for j in range(top)]} for i in range(num_tokens)
    ]
    message = {"role": "assistant", "content": "x" * num_tokens}
    return {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "logprobs": {"content": content}}],
    }


def _batch(num_choices: int) -> dict:
    choice = {"text": "The answer is 42.", "logprobs": None, "finish_reason": "stop"}
    return {
        "object": "text_completion",
        "choices": [{"index": i, **choice} for i in range(num_choices)],
    }


def _short_then_long() -> dict:
    """A batch with echo and top 20: four 1-token prompts, then 150 of 63 tokens, three times
    (what once sized a run by the short ones and took it of long ones)."""
    short, long = (_completions(1, n, 20)["choices"][0] for n in (1, 63))
    return {"object": "text_completion", "choices": ([short] * 4 + [long] * 150) * 3}


def _token_ids(num_choices: int, num_tokens: int) -> dict:
    choice = {"text": "x", "token_ids": list(range(num_tokens)), "finish_reason": "length"}
    return {
        "object": "text_completion",
        "choices": [{"index": i, **choice} for i in range(num_choices)],
    }


SHAPES = {
    "n16 x 900 prompt logprobs, top 5": lambda: _completions(16, 901, 5),
    "chat 4,000 tokens, top 20": lambda: _chat(4000, 20),
    "chat n64 x 64 tokens, top 20": lambda: {
        "choices": [c for _ in range(64) for c in _chat(64, 20)["choices"]]
    },
    "batch, short then long, top 20": _short_then_long,
    "batch of 4,096 short choices": lambda: _batch(4096),
    "batch of 10,000 x 65 token ids": lambda: _token_ids(10_000, 65),
}


async def _timed(encode) -> tuple[float, float]:
    """(the longest time the loop was held, the whole time) in ms, of encode() beside a task
    that takes a turn whenever it is given one."""
    turns: list[float] = []
    is_done = False

    async def tick():
        while not is_done:
            turns.append(time.perf_counter())
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    await encode()
    t1 = time.perf_counter()
    is_done = True
    await ticker
    marks = [t0] + [t for t in turns if t0 < t < t1] + [t1]
    return max(b - a for a, b in zip(marks, marks[1:])) * 1e3, (t1 - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        "pdserve bench answer", description=__doc__, formatter_class=HelpFormat
    )
    p.add_argument("--repeats", type=int, default=7, help="timed runs per side; the best counts")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats: at least 1")

    async def once_dumps(body):
        json.dumps(body).encode()

    rows = []
    for name, make in SHAPES.items():
        body = make()
        best = {}
        for side, fn in (("pieces", json_body.encode), ("one_dumps", once_dumps)):
            runs = [asyncio.run(_timed(lambda: fn(body))) for _ in range(a.repeats)]
            best[side] = (min(r[0] for r in runs), min(r[1] for r in runs))
        record = {
            "bench": "answer",
            "device": "cpu (the frontend's loop)",
            "shape": name,
            "num_bytes": len(json.dumps(body)),
            "longest_hold_ms": round(best["pieces"][0], 2),
            "total_ms": round(best["pieces"][1], 2),
            "peer": "one json.dumps of the answer (aiohttp's json_response), the same run",
            "peer_longest_hold_ms": round(best["one_dumps"][0], 2),
            "peer_total_ms": round(best["one_dumps"][1], 2),
            "repeats": a.repeats,
        }
        emit(record)
        rows.append(record)
    head = ["answer", "bytes", "longest hold ms", "(one dumps)", "total ms", "(one dumps)"]
    body_rows = [
        [r["shape"], f"{r['num_bytes']:,}"]
        + [
            cell(r[k])
            for k in ("longest_hold_ms", "peer_longest_hold_ms", "total_ms", "peer_total_ms")
        ]
        for r in rows
    ]
    show(table("A large answer's hold on the frontend's loop (best of --repeats)", head, body_rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
