"""The OpenAI API's shapes: request bodies in, response bodies and stream chunks out.

Plain functions, no I/O: frontend/http.py serves them. A parameter pdserve does
not implement is refused with a 400 that names it, never ignored; a parameter
given at its no-op value (presence_penalty 0, logprobs false, n 1) is accepted.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from common.wire.client import MAX_PROMPT_IDS
from common.wire.protocol import GenerateRequest


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
                503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": status}}


# Parameters taken as no-ops at these values (what OpenAI's own defaults mean).
_NO_OP = {"n": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
          "repetition_penalty": (1, 1.0), "logprobs": (False, 0), "top_logprobs": (0,),
          "echo": (False,), "best_of": (1,), "logit_bias": ({},), "suffix": ("",),
          "min_p": (0, 0.0), "tools": ([],), "functions": ([],), "tool_choice": ("none",),
          "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},),
          "store": (False,), "service_tier": ("auto", "default"), "min_tokens": (0,),
          "skip_special_tokens": (True,)}
# Parameters that describe the caller and do not change the answer.
_METADATA = ("user", "metadata")
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
           "stream_options", "top_k", "ignore_eos", "stop_token_ids", "return_token_ids"}
_FIELDS = {"completions": _COMMON | {"prompt"},
           "chat": _COMMON | {"messages", "max_completion_tokens"}}


@dataclass(frozen=True)
class Call:
    """One parsed call: the request for the cluster and how to answer it."""
    request: GenerateRequest
    is_chat: bool
    is_stream: bool
    is_usage_streamed: bool   # stream_options.include_usage
    is_token_ids: bool        # return_token_ids: each choice carries its token ids
    model: str


def _number(body: dict, name: str, default, low=None, high=None, integer=False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}",
                       name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"'{name}' must be in [{low}, {high}], got {value}", name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
        raise ApiError(400, "'stop' must be a string or a list of at most 16 strings", "stop")
    if "" in stop:
        raise ApiError(400, "a stop string must not be empty", "stop")
    return stop


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "each message needs a 'role' string and 'content'", "messages")
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, "only text content parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, "message content must be a string or a list of text parts", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def _prompt(body: dict) -> dict:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # a batch of one
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPT_IDS:
        raise ApiError(400, f"'prompt' holds more than {MAX_PROMPT_IDS} token ids", "prompt")
    if isinstance(prompt, list) and prompt and \
            all(type(t) is int for t in prompt):
        return {"prompt_token_ids": prompt}   # its length against the model's is checked next
    if isinstance(prompt, list):
        raise ApiError(400, "'prompt' must be one string or one list of token ids; "
                            "batched prompts are not supported (send one request each)", "prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids", "prompt")


def parse(body, kind: str, served_model: str, default_max_tokens: int | None) -> Call:
    """body: the decoded JSON of /v1/completions (kind "completions") or
    /v1/chat/completions ("chat"). Raises ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name in _FIELDS[kind] or name in _METADATA:
            continue
        if name in _NO_OP and (value is None or value in _NO_OP[name]):
            continue
        if name not in _NO_OP and value is None:
            continue
        allowed = " or ".join(json.dumps(v) for v in _NO_OP.get(name, ()))
        raise ApiError(400, f"'{name}' is not supported by pdserve" +
                       (f" (only {name}={allowed}, which changes nothing)" if allowed else ""), name)
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{served_model}'",
                       "model")
    is_chat = kind == "chat"
    max_tokens = _number(body, "max_tokens", None, 1, 2**31 - 1, integer=True)
    if is_chat:
        max_tokens = _number(body, "max_completion_tokens", max_tokens, 1, 2**31 - 1, integer=True)
    if max_tokens is None:
        max_tokens = default_max_tokens
    stream = body.get("stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not stream or not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise ApiError(400, "'stream_options' takes only include_usage, and only with stream",
                           "stream_options")
    flags = {k: body.get(k, False) for k in ("stream", "ignore_eos", "return_token_ids")}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise ApiError(400, f"'{k}' must be a boolean", k)
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(isinstance(t, int) for t in stop_token_ids):
        raise ApiError(400, "'stop_token_ids' must be a list of integers", "stop_token_ids")
    source = {"messages": _messages(body)} if is_chat else _prompt(body)
    request = GenerateRequest(
        request_id=f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}", **source,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_number(body, "top_k", -1, -1, 2**31 - 1, integer=True),
        seed=_number(body, "seed", None, 0, 2**63 - 1, integer=True),
        stop=_stop(body), stop_token_ids=stop_token_ids, ignore_eos=flags["ignore_eos"])
    return Call(request, is_chat, flags["stream"], bool(options and options.get("include_usage")),
                flags["return_token_ids"], served_model)


# ---- responses ----------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _choice(call: Call, text: str, token_ids: list[int] | None, finish_reason, is_chunk: bool) -> dict:
    if not call.is_chat:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    elif is_chunk:
        choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    if call.is_token_ids:
        choice["token_ids"] = token_ids or []
    return choice


def response(call: Call, created: int, text: str, token_ids: list[int], finish_reason: str,
             use: dict) -> dict:
    return {"id": call.request.request_id, "object": "chat.completion" if call.is_chat else "text_completion",
            "created": created, "model": call.model,
            "choices": [_choice(call, text, token_ids, finish_reason, False)], "usage": use}


def chunk(call: Call, created: int, text: str = "", token_ids: list[int] | None = None,
          finish_reason: str | None = None, use: dict | None = None, is_role: bool = False) -> dict:
    """One stream event. use: the usage-only last chunk (no choices)."""
    out = {"id": call.request.request_id,
           "object": "chat.completion.chunk" if call.is_chat else "text_completion",
           "created": created, "model": call.model}
    if use is not None:
        out["choices"] = []
    else:
        choice = _choice(call, text, token_ids, finish_reason, True)
        if is_role:
            choice["delta"] = {"role": "assistant", "content": ""}
        out["choices"] = [choice]
    if call.is_usage_streamed:
        out["usage"] = use
    return out


def stream_event(event: dict) -> bytes:
    """One server-sent event: `data: <compact JSON>` and a blank line."""
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


_TEXT_MARK, _IDS_MARK = "\x00pdserve-text\x00", [-918273645]


def text_events(call: Call, created: int) -> Callable[[str, list[int]], bytes]:
    """(text, token_ids) -> the stream event of one content chunk, byte for byte what
    stream_event(chunk(call, created, text, token_ids)) gives. Made once per stream
    from a template: a chunk is the same but for its text (and ids), and encoding
    the whole dict for every token was most of the stream's JSON cost."""
    template = stream_event(chunk(call, created, _TEXT_MARK, _IDS_MARK))
    head, tail = template.split(json.dumps(_TEXT_MARK).encode())
    mid = b""
    if call.is_token_ids:
        mid, tail = tail.split(json.dumps(_IDS_MARK).encode())

    def event(text: str, token_ids: list[int]) -> bytes:
        if not text and call.is_chat:   # an empty delta is {}, not {"content": ""}: no template
            return stream_event(chunk(call, created, text, token_ids))
        if not call.is_token_ids:
            return head + json.dumps(text).encode() + tail
        return (head + json.dumps(text).encode() + mid +
                json.dumps(token_ids or [], separators=(",", ":")).encode() + tail)
    return event


def finish_reason(reason: str) -> str:
    """pdserve's stop / length map to OpenAI's; nothing else reaches a normal answer."""
    return "length" if reason == "length" else "stop"


def now() -> int:
    return int(time.time())
