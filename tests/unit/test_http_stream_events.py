"""A stream's events, encoded into a template made once per stream, are byte for byte what
encoding each whole chunk gives, for any text (the API through a cluster:
tests/cluster/test_http.py)."""

from __future__ import annotations

import json
import random

import pytest

from frontend import openai_api as api
from frontend import openai_out as shapes


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"return_token_ids": True},
        {"stream_options": {"include_usage": True}, "model": 'm"[0]\\'},
    ],
)
def test_stream_events_from_the_template_equal_the_whole_chunk_encoded(kind, extra):
    """The stream encodes a chunk's text into a template made once per stream; its
    bytes must be exactly what encoding the whole chunk gives, for any text."""
    source = (
        {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"}
    )
    call = api.parse({**source, "stream": True, **extra}, kind, extra.get("model", "m"), 16)
    event = shapes.text_events(call, 1_700_000_000)
    rng = random.Random(0)
    alphabet = [
        '"',
        "\\",
        "\n",
        "\x00",
        "\x1f",
        "é",
        "中",
        "😀",
        "\ud800",
        "[0]",
        "a",
        " ",
        "\u2028",
    ]
    texts = ["", "a", '"text"'] + [
        "".join(rng.choices(alphabet, k=rng.randrange(1, 12))) for _ in range(300)
    ]
    for text in texts:
        ids = [rng.randrange(1000) for _ in range(rng.randrange(3))]
        want = shapes.stream_event(shapes.chunk(call, 1_700_000_000, text, ids))
        assert event(text, ids) == want, text
        assert json.loads(want[6:])["choices"][0]["text" if kind == "completions" else "delta"] == (
            text if kind == "completions" else ({"content": text} if text else {})
        )
