"""How a call's outputs become its HTTP answer: each choice gathered as its outputs
arrive (Answer), then answered whole (one JSON body) or streamed (server-sent events,
the events already queued written at once). frontend/http.py routes the calls here."""

from __future__ import annotations

import asyncio

from aiohttp import web

from common.base.log import Throttle, get_logger
from frontend import json_body, server_timing
from frontend import openai_api as api
from frontend import openai_logprobs as lp_shapes
from frontend import openai_out as shapes
from frontend import openai_tools as tool_rules

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# tokens of logprobs in a streamed event that one call encodes (a step's; top 20 each, ~1,000
# nodes: under json_body.BUDGET); an event with more is json_body's (an echo's prompt's)
SMALL_LOGPROBS = 16
WRITE_DEADLINE_S = 30.0  # a stream's write of a piece waits this long for its client, at most
WRITE_PIECE = 64 * 1024  # bytes a stream writes at once (its progress is judged a piece at a time)

noisy = Throttle(get_logger("frontend"))


class Answer:
    """One choice of a call as its outputs arrive: the text (after the prompt's, with
    echo), the token ids, the logprobs in the call's shape when asked for, and a chat
    answer's content, reasoning and tool calls where they are split out of its text."""

    def __init__(
        self,
        call: api.Call,
        strings: lp_shapes.TokenStrings,
        prompt_text: str,
        is_reasoning: bool = False,
        prompt_parts: dict | None = None,
    ):
        """prompt_parts: shared by a call's choices, the prompt's logprobs in the call's
        shape, made once (every choice's are the same: n copies cost n shapes otherwise)."""
        self.call = call
        self.strings = strings
        self.prompt_parts = {} if prompt_parts is None else prompt_parts
        self.text = [prompt_text] if prompt_text else []
        self.unsent = prompt_text  # echo: streamed with the first text
        self.offset = 0  # the next token's text_offset (completions logprobs)
        self.token_ids: list[int] = []
        self.is_logprobs = call.request.logprobs is not None
        self.logprobs: dict | None = None
        self.split = None
        if call.is_chat and (call.tool_mode != "none" or is_reasoning):
            self.split = tool_rules.Split(call.tool_mode, call.tool_name, is_reasoning)
        # a chat answer's split parts, each a list of pieces (tool calls: whole ones)
        self.parts: dict[str, list] = {"content": [], "reasoning_content": [], "tool_calls": []}

    def _completion(self, token_ids: list[int], logprobs: list) -> dict:
        part = lp_shapes.completion(self.strings, token_ids, logprobs, self.offset)
        self._move_offset_past(part)
        return part

    def _move_offset_past(self, part: dict) -> None:
        """The next token's text_offset: after the last token of part, if it has any."""
        if part["tokens"]:
            self.offset = part["text_offset"][-1] + len(part["tokens"][-1])

    def _prompt_part(self, msg) -> dict:
        """The prompt's logprobs in the call's shape: made by the first choice to see them,
        shared by the others."""
        # NOTE: keyed by the list's identity: the choices of one request share the one list
        key = id(msg.prompt_logprobs)
        part = self.prompt_parts.get(key)
        if part is None:
            part = self._completion(
                list(msg.prompt_token_ids), [None, *(msg.prompt_logprobs or [])]
            )
            self.prompt_parts[key] = part
        else:
            self._move_offset_past(part)
        return part

    def add(self, msg) -> tuple[str, dict | None, dict | None]:
        """(the text to stream now, the new tokens' logprobs in the call's shape or None,
        the split parts of a chat answer to stream now or None)."""
        text = self.unsent + msg.text
        self.unsent = ""
        part = None
        if self.is_logprobs and self.call.is_echo and msg.prompt_token_ids is not None:
            part = self._prompt_part(msg)
        if self.is_logprobs and msg.logprobs is not None:
            if self.call.is_chat:
                part = lp_shapes.chat(self.strings, msg.token_ids, msg.logprobs)
            else:
                part = lp_shapes.merge(part, self._completion(msg.token_ids, msg.logprobs))
        # NOTE: only a whole response keeps its text and logprobs (a stream has sent them:
        # kept, a long answer's logprobs would hold kilobytes a token to its end)
        if not self.call.is_stream:
            if part is not None:  # extended in place, never rebuilt: linear in its length
                self.logprobs = lp_shapes.extend(self.logprobs, part)
            self.text.append(msg.text)
        self.token_ids += msg.token_ids
        parts = None
        if self.split is not None:
            parts = self._split(msg)
        return text, part, parts

    def _split(self, msg) -> dict:
        """The parts of a chat answer this output adds; a streamed tool call carries its
        place among the answer's calls."""
        parts = self.split.feed(msg.text, is_final=msg.is_finished)
        for k, v in parts.items():
            if k == "tool_calls":  # kept by a stream too: it numbers its calls
                self.parts[k] += v
            elif not self.call.is_stream:  # text for the whole response, in pieces
                self.parts[k].append(v)
        if not parts.get("tool_calls"):
            return parts
        first = len(self.parts["tool_calls"]) - len(parts["tool_calls"])
        calls = [{"index": first + i, **c} for i, c in enumerate(parts["tool_calls"])]
        return {**parts, "tool_calls": calls}

    def finish_reason(self, reason: str) -> str:
        return shapes.finish_reason(reason, bool(self.split and self.parts["tool_calls"]))

    def choice(self, reason: str) -> tuple:
        """This choice in a whole response (out_shape.response's tuple)."""
        return (
            "".join(self.text),
            self.token_ids,
            self.finish_reason(reason),
            self.logprobs,
            {k: v if k == "tool_calls" else "".join(v) for k, v in self.parts.items()}
            if self.split is not None
            else None,
        )


