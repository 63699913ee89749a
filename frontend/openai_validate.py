"""A request body in, its model out (openai_models.py), or one ApiError (400) naming the
body's first fault and the field at fault, in words a client can act on: a field pdserve
does not serve is refused by name, one taken only at a value that changes nothing says so,
a number out of range names its bounds."""

from __future__ import annotations

import json
from typing import get_args

from annotated_types import Ge, Le
from pydantic import BaseModel, ValidationError

from common.base.request import MAX_BAD_WORDS
from frontend.openai_errors import ApiError
from frontend.openai_models import (
    MAX_BATCH,
    MAX_STOP,
    MAX_TOOLS,
    NO_OP,
    CalledFunction,
    ChatBody,
    FunctionDef,
    JsonSchemaFormat,
    Message,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    StructuredOutputs,
    TextPart,
    Tool,
    ToolCall,
)

# A field whose faults read best as one sentence (a union's say little each): (message, param).
_HINTS = {
    "prompt": (
        "'prompt' must be a non-empty string, a list of token ids, or a list of those (a "
        f"batch of at most {MAX_BATCH})",
        "prompt",
    ),
    "stop": (
        f"'stop' must be a string or a list of at most {MAX_STOP} strings, each of 1 to "
        f"1024 characters",
        "stop",
    ),
    "bad_words": (
        f"'bad_words' must be a string or a list of at most {MAX_BAD_WORDS} strings, "
        f"each of 1 to 1024 characters",
        "bad_words",
    ),
    "stream_options": (
        "'stream_options' takes only include_usage and continuous_usage_stats (true "
        "or false), and only with stream",
        "stream_options",
    ),
    "response_format": (
        "'response_format' is {\"type\": text, json_object or json_schema, "
        '"json_schema": {"name", "schema": {...}}}',
        "response_format",
    ),
    "tools": (
        f"'tools' must be a list of at most {MAX_TOOLS} functions, each {{\"type\": "
        f'"function", "function": {{"name": ..., "parameters": {{...}}}}}}',
        "tools",
    ),
    "tool_choice": (
        '\'tool_choice\' must be none, auto, required or {"type": "function", '
        '"function": {"name": one of the tools}}',
        "tools",
    ),
    "guided_json": ("'guided_json' must be a JSON schema (an object, or its text)", "guided_json"),
}
_CHAT_HINTS = {
    "logprobs": (
        "'logprobs' must be a boolean (the number of alternatives is 'top_logprobs')",
        "logprobs",
    )
}


def validate(model: type[BaseModel], body) -> BaseModel:
    """body (decoded JSON) as model; ApiError (400) naming its first fault."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise _error(model, e.errors(include_url=False)[0]) from None


def _error(model: type[BaseModel], fault: dict) -> ApiError:
    loc, kind = fault["loc"], fault["type"]
    name = loc[0] if loc and isinstance(loc[0], str) else None
    if kind == "extra_forbidden" and len(loc) == 1:
        return ApiError(400, f"'{name}' is not supported by pdserve", name)
    if name in NO_OP and len(loc) == 1:
        allowed = " or ".join(json.dumps(v) for v in NO_OP[name])
        return ApiError(
            400,
            f"'{name}' is not supported by pdserve (only {name}={allowed}, which changes nothing)",
            name,
        )
    hint = (_CHAT_HINTS if model is ChatBody else {}).get(name) or _HINTS.get(name)
    if hint is not None:
        return ApiError(400, hint[0], hint[1])
    where = name or "the body"
    for part in loc[1:]:  # a list's index, a key, a field; a union's member names skipped
        if isinstance(part, int):
            where += f"[{part}]"
        elif not _is_member(part):
            where += f".{part}" if part.isidentifier() else f"[{part!r}]"
    if kind == "missing":
        return ApiError(400, f"'{where}' is required", name)
    if kind == "value_error":
        return ApiError(400, f"'{where}': {fault['ctx']['error']}", name)
    if name == "messages" and "content" in loc:
        where = where[: where.index(".content") + len(".content")]
        return ApiError(
            400,
            f'\'{where}\' must be a string or a list of {{"type": "text", '
            f'"text": ...}} parts (only text is served)',
            name,
        )
    got = _shown(fault.get("input"))
    if kind in ("greater_than_equal", "less_than_equal") and len(loc) == 1:
        lo, hi = _bounds(model, name)
        return ApiError(400, f"'{name}' must be in [{lo}, {hi}], got {got}", name)
    msg = fault["msg"]
    if msg.startswith("Input should be"):
        return ApiError(400, f"'{where}' must be{msg[len('Input should be') :]}, got {got}", name)
    return ApiError(400, f"'{where}': {msg[0].lower()}{msg[1:]}", name)


def _shown(value) -> str:
    """A client's value, short. NOTE: never the repr of a list or a map: it may be huge."""
    if isinstance(value, str):
        return repr(value[:60]) + ("..." if len(value) > 60 else "")
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)[:60]
    return (
        f"a {type(value).__name__} of {len(value)} items"
        if hasattr(value, "__len__")
        else f"a {type(value).__name__}"
    )


def _is_member(part: str) -> bool:
    """Whether a part of a fault's place names a member of a union (pydantic's name for
    it, as "str" or "list[int]"), not a field or a key of the client's."""
    return "[" in part or part.startswith("function-") or part in _MEMBERS


def _bounds(model: type[BaseModel], name: str) -> tuple:
    """A numeric field's [ge, le]."""
    lo = hi = None
    todo = [model.model_fields[name].annotation, *model.model_fields[name].metadata]
    while todo:
        t = todo.pop()
        if isinstance(t, Ge):
            lo = t.ge
        elif isinstance(t, Le):
            hi = t.le
        else:
            todo += [*get_args(t), *getattr(t, "metadata", ())]
    return lo, hi


_MEMBERS = {"str", "int", "float", "bool", "dict", "list", "none"} | {
    m.__name__
    for m in (
        StreamOptions,
        JsonSchemaFormat,
        ResponseFormat,
        StructuredOutputs,
        TextPart,
        CalledFunction,
        ToolCall,
        Message,
        FunctionDef,
        Tool,
        NamedFunction,
        NamedToolChoice,
    )
}
