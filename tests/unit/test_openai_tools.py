"""Tool calls and reasoning split out of a model's text as it streams, on the frontend's
own class (the same through a cluster: tests/cluster/test_api_features.py)."""

from __future__ import annotations

import json


def test_auto_tool_calls_and_reasoning_are_split_out_of_the_text():
    from frontend.openai_tools import Split

    text = (
        "<think>\nthe user wants weather\n</think>\n\nLet me check."
        '<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    )
    s = Split("auto", None, is_reasoning=True)
    parts = [s.feed(text[i : i + 7]) for i in range(0, len(text), 7)] + [s.feed("", is_final=True)]
    got = {"content": "", "reasoning_content": "", "tool_calls": []}
    for p in parts:
        for k, v in p.items():
            got[k] += v
    assert (
        got["reasoning_content"] == "\nthe user wants weather\n"
        and got["content"] == "Let me check."
    )
    (call,) = got["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_a_long_wait_is_kept_aside_not_copied_and_searched_each_token():
    """A call that does not close yet, blank text before a reasoning block may open, and a
    required call's answer give nothing back until their wait ends: their text is kept aside
    (pending unchanged), so a long one costs each token its own text, not the wait's whole
    length again; what is given back is the same as the whole text fed at once."""
    from frontend.openai_tools import Split

    body = '{"name": "f", "arguments": {"text": "' + "word " * 5000 + '"}}'
    for mode, is_reasoning, text, pieces in (
        (
            "auto",
            False,
            "ok <tool_call>",
            [body[i : i + 3] for i in range(0, len(body), 3)] + ["</tool_call> done"],
        ),
        ("none", True, "", ["  ", "\n"] * 5000 + ["<think>so</think>yes"]),
        ("required", False, "", ['[{"name": "f", "parameters": {"x": ', "1} }]"] + [" "] * 5000),
    ):
        s, whole = Split(mode, "f", is_reasoning), Split(mode, "f", is_reasoning)
        parts = [s.feed(text)]
        pending = s.pending
        for piece in pieces[:-1]:
            parts.append(s.feed(piece))
            assert s.pending == pending  # the wait's text is aside
        parts += [s.feed(pieces[-1]), s.feed("", is_final=True)]
        expected = whole.feed(text + "".join(pieces), is_final=True)
        got: dict = {}
        for p in parts:
            for k, v in p.items():
                got[k] = got.get(k, type(v)()) + v
        for calls in (got.get("tool_calls", []), expected.get("tool_calls", [])):
            for c in calls:
                c["id"] = "x"
        assert got == expected and (mode == "none" or got["tool_calls"]), mode