def usage(finals) -> dict:
    """One usage over a call's choices: the prompt once, every choice's completion."""
    finals = [f for f in finals if f.usage]
    prompt = finals[0].usage["prompt_tokens"] if finals else 0
    cached = finals[0].usage.get("cached_tokens", 0) if finals else 0
    return shapes.usage(prompt, sum(f.usage["completion_tokens"] for f in finals), cached)


async def whole(
    call: api.Call, answers: list[Answer], msg, queue: asyncio.Queue
) -> tuple[int, dict, dict | None]:
    """(status, body, the first choice's timings: its Server-Timing), once every choice
    has ended; msg: the call's first output, the rest from queue."""
    finals: dict[int, object] = {}
    status = None
    while True:
        answers[max(msg.index, 0)].add(msg)
        if msg.is_finished:
            if msg.finish_reason not in ("stop", "length"):
                status = status or 500
                return status, api.error_body(status, msg.error or msg.finish_reason), msg.timings
            finals[msg.index] = msg
            if len(finals) == len(answers):
                break
        msg, status = await queue.get()
    choices = [a.choice(finals[i].finish_reason) for i, a in enumerate(answers)]
    body = shapes.response(call, shapes.now(), choices, usage(finals.values()))
    return 200, body, finals[0].timings


async def stream_event(event: dict, logprobs: dict | None) -> bytes:
    """shapes.stream_event's bytes; where the event has many logprobs (an echo's prompt's),
    encoded a piece at a time, the loop's other work between (json_body)."""
    if logprobs is None or max(map(len, logprobs.values()), default=0) <= SMALL_LOGPROBS:
        return shapes.stream_event(event)
    return b"data: " + await json_body.encode(event, json_body.COMPACT) + b"\n\n"


