"""A whole answer's JSON body encoded in pieces (frontend/json_body.py): the bytes are
json.dumps's, and the frontend's loop gets its turns while a large one is encoded."""

from __future__ import annotations

import asyncio
import json
import random

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


def test_a_large_body_gives_the_loop_its_turns():
    body = _completions_body(16, 901)
    got, num_turns = _turns_while(lambda: json_body.encode(body))
    assert got == json.dumps(body).encode()
    # NOTE: one json.dumps of it (what answering did) leaves another task no turn at all
    # (a turn every YIELD_CHARS: a piece may end past it, so at least every two)
    assert num_turns >= len(got) // (2 * json_body.YIELD_CHARS) - 1 > 5, num_turns


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


def _chat_choice(index: int, num_tokens: int, top: int) -> dict:
    def entry(i: int) -> dict:
        return {"token": f" tok{i}\u00e9", "logprob": -0.123456789, "bytes": [116, 111, 195]}

    content = [
        {**entry(i), "top_logprobs": [entry(i + j) for j in range(top)]} for i in range(num_tokens)
    ]
    return {
        "index": index,
        "message": {"content": "x" * num_tokens},
        "logprobs": {"content": content},
    }


def _with_last_logprobs_none(choice: dict, num_tokens: int) -> dict:
    """A choice whose top_logprobs list starts and ends with None (echo's first token; a last
    token the node sent no logprobs for): not a list of numbers, whatever its ends say."""
    top = _completions_body(1, num_tokens, top=20)["choices"][0]["logprobs"]["top_logprobs"]
    return {**choice, "logprobs": {**choice["logprobs"], "top_logprobs": top[:-1] + [None]}}


def test_no_piece_is_more_than_a_turns_worth():
    """Runs are sized in nodes, whatever the sizes of their items. Reviews found pieces of
    a megabyte and more: 64 chat choices of 64 tokens, top 20 (no list over 64 long: one
    call of 6.8 MB); a first run of 16 choices of 43 KB; runs sized by short choices, then
    taken of long ones (1 MB, over and over); 256 chat entries of top 20 (0.5 MB); a list of
    numbers by its ends (250 KB); strings weighed by characters, not output (1.1 MB); empty
    choices that weighed nothing (4 MB); keys not weighed (top logprobs maps: 216 KB), and
    short ones weighed as nothing (100 KB)."""
    big = _completions_body(1, 63, top=20)["choices"][0]
    small = _completions_body(1, 1, top=20)["choices"][0]
    bodies = {
        "n64 chat": {"choices": [_chat_choice(i, 64, 20) for i in range(64)]},
        "a batch of 43 KB choices": {"choices": [big] * 200},
        "short, then long": {"choices": ([small] * 4 + [big] * 150) * 3},
        "a long chat answer": {"choices": [_chat_choice(0, 4000, 20)]},
        "completions, top 20": _completions_body(4, 2000, top=20),
        "last logprobs none": {"choices": [_with_last_logprobs_none(big, 300)] * 64},
        "empty choices": {"choices": [{}] * 100_000},
        "texts beyond ASCII": {"choices": [{"text": "\U0001f600" * 600}] * 1024},
        "escaped top logprobs keys": {
            "choices": [
                {
                    "logprobs": {
                        "top_logprobs": [
                            {"\x01" * 16 + f"{j} {i}": -1.0 for j in range(20)} for i in range(4000)
                        ]
                    }
                }
            ]
        },
    }
    # Keys that weighed nothing: short ones (each output's few characters), escaping ones
    bodies["short escaping keys"] = {
        "choices": [
            {
                "logprobs": {
                    "top_logprobs": [
                        {
                            "\U0001f600" + chr(0x10000 + j) + str(i): -1.2345678901234567e-05
                            for j in range(21)
                        }
                        for i in range(4000)
                    ]
                }
            }
        ]
    }
    bodies["a dict of many short keys"] = {"\\" * 15 + str(i): 0 for i in range(100_000)}
    for name, body in bodies.items():
        got = list(json_body.pieces(body))
        assert "".join(got) == json.dumps(body), name
        # (escaped text is C's loop: twice a turn's characters at most, for a fraction of it)
        bound = json_body.YIELD_CHARS * (2 if name == "texts beyond ASCII" else 1)
        assert max(map(len, got)) <= bound, (name, max(map(len, got)))


