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
