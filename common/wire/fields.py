"""How a message's fields are checked on the way in: the check for each field's type, worked
out once per type from its annotation and the limits declared on it (limits.py), and a
message dataclass built from a map of checked fields. codec.py decodes frames with these."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Annotated, Any, Callable, Union

from common.wire.limits import (
    MaxItems,
    MaxLen,
    Plain,
    ProtocolError,
    Range,
    check_limit,
    check_num_items,
)

MAX_DEPTH = 8  # of nested lists and maps in any field


@functools.lru_cache(maxsize=None)
def field_names(cls) -> tuple[str, ...] | None:
    """A dataclass's field names; None for any other type."""
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None


@functools.lru_cache(maxsize=None)
def hints(cls) -> dict:
    return typing.get_type_hints(cls, include_extras=True)


@functools.lru_cache(maxsize=None)
def _field_set(cls) -> frozenset:
    return frozenset(field_names(cls))


@functools.lru_cache(maxsize=None)
def _checker(t) -> Callable[[Any, str, int], Any]:
    """The check for type t, worked out once per type: (value, where, depth) -> value
    as type t, or ProtocolError naming the field.
    NOTE: `where` is only read to word an error, so list items are checked under
    their list's name and checked again under their own only when one fails."""
    if t is dict:  # a bare map: the default rule for plain data
        t = Annotated[dict, Plain()]
    origin = typing.get_origin(t)
    if origin is Annotated:
        base, *limits = typing.get_args(t)
        inner = _is_map if base is dict else _checker(base)  # a map's own rule walks it, once
        lengths = [limit for limit in limits if isinstance(limit, MaxLen)]
        counts = [limit for limit in limits if isinstance(limit, MaxItems)]

        def check(value, where, depth):
            for limit in lengths:  # NOTE: before the items: a long list is refused unread
                if isinstance(value, (list, tuple, str, bytes)) and len(value) > limit.n:
                    raise ProtocolError(f"{where} is longer than {limit.n}")
            for limit in counts:  # and counted before they are walked
                check_num_items(value, limit, where)
            value = inner(value, where, depth)
            for limit in limits:
                check_limit(value, limit, where)
            return value
    elif origin in (Union, types.UnionType):
        options = [_checker(o) for o in typing.get_args(t) if o is not type(None)]
        is_optional = type(None) in typing.get_args(t)

        def check(value, where, depth):
            if value is None and is_optional:
                return None
            errors = []
            for option in options:
                try:
                    return option(value, where, depth)
                except ProtocolError as e:
                    errors.append(str(e))
            raise ProtocolError(errors[0] if errors else f"{where} must not be null")
    elif origin in (list, tuple):
        item = _checker(typing.get_args(t)[0])
        as_type = tuple if origin is tuple else list
        ints = _int_range(typing.get_args(t)[0])

        def check(value, where, depth):
            if not isinstance(value, (list, tuple)):
                raise ProtocolError(f"{where} must be a list, got {type(value).__name__}")
            # Token and block ids: one pass in C over the common case, items checked only if
            # it fails.
            if (
                ints is not None
                and depth < MAX_DEPTH
                and (
                    not value
                    or (
                        all(type(v) is int for v in value)
                        and ints[0] <= min(value)
                        and max(value) <= ints[1]
                    )
                )
            ):
                return as_type(value)
            items = []
            try:
                for v in value:
                    items.append(item(v, where, depth + 1))
            except ProtocolError:  # say which item: check it again under its own name
                i = len(items)
                item(value[i], f"{where}[{i}]", depth + 1)
                raise
            return as_type(items)
    elif dataclasses.is_dataclass(t):

        def check(value, where, depth):
            if not isinstance(value, dict):
                raise ProtocolError(f"{where} must be a map, got {type(value).__name__}")
            return build(t, value, where + ".")
    elif t is float:

        def check(value, where, depth):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ProtocolError(f"{where} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise ProtocolError(f"{where} must be finite, got {value!r}")
            return float(value)
    elif t is int:

        def check(value, where, depth):
            if type(value) is not int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ProtocolError(f"{where} must be an integer, got {type(value).__name__}")
            if not -(2**63) <= value < 2**63:
                raise ProtocolError(f"{where} is outside the 64-bit range")
            return value
    else:

        def check(value, where, depth):
            if t is Any or isinstance(value, t):
                return value
            raise ProtocolError(f"{where} must be {_type_name(t)}, got {type(value).__name__}")

    def checked(value, where, depth):
        if depth > MAX_DEPTH:
            raise ProtocolError(f"{where} is nested too deeply")
        return check(value, where, depth)

    return checked


def _int_range(t) -> tuple[float, float] | None:
    """(lo, hi) if t is an int with a Range and no other limit."""
    if typing.get_origin(t) is not Annotated:
        return None
    base, *limits = typing.get_args(t)
    if base is not int or len(limits) != 1 or not isinstance(limits[0], Range):
        return None
    return limits[0].lo, limits[0].hi


def _is_map(value, where, depth):
    if not isinstance(value, dict):
        raise ProtocolError(f"{where} must be a map, got {type(value).__name__}")
    return value


def _type_name(t) -> str:
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


@functools.lru_cache(maxsize=None)
def _schema(cls) -> tuple[tuple[str, Callable, bool], ...]:
    """(name, check, is_required) per field of a message dataclass."""
    types_of = hints(cls)
    return tuple(
        (
            f.name,
            _checker(types_of[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    )


def build(cls, fields: dict, prefix: str = ""):
    known = _field_set(cls)
    if not fields.keys() <= known:
        unknown = sorted(set(fields) - known)[0]
        raise ProtocolError(f"unknown field {prefix}{unknown!r} in {cls.__name__}")
    kwargs = {}
    for name, check, is_required in _schema(cls):
        if name in fields:
            kwargs[name] = check(fields[name], prefix + name, 0)
        elif is_required:
            raise ProtocolError(f"missing field {prefix}{name!r}")
    return cls(**kwargs)