def test_small_choices_are_encoded_together():
    """A batch's thousands of short choices are encoded in runs, not walked one by one (a
    walk of each cost 18x one json.dumps of them all); what is small is one call."""
    choices = [{"index": i, "text": "The answer is 42.", "logprobs": None} for i in range(20_000)]
    body = {"id": "x", "choices": choices, "usage": {"prompt_tokens": 1}}
    got = list(json_body.pieces(body))
    assert "".join(got) == json.dumps(body)
    assert len(got) <= 5 * len(json.dumps(body)) // json_body.YIELD_CHARS + 20, len(got)
    small = {"choices": [{"index": 0, "text": "hi", "logprobs": {"tokens": ["hi"]}}]}
    assert list(json_body.pieces(small)) == [json.dumps(small)]  # small: one call


def _random_json(rng: random.Random, depth: int):
    """Any JSON-able value, odd ones included: lists around the walk's lengths, nesting
    past its depth, keys of every type json.dumps takes."""
    r = rng.random()
    if depth > 7 or r < 0.35:
        return rng.choice(
            [
                0,
                -1,
                10**30,
                1.5,
                float("nan"),
                float("inf"),
                True,
                None,
                "",
                "\u00e9\u2028\ud800",
                'a"b\\',
                "\x00",
                2**63,
                -0.0,
            ]
        )
    if r < 0.65:
        n = rng.choice([0, 1, 2, 64, 300, 2 * json_body.BUDGET])
        if rng.random() < 0.5:
            return [_random_json(rng, 9) for _ in range(n)]
        items = [_random_json(rng, depth + 1) for _ in range(min(n, 4))]
        return tuple(items) if rng.random() < 0.3 else items
    keys = [
        rng.choice(["a", "b", 1, 2.5, True, None, float("inf"), "\u00e9", 10**20])
        for _ in range(rng.randrange(5))
    ]
    return {key: _random_json(rng, depth + 1) for key in keys}


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as e:  # the same failure as json.dumps's, whatever it is
        return "error", type(e).__name__


def test_any_value_gives_json_dumps_bytes_or_its_error():
    rng = random.Random(1)
    values = [_random_json(rng, 0) for _ in range(600)]
    circular: list = []
    circular.append(circular)
    long_text = "\u00e9" * (json_body.YIELD_CHARS + 1)  # a piece of its own
    values += [{(1, 2): 1}, {"a": {1j}}, {"a": 10**5000}, {"a": [circular] * 100}]
    values += [{"a": [long_text, 1], "b": long_text}, [[long_text]] * 3]
    for value in values:
        for seps in (json_body.WIDE, json_body.COMPACT):
            want = _outcome(lambda: json.dumps(value, separators=seps).encode())
            got = _outcome(lambda: "".join(json_body.pieces(value, seps)).encode())
            assert got == want, (str(value)[:200], seps)


def test_the_answer_benchmark_prints_a_record_a_shape(capsys):
    from launch.bench import answer

    assert answer.main(["--repeats", "1"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["shape"] for r in records] == list(answer.SHAPES)
    for r in records:
        assert r["bench"] == "answer" and r["peer"] and r["num_bytes"] > 300_000
        assert 0 < r["longest_hold_ms"] <= r["total_ms"] and r["peer_total_ms"] > 0


def test_a_dicts_keys_are_weighed_no_further_than_the_budget(monkeypatch):
    """Keys once weighed as nothing when short: the count never passed the budget, so every
    key of a large dict was visited in Python, again at each level above it (a stretch of
    444 ms without a turn, four times one json.dumps)."""
    calls = []
    for name in ("_str_weight", "_key_weight"):
        real = getattr(json_body, name, None)
        if real is None:
            continue
        monkeypatch.setattr(json_body, name, lambda k, real=real: calls.append(k) or real(k))

    class Key(str):
        pass

    for keys in (map(str, range(300_000)), range(300_000), map(Key, map(str, range(300_000)))):
        calls.clear()
        obj = dict.fromkeys(keys, 0)
        assert json_body._weight(obj, json_body.BUDGET) > json_body.BUDGET
        assert len(calls) <= 2 * json_body.BUDGET + 2, len(calls)
    # A str subclass's key weighs as the text it writes
    assert json_body._weight({Key("x" * 5000): 1}, json_body.BUDGET) > 5000 * 2 // 32
