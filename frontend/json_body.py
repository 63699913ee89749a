"""A whole answer's JSON body, or a streamed event with many logprobs (answers.py), encoded
a piece at a time with the frontend's loop taking turns between the pieces.

An answer with logprobs is large: sixteen choices of a 900-token prompt's logprobs, top 5,
is 1.5 MB of JSON and 40-70 ms of one json.dumps on an idle core (several times that on a
loaded one), all of it holding the one loop every stream and node link runs on. Here the
few containers that can grow (the choices, their logprobs and the lists in those) are
walked, their lists encoded CHUNK items at a time, and the loop is given a turn after each
YIELD_CHARS of output (characters out are a fair measure of the encoder's work).
"""

from __future__ import annotations

import asyncio
import json
from typing import Iterator

CHUNK = 256  # list items encoded in one call
YIELD_CHARS = 64 * 1024  # output between the loop's turns: a few milliseconds of encoding
# NOTE: the walk goes this deep and no deeper: body -> choices -> a choice -> its logprobs
# -> their lists. Below it each item is one json.dumps (a token's top logprobs: small).
MAX_DEPTH = 4
WIDE, COMPACT = (", ", ": "), (",", ":")  # json.dumps's separators: its default, and tight


def pieces(obj, separators: tuple[str, str] = WIDE, depth: int = 0) -> Iterator[str]:
    """obj's JSON (json.dumps's with these separators, in pieces): each piece one bounded
    call of the encoder."""
    comma, colon = separators
    if isinstance(obj, dict) and depth < MAX_DEPTH:
        yield "{"
        for i, (key, value) in enumerate(obj.items()):
            yield (comma if i else "") + _encoded_key(key, separators) + colon
            yield from pieces(value, separators, depth + 1)
        yield "}"
    elif isinstance(obj, (list, tuple)) and depth <= MAX_DEPTH:
        yield "["
        if depth < MAX_DEPTH and obj and isinstance(obj[0], (dict, list, tuple)):
            # containers (the choices): each walked, however many
            for i, item in enumerate(obj):
                if i:
                    yield comma
                yield from pieces(item, separators, depth + 1)
        else:  # values, or below the walk: CHUNK at a time, each a list without its brackets
            for start in range(0, len(obj), CHUNK):
                chunk = json.dumps(list(obj[start : start + CHUNK]), separators=separators)
                yield (comma if start else "") + chunk[1:-1]
        yield "]"
    else:
        yield json.dumps(obj, separators=separators)


def _encoded_key(key, separators: tuple[str, str]) -> str:
    """A key as json.dumps writes it: quoted, a number's or a bool's text if not a string."""
    return json.dumps({key: None}, separators=separators)[1 : -len(separators[1] + "null}")]


async def encode(body, separators: tuple[str, str] = WIDE) -> bytes:
    """body as JSON bytes (what json.dumps writes with these separators), the loop taking a
    turn every YIELD_CHARS of it."""
    out: list[str] = []
    num_since = 0
    for piece in pieces(body, separators):
        out.append(piece)
        num_since += len(piece)
        if num_since >= YIELD_CHARS:
            num_since = 0
            await asyncio.sleep(0)
    return "".join(out).encode()
