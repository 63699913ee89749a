"""What a message field may hold: the limits declared on field types (Range,
MaxLen, Plain) and the common types built from them. Every value is checked
against what its receiver will do with it: ints that reach int32 device tensors
stay in int32, names and ids stay short, maps of figures stay flat and finite."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from common.base.log import CONTROL_CHARS


class ProtocolError(ValueError):
    """A message that cannot be decoded; request_id is set when the header named one."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id


I32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float


@dataclass(frozen=True)
class MaxLen:
    n: int


@dataclass(frozen=True)
class Printable:
    """A string with no control characters (nor line or paragraph separators): an id a
    client chose is written into logs, where a newline would forge a line of its own."""


@dataclass(frozen=True)
class MaxItems:
    """At most n items in all (list entries and map entries, every level counted), counted
    before the value is walked: nesting within each level's limits can still multiply to
    millions of items, each costing the walk (and the receiver) its time."""

    n: int


@dataclass(frozen=True)
class Plain:
    """A map of plain data: string keys, at most max_items entries per level, depth
    levels deep, finite numbers; is_numbers: every value a finite number >= 0;
    bytes values of at most max_bytes (none when 0)."""

    depth: int = 3
    max_items: int = 256
    is_numbers: bool = False
    max_bytes: int = 0


Name = Annotated[str, MaxLen(128)]  # node names, message kinds
Id = Annotated[str, MaxLen(256), Printable()]  # request ids
Text = Annotated[str, MaxLen(4096)]  # errors, reasons
I32 = Annotated[int, Range(0, I32_MAX)]  # token ids, block ids, lengths, counts
Stamps = Annotated[dict, Plain(depth=1, max_items=32, is_numbers=True)]  # wall-clock stamps
Parts = Annotated[dict, Plain(depth=1, max_items=32)]  # durations: finite, maybe < 0 across clocks
Figures = Annotated[dict, Plain()]  # a node's stats
NodeFigures = Annotated[
    dict, Plain(depth=Plain.depth + 1)
]  # node name -> its Figures: one level more


def check_num_items(value: Any, limit: MaxItems, where: str) -> None:
    """ProtocolError once value's items pass limit.n; never counts much past it."""
    num_items, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            num_items += len(v)
            children = v.values()
        elif isinstance(v, (list, tuple)):
            num_items += len(v)
            children = v
        else:
            continue
        if num_items > limit.n:  # NOTE: before its children: a long list is not read
            raise ProtocolError(f"{where} holds more than {limit.n} items in all")
        stack.extend(c for c in children if isinstance(c, (dict, list, tuple)))


def check_limit(value: Any, limit, where: str) -> None:
    """ProtocolError unless value keeps within a Range or is Plain (a MaxLen is checked first,
    before the items: codec.py)."""
    if isinstance(limit, Range) and not limit.lo <= value <= limit.hi:
        raise ProtocolError(f"{where} must be in [{limit.lo}, {limit.hi}], got {value!r}")
    if isinstance(limit, Plain):
        _plain(value, limit, where, 0)
    if isinstance(limit, Printable) and CONTROL_CHARS.search(value):
        raise ProtocolError(f"{where} may hold no control characters (newlines, tabs)")


def _plain(value: Any, rule: Plain, where: str, depth: int) -> None:
    """Plain data: maps with string keys, lists, and finite scalars, within rule's bounds."""
    if isinstance(value, dict):
        if depth >= rule.depth or len(value) > rule.max_items:
            raise ProtocolError(f"{where} is too large or too deeply nested")
        for k, v in value.items():
            if not isinstance(k, str) or len(k) > 128:
                raise ProtocolError(f"{where} keys must be short strings")
            if rule.is_numbers:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e15:
                    raise ProtocolError(f"{where}[{k!r}] must be a finite number >= 0, got {v!r}")
            else:
                _plain(v, rule, f"{where}[{k!r}]", depth + 1)
    elif isinstance(value, list):
        if depth >= rule.depth or len(value) > rule.max_items:
            raise ProtocolError(f"{where} is too large or too deeply nested")
        for i, v in enumerate(value):
            _plain(v, rule, f"{where}[{i}]", depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"{where} must be finite")
    elif isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        raise ProtocolError(f"{where} is outside the 64-bit range")
    elif isinstance(value, str) and len(value) > 4096:
        raise ProtocolError(f"{where} is longer than 4096")
    elif isinstance(value, bytes) and rule.max_bytes:
        if len(value) > rule.max_bytes:
            raise ProtocolError(f"{where} is longer than {rule.max_bytes} bytes")
    elif not isinstance(value, (type(None), bool, int, float, str)):
        raise ProtocolError(f"{where} holds a {type(value).__name__}")
