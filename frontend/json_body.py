"""A whole answer's JSON body, or a streamed event with many logprobs (answers.py), encoded
a piece at a time with the frontend's loop taking turns between the pieces.

An answer with logprobs is large: sixteen choices of a 900-token prompt's logprobs, top 5,
is 1.9 MB of JSON and 40-70 ms of one json.dumps on an idle core (several times that on a
loaded one), all of it holding the one loop every stream and node link runs on. Here what
weighs more than BUDGET nodes (counted only that far: the choices, their logprobs, the
lists in those) is walked, and the entries of each container it walks are encoded together
in runs of at most BUDGET nodes, whatever their sizes; the loop is given a turn after each
YIELD_CHARS of output (characters out, and a little for each call, are a fair measure of
the encoder's work). What weighs less is one call, as before. NOTE: the bytes are
json.dumps's for the values an answer holds (plain dicts, lists, strings and numbers);
a list subclass that slices otherwise, or nesting within a few frames of the recursion
limit, may differ.
"""

from __future__ import annotations

import asyncio
import json
from typing import Iterator

YIELD_CHARS = 64 * 1024  # output between the loop's turns: a few milliseconds of encoding
PIECE_CHARS = 64  # what a piece costs beyond its characters (its call), counted as these
BUDGET = 2048  # nodes one call encodes at most (10-40 KB), where the walk can split them
STR_CHARS = 32  # a string weighs a node per this many characters of its output at most
# NOTE: deeper than this, what is left is one call (json.dumps's own check finds a cycle)
MAX_DEPTH = 8
WIDE, COMPACT = (", ", ": "), (",", ":")  # json.dumps's separators: its default, and tight
_LEAVES = frozenset((int, float, bool, type(None)))  # a node each, whatever their value


def pieces(obj, separators: tuple[str, str] = WIDE) -> Iterator[str]:
    """obj's JSON (json.dumps's with these separators, in pieces): each piece one call of
    the encoder, on at most about BUDGET nodes where they can be split."""
    dumps = json.JSONEncoder(separators=separators).encode  # json.dumps's, made once
    return _pieces(obj, dumps, separators, 0)


def _pieces(obj, dumps, separators: tuple[str, str], depth: int) -> Iterator[str]:
    if _weight(obj, BUDGET) <= BUDGET:  # NOTE: what is small is one call: walking costs more
        yield dumps(obj)
    else:
        yield from _walk(obj, dumps, separators, depth)


def _walk(obj, dumps, separators: tuple[str, str], depth: int) -> Iterator[str]:
    """obj, weighed over BUDGET: its entries in runs (_runs), where it can be split."""
    if depth >= MAX_DEPTH or not isinstance(obj, (dict, list, tuple)):
        yield dumps(obj)  # a scalar, or a string however long: one call (fast: C's loop)
    elif isinstance(obj, dict):
        yield "{"
        yield from _runs(list(obj.items()), True, dumps, separators, depth)
        yield "}"
    else:
        yield "["
        yield from _runs(obj, False, dumps, separators, depth)
        yield "]"


def _weight(obj, budget: int, depth: int = 0) -> int:
    """obj's nodes (a container: one, and its entries'), counted until they pass budget and
    MAX_DEPTH deep (below, a container counts as its length: a cycle ends): a number over
    budget means "more than one call should encode"."""
    if type(obj) in _LEAVES:
        return 1
    if isinstance(obj, str):
        return _str_weight(obj)
    n = 1
    if isinstance(obj, dict):
        items = obj.values()
        n += _keys_weight(obj, budget)  # NOTE: keys are output too (a top logprobs map's)
    elif isinstance(obj, (list, tuple)):
        if _LEAVES.issuperset(map(type, obj)):  # numbers alone (ids, bytes): checked in C
            return 1 + len(obj)
        items = obj
    else:
        return 1
    for item in items:
        if n > budget:
            break
        if type(item) in _LEAVES:  # NOTE: most nodes are: one type lookup
            n += 1
        elif isinstance(item, str):
            n += _str_weight(item)
        elif isinstance(item, (dict, list, tuple)):
            n += _weight(item, budget - n, depth + 1) if depth < MAX_DEPTH else 1 + len(item)
        else:
            n += 1
    return n


def _keys_weight(obj: dict, budget: int) -> int:
    """A dict's keys' nodes, counted until they pass budget. Keys that are all strings, and
    no more than budget, are weighed as one string of them all (C's loops; the widest
    character's output for each)."""
    if len(obj) <= budget:
        try:
            joined = "".join(obj)
        except TypeError:  # a key that is no string: each weighed
            pass
        else:
            return len(obj) + _str_weight(joined) - 1
    n = 0
    for key in obj:
        if n > budget:
            break
        n += _key_weight(key)
    return n


def _key_weight(key) -> int:
    """A dict key's nodes: a string's as any string's (its quotes, colon and comma ride
    with it), another key's text one."""
    return _str_weight(key) if isinstance(key, str) else 1


def _str_weight(text: str) -> int:
    """A string's nodes: its output over STR_CHARS, at the most json.dumps writes a character
    (printable ASCII: two, a quote's escape; other ASCII: six; beyond, with ensure_ascii:
    twelve). NOTE: both checks are C's loops."""
    most = (2 if text.isprintable() else 6) if text.isascii() else 12
    return 1 + len(text) * most // STR_CHARS


def _runs(entries, is_dict: bool, dumps, separators: tuple[str, str], depth: int):
    """A large container's entries (a dict's (key, value) pairs, or a list's items), without
    its brackets: consecutive small ones encoded together, up to BUDGET nodes a call; one
    over BUDGET alone walked (a choice with its logprobs, the list of a long prompt's)."""
    comma, colon = separators
    i, num = 0, len(entries)
    while i < num:
        lead = comma if i else ""
        value = entries[i][1] if is_dict else entries[i]
        weight = _weight(value, BUDGET) + (_key_weight(entries[i][0]) if is_dict else 0)
        if weight > BUDGET:  # alone, walked
            if is_dict:
                lead += _encoded_key(entries[i][0], dumps, colon) + colon
            yield lead
            yield from _walk(value, dumps, separators, depth + 1)  # NOTE: weighed already
            i += 1
            continue
        j = i + 1  # then the entries after it, while they fit in the call's budget
        while j < num:
            item = entries[j][1] if is_dict else entries[j]
            nxt = 1 if type(item) in _LEAVES else _weight(item, BUDGET - weight)  # 1 at least
            nxt += _key_weight(entries[j][0]) if is_dict else 0
            if weight + nxt > BUDGET:
                break
            weight += nxt
            j += 1
        run = dict(entries[i:j]) if is_dict else list(entries[i:j])
        yield lead + dumps(run)[1:-1]
        i = j


def _encoded_key(key, dumps, colon: str) -> str:
    """A key as json.dumps writes it: quoted, a number's or a bool's text if not a string."""
    return dumps({key: None})[1 : -len(colon + "null}")]


async def encode(body, separators: tuple[str, str] = WIDE) -> bytes:
    """body as JSON bytes (what json.dumps writes with these separators), the loop taking a
    turn every YIELD_CHARS of it."""
    out: list[str] = []
    num_since = 0
    for piece in pieces(body, separators):
        out.append(piece)
        num_since += len(piece) + PIECE_CHARS
        if num_since >= YIELD_CHARS:
            num_since = 0
            await asyncio.sleep(0)
    return "".join(out).encode()
