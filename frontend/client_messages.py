"""The messages a client sends and gets, apart from any socket: a request made from
keywords, a reply as the messages it carries, when a request's stream ends, and its
answer gathered whole (Result). frontend/client.py sends and receives them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from common.base.log import CONTROL_CHARS
from common.wire.protocol import ErrorReply, GenerateOutput, GenerateRequest, OutputBatch


@dataclass
class Result:
    """A request's answer, whole. With n > 1 its own fields are choice 0's, and choices
    holds every choice's."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    usage: dict | None = None
    timings: dict | None = None
    logprobs: list = field(default_factory=list)  # per token, when asked for
    prompt_logprobs: list | None = None
    index: int = 0
    choices: list["Result"] = field(default_factory=list)

    def add(self, out: GenerateOutput) -> None:
        if out.index > 0 and out.index != self.index:  # -1: the whole request (an error)
            while len(self.choices) <= out.index:
                self.choices.append(Result(self.request_id, index=len(self.choices)))
            self.choices[out.index].add(out)
            return
        self.token_ids += out.token_ids
        self.text += out.text
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.is_finished:
            self.finish_reason = out.finish_reason
            self.error = out.error
            self.usage = out.usage
        if out.timings:
            self.timings = out.timings
        if not self.choices:
            self.choices.append(self)

    def to_dict(self) -> dict:
        """JSON-ready; choices (every choice, this one first) only when n > 1.
        # NOTE: choices[0] is self, so a plain vars() would be circular."""
        own = {k: v for k, v in vars(self).items() if k != "choices"}
        if len(self.choices) > 1:
            own["choices"] = [
                {k: v for k, v in vars(c).items() if k != "choices"} for c in self.choices
            ]
        return own


def make_request(prompt=None, *, request_id: str | None = None, **kw) -> GenerateRequest:
    """kw: GenerateRequest's fields (prompt_token_ids, messages, max_tokens, temperature,
    top_p, top_k, seed, stop, stop_token_ids, ignore_eos, timeout_s, logprobs, n, ...)."""
    request_id = request_id or uuid.uuid4().hex
    check_request_id(request_id)
    return GenerateRequest(request_id=request_id, prompt=prompt, **kw)


def check_request_id(request_id) -> None:
    """ValueError for an id the frontend refuses without naming it (its error could not be
    tied to the request, whose caller would wait out its idle timeout)."""
    if (
        not isinstance(request_id, str)
        or not 0 < len(request_id) <= 256
        or CONTROL_CHARS.search(request_id)
    ):
        raise ValueError(
            f"request_id must be 1 to 256 characters with no control characters, got "
            f"{str(request_id)[:64]!r}"
        )


class StreamEnds:
    """When a request's stream ends: once each of its n choices has finished (an
    ErrorReply about it ends them all)."""

    def __init__(self, n: int):
        self.n = n
        self.done: set[int] = set()

    def see(self, out: GenerateOutput) -> bool:
        if out.is_finished:
            self.done |= set(range(self.n)) if out.index < 0 else {out.index}
        return len(self.done) >= self.n


def unbatch(msg) -> list:
    """A reply as the messages it carries (an OutputBatch holds several requests' outputs)."""
    return list(msg.outputs) if isinstance(msg, OutputBatch) else [msg]


def as_output(rid: str, msg) -> GenerateOutput:
    """An ErrorReply about a request ends that request's stream."""
    if isinstance(msg, ErrorReply):
        return GenerateOutput(rid, [], "", True, "error", msg.error, index=-1)  # all its choices
    return msg