async def stream(
    request: web.Request,
    call: api.Call,
    answers: list[Answer],
    msg,
    queue: asyncio.Queue,
    num_prompt: int,
) -> web.StreamResponse:
    """The call answered as server-sent events, until every choice has ended; msg: the
    call's first output, the rest from queue."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", **HEADERS})
    await out.prepare(request)
    created = shapes.now()
    n = len(answers)
    events_of = [shapes.text_events(call, created, i) for i in range(n)]
    # Events not yet written. Everything already queued goes out in one write: a
    # socket write per event is most of a stream's cost, and a client that lags
    # a step behind gets its backlog at once.
    events = []
    if call.is_chat:
        for i in range(n):
            events.append(shapes.stream_event(shapes.chunk(call, created, is_role=True, index=i)))
    status = None
    finals = {}

    async def event(timings: dict | None = None, **kw) -> bytes:  # a chunk of its own
        c = shapes.chunk(call, created, **kw)
        if call.is_usage_continuous:  # the usage so far on every chunk
            c["usage"] = shapes.usage(num_prompt, sum(len(a.token_ids) for a in answers))
        if timings is not None:  # the last chunk: where the time went (server_timing.py)
            c["timings"] = server_timing.with_decode(timings)
        return await stream_event(c, kw.get("logprobs"))

    while True:
        i = max(msg.index, 0)
        text, logprobs, parts = answers[i].add(msg)
        if parts is not None:  # a chat answer split into content, reasoning and tool calls
            if parts or logprobs is not None:
                events.append(
                    await event(
                        text=text,
                        token_ids=msg.token_ids,
                        logprobs=logprobs,
                        index=i,
                        parts=parts,
                    )
                )
        elif logprobs is not None or (call.is_usage_continuous and (text or msg.token_ids)):
            events.append(
                await event(text=text, token_ids=msg.token_ids, logprobs=logprobs, index=i)
            )
        elif text or (call.is_token_ids and msg.token_ids):  # held-back text waits
            events.append(events_of[i](text, msg.token_ids))
        if msg.is_finished:
            if msg.finish_reason not in ("stop", "length"):
                # the status line is sent: the error goes in the stream, as OpenAI's servers do
                error = api.error_body(status or 500, msg.error or msg.finish_reason)
                events.append(shapes.stream_event(error))
                break
            finals[msg.index] = msg
            is_last = len(finals) == n and not call.is_usage_streamed  # else: the usage chunk
            last = (msg.timings or {}) if is_last else None
            reason = answers[i].finish_reason(msg.finish_reason)
            events.append(await event(finish_reason=reason, index=i, timings=last))
            if len(finals) == n:
                if call.is_usage_streamed:
                    # pdserve's TTFT parts ride along on the usage chunk (an extra key).
                    use = shapes.chunk(call, created, use=usage(finals.values()))
                    timings = server_timing.with_decode(msg.timings)
                    events.append(shapes.stream_event({**use, "timings": timings}))
                break
        if queue.empty():
            if events:
                await write(request, out, b"".join(events))
                events.clear()
            msg, status = await queue.get()
        else:
            msg, status = queue.get_nowait()
    events.append(b"data: [DONE]\n\n")
    await write(request, out, b"".join(events), is_eof=True)
    return out


async def write(
    request: web.Request, out: web.StreamResponse, data: bytes, is_eof: bool = False
) -> None:
    """A stream's write of data, a WRITE_PIECE at a time, each piece waiting at most
    WRITE_DEADLINE_S for its client to take it; past it the connection is cut and the
    handler ends as a hang-up ends it (its requests are aborted).
    NOTE: a client that keeps its connection open and reads nothing would hold the handler
    and every output still to come (kilobytes a token with logprobs) for as long as it
    liked: its request ends on the nodes, so no limit of its client's would hold it back.
    The deadline is a piece's, not the whole write's: a client that reads, however slowly,
    takes a piece well within it, where a write of all that piled up while it read might
    not end in time."""
    try:
        for i in range(0, len(data), WRITE_PIECE):
            await asyncio.wait_for(out.write(data[i : i + WRITE_PIECE]), WRITE_DEADLINE_S)
        if is_eof:
            await asyncio.wait_for(out.write_eof(), WRITE_DEADLINE_S)
    except asyncio.TimeoutError:
        noisy.warning(
            "a streaming client at %s took nothing of its stream for %.0fs: its connection "
            "is closed",
            request.remote,
            WRITE_DEADLINE_S,
        )
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError from None
