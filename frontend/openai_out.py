"""The OpenAI API's answers: response bodies and stream chunks (the request side is
openai_api.py). Plain functions, no I/O: frontend/http.py serves them."""

from __future__ import annotations

import json
import time
from typing import Callable

from frontend.openai_api import Call


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _choice(
    call: Call,
    text: str,
    token_ids: list[int] | None,
    finish_reason,
    is_chunk: bool,
    logprobs: dict | None = None,
    index: int = 0,
    parts: dict | None = None,
) -> dict:
    """parts: a chat answer's content, reasoning_content and tool_calls, where they are
    split out of its text (openai_tools.py)."""
    if not call.is_chat:
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    elif is_chunk:
        if parts is not None:
            delta = parts
        elif text:
            delta = {"content": text}
        else:
            delta = {}
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    else:
        message = (
            {"role": "assistant", "content": text}
            if parts is None
            else {
                "role": "assistant",
                "content": parts.get("content") or None,
                **{k: parts[k] for k in ("reasoning_content", "tool_calls") if parts.get(k)},
            }
        )
        choice = {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    if call.is_token_ids:
        choice["token_ids"] = token_ids or []
    return choice


def response(call: Call, created: int, choices: list[tuple], use: dict) -> dict:
    """choices: (text, token ids, finish reason, logprobs, parts or None) of each, in
    index order."""
    return {
        "id": call.request.request_id,
        "object": "chat.completion" if call.is_chat else "text_completion",
        "created": created,
        "model": call.model,
        "choices": [
            _choice(call, text, ids, reason, False, lp, i, parts)
            for i, (text, ids, reason, lp, parts) in enumerate(choices)
        ],
        "usage": use,
    }


def chunk(
    call: Call,
    created: int,
    text: str = "",
    token_ids: list[int] | None = None,
    finish_reason: str | None = None,
    use: dict | None = None,
    is_role: bool = False,
    logprobs: dict | None = None,
    index: int = 0,
    parts: dict | None = None,
) -> dict:
    """One stream event. use: the usage-only last chunk (no choices)."""
    out = {
        "id": call.request.request_id,
        "object": "chat.completion.chunk" if call.is_chat else "text_completion",
        "created": created,
        "model": call.model,
    }
    if use is not None:
        out["choices"] = []
    else:
        choice = _choice(call, text, token_ids, finish_reason, True, logprobs, index, parts)
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


def text_events(call: Call, created: int, index: int = 0) -> Callable[[str, list[int]], bytes]:
    """(text, token_ids) -> the stream event of one content chunk of choice index, byte
    for byte what stream_event(chunk(call, created, text, token_ids, index=index)) gives.
    Made once per stream and choice from a template: a chunk is the same but for its
    text (and ids), and encoding the whole dict for every token was most of the stream's
    JSON cost."""
    template = stream_event(chunk(call, created, _TEXT_MARK, _IDS_MARK, index=index))
    head, tail = template.split(json.dumps(_TEXT_MARK).encode())
    mid = b""
    if call.is_token_ids:
        mid, tail = tail.split(json.dumps(_IDS_MARK).encode())

    def event(text: str, token_ids: list[int]) -> bytes:
        if not text and call.is_chat:  # an empty delta is {}, not {"content": ""}: no template
            return stream_event(chunk(call, created, text, token_ids, index=index))
        if not call.is_token_ids:
            return head + json.dumps(text).encode() + tail
        return (
            head
            + json.dumps(text).encode()
            + mid
            + json.dumps(token_ids or [], separators=(",", ":")).encode()
            + tail
        )

    return event


def finish_reason(reason: str, is_tool_call: bool = False) -> str:
    """pdserve's stop / length map to OpenAI's (tool_calls where the answer is a call
    that ended by itself; one cut by max_tokens says length); nothing else reaches a
    normal answer."""
    if is_tool_call and reason != "length":
        return "tool_calls"
    return "length" if reason == "length" else "stop"


def now() -> int:
    return int(time.time())
