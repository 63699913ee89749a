"""A whole answer's JSON body, or a streamed event with many logprobs (answers.py), encoded
a piece at a time with the frontend's loop taking turns between the pieces.

An answer with logprobs is large: sixteen choices of a 900-token prompt's logprobs, top 5,
is 1.5 MB of JSON and 40-70 ms of one json.dumps on an idle core (several times that on a
loaded one), all of it holding the one loop every stream and node link runs on. Here the
containers that hold something large (the choices, their logprobs and the lists in those)
are walked, their lists encoded in runs of items sized to about half YIELD_CHARS, and
the loop is given a turn after each YIELD_CHARS (characters out are a fair measure of the
encoder's work); what holds nothing large is encoded in one call, as before.
"""

from __future__ import annotations

import asyncio
import json
from typing import Iterator

YIELD_CHARS = 64 * 1024  # output between the loop's turns: a few milliseconds of encoding
LONG = 64  # a list longer than this is encoded in runs of its items, never at once
FIRST_RUN = 16  # a list's first run of items; each later one sized by the last's output
MAX_RUN = 4096  # items a run, however small they are
# NOTE: the walk goes this deep and no deeper: body -> choices -> a choice -> its logprobs
# -> their lists. Below it, an item is encoded whole (a token's top logprobs: small).
MAX_DEPTH = 4
WIDE, COMPACT = (", ", ": "), (",", ":")  # json.dumps's separators: its default, and tight


def pieces(obj, separators: tuple[str, str] = WIDE, depth: int = 0) -> Iterator[str]:
    """obj's JSON (json.dumps's with these separators, in pieces): each piece one call of
    the encoder on about YIELD_CHARS of output at most, where the walk's depth allows."""
    if not _is_large(obj, depth):  # NOTE: what is small is one call: walking it costs more
        yield json.dumps(obj, separators=separators)
    elif isinstance(obj, dict):
        comma, colon = separators
        yield "{"
        for i, (key, value) in enumerate(obj.items()):
            yield (comma if i else "") + _encoded_key(key, separators) + colon
            yield from pieces(value, separators, depth + 1)
        yield "}"
    elif isinstance(obj, (list, tuple)):
        yield "["
        yield from _runs(obj, separators, depth)
        yield "]"
    else:  # a long string: a piece of its own
        yield json.dumps(obj, separators=separators)


def _is_large(obj, depth: int) -> bool:
    """Whether obj holds, within the walk's depth, a list longer than LONG or a string
    longer than YIELD_CHARS: what one call should not encode at once."""
    if isinstance(obj, str):
        return len(obj) > YIELD_CHARS
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        if len(obj) > LONG:
            return True
        items = obj
    else:
        return False
    return depth < MAX_DEPTH and any(_is_large(item, depth + 1) for item in items)


def _runs(items, separators: tuple[str, str], depth: int) -> Iterator[str]:
    """A large list's items, without its brackets: a large one walked (where the depth
    allows), the others encoded together in runs, each sized from the last to give about
    half YIELD_CHARS (thousands of a batch's small choices, or 16 entries of top 20 each)."""
    comma, can_walk = separators[0], depth < MAX_DEPTH
    size, i = FIRST_RUN, 0
    while i < len(items):
        lead = comma if i else ""
        if can_walk and _is_large(items[i], depth + 1):
            yield lead
            yield from pieces(items[i], separators, depth + 1)
            i += 1
            continue
        j = min(i + size, len(items))
        if can_walk:  # up to the next large item (NOTE: a check an item: only where walked)
            j = next((m for m in range(i + 1, j) if _is_large(items[m], depth + 1)), j)
        text = json.dumps(list(items[i:j]), separators=separators)[1:-1]
        yield lead + text
        size = max(1, min(MAX_RUN, (j - i) * (YIELD_CHARS // 2) // max(len(text), 1)))
        i = j


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
