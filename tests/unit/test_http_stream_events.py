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


def test_a_stream_whose_client_reads_nothing_is_cut_off_at_the_write_deadline(monkeypatch):
    """Found by a hunt: a client that kept its streaming connection open and read nothing
    held its handler in a write forever, and every output still to come in its queue (its
    request had ended on the nodes, so no limit of its client's held it back: 90 MB a
    connection with n=64 and logprobs). Past the write deadline the connection is cut and
    the handler ends as a hang-up ends it (its requests aborted)."""
    import asyncio
    from unittest import mock

    from aiohttp.test_utils import make_mocked_request

    from common.wire.protocol import GenerateOutput
    from frontend import answers
    from frontend import openai_logprobs as lp

    class Tokenizer:
        def convert_ids_to_tokens(self, i: int) -> str:
            return f"t{i}"

        def convert_tokens_to_string(self, pieces: list[str]) -> str:
            return "".join(pieces)

    monkeypatch.setattr(answers, "WRITE_DEADLINE_S", 0.2)
    written = []

    async def write(data):  # the client's buffers are full: the write never drains
        written.append(data)
        await asyncio.Event().wait()

    writer = mock.Mock(write=write, write_headers=mock.AsyncMock())
    transport = mock.Mock()

    async def run() -> float:
        request = make_mocked_request("POST", "/v1/completions", writer=writer, transport=transport)
        call = api.parse({"prompt": "hi", "stream": True}, "completions", "m", 16)
        answer = answers.Answer(call, lp.TokenStrings(Tokenizer()), "")
        queue: asyncio.Queue = asyncio.Queue()
        started = asyncio.get_running_loop().time()
        with pytest.raises(asyncio.CancelledError):
            first = GenerateOutput("r", [1], "t1", index=0)
            await asyncio.wait_for(answers.stream(request, call, [answer], first, queue, 1), 10)
        return asyncio.get_running_loop().time() - started

    took = asyncio.run(run())
    assert len(written) == 1 and transport.abort.called and 0.2 <= took < 5
