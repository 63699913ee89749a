"""A whole answer's JSON body encoded in pieces (frontend/json_body.py): the bytes are
json.dumps's, and the frontend's loop gets its turns while a large one is encoded."""

from __future__ import annotations

import asyncio
import json

from frontend import json_body
from frontend import openai_out as shapes
from frontend.answers import stream_event


def _completions_body(num_choices: int, num_tokens: int, top: int = 5) -> dict:
    """A completions answer with echo and logprobs: every choice the prompt's logprobs."""
    logprobs = {
        "tokens": [f"t{i} é\n" for i in range(num_tokens)],
        "token_logprobs": [None] + [-1.0 - i / 7 for i in range(num_tokens - 1)],
        "top_logprobs": [None]
        + [{f"t{i + j}": -0.5 * j for j in range(top)} for i in range(num_tokens - 1)],
        "text_offset": list(range(0, 6 * num_tokens, 6)),
    }
    choices = [
        {"index": i, "text": "x" * num_tokens, "logprobs": logprobs, "finish_reason": "length"}
        for i in range(num_choices)
    ]
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": choices,
        "usage": {"prompt_tokens": num_tokens, "prompt_tokens_details": {"n": [1, 2]}},
    }


def _chat_body() -> dict:
    content = [
        {
            "token": "a",
            "logprob": -0.1,
            "bytes": [97],
            "top_logprobs": [{"token": "b", "logprob": -2.0, "bytes": [98]}],
        }
        for _ in range(600)
    ]
    message = {
        "role": "assistant",
        "content": "a" * 600,
        "tool_calls": [],
        "reasoning_content": None,
    }
    return {
        "choices": [{"index": 0, "message": message, "logprobs": {"content": content}}],
        "token_ids": list(range(1000)),
        "empty": {},
        "none": [],
        "tuple": (1, "x"),
        "nan": float("nan"),
        "keys": {1: "one", False: "f", None: "n", 2.5: "h"},
    }


def test_the_bytes_are_json_dumps_of_every_shape():
    for body in (
        _completions_body(16, 901),
        _completions_body(3, 1),
        _completions_body(0, 0),
        _chat_body(),
        {"error": {"message": "bad", "code": 400}},
        [],
        "a string",
    ):
        assert asyncio.run(json_body.encode(body)) == json.dumps(body).encode()
        compact = asyncio.run(json_body.encode(body, json_body.COMPACT))
        assert compact == json.dumps(body, separators=(",", ":")).encode()


def test_a_large_body_gives_the_loop_its_turns():
    body = _completions_body(16, 901)
    num_chars = len(json.dumps(body))

    async def run() -> tuple[int, int]:
        num_ticks = 0
        is_done = False

        async def tick():
            nonlocal num_ticks
            while not is_done:
                num_ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        before = num_ticks
        await json_body.encode(body)
        is_done = True
        await ticker
        return before, num_ticks

    before, after = asyncio.run(run())
    # NOTE: one json.dumps of it (what answering did) leaves the ticker no turn at all
    assert after - before >= num_chars // json_body.YIELD_CHARS - 1 > 10, (before, after)


def _turns_while(coro_fn) -> tuple[object, int]:
    """(what coro_fn() gave, how many turns another task had while it ran)."""

    async def run():
        num_ticks, is_done = 0, False

        async def tick():
            nonlocal num_ticks
            while not is_done:
                num_ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        before = num_ticks
        out = await coro_fn()
        is_done = True
        await ticker
        return out, num_ticks - before

    return asyncio.run(run())


def test_a_stream_event_with_many_logprobs_gives_the_loop_its_turns():
    """A streamed choice's first event with echo carries the prompt's logprobs: its bytes
    are stream_event's, and a large one is encoded with the loop's other work between."""
    body = _completions_body(1, 4000, top=20)
    logprobs = body["choices"][0]["logprobs"]
    event = {"id": "cmpl-1", "choices": [{"index": 0, "text": "", "logprobs": logprobs}]}
    got, num_turns = _turns_while(lambda: stream_event(event, logprobs))
    assert got == shapes.stream_event(event)
    assert num_turns > 10, num_turns  # one json.dumps of it: none
    small = {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [{"a": -1.0}]}
    event = {"choices": [{"index": 0, "text": "a", "logprobs": small}]}
    got, _ = _turns_while(lambda: stream_event(event, small))
    assert got == shapes.stream_event(event)


def test_no_piece_is_more_than_a_chunk_of_a_list():
    body = _completions_body(4, 2000, top=20)
    longest = max(len(p) for p in json_body.pieces(body))
    one_item = max(len(json.dumps(t)) for t in body["choices"][0]["logprobs"]["top_logprobs"])
    assert longest <= json_body.CHUNK * (one_item + 2), (longest, one_item)
