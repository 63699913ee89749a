"""What one reply may hold: its cost is checked before any work starts, since the reply
is built and written on the frontend's one loop."""

from __future__ import annotations

from common.wire.protocol import GenerateRequest

MAX_REPLY_LOGPROBS = 2**17  # prompt logprobs in a reply of several choices, every one's counted
# output logprobs in a whole reply of several choices, at most (held until the reply is
# written: about 60 bytes each in a completion's shape, 300 in a chat's, so 300 MB at most):
# counted before the prompts are, so an unset max_tokens counts as the model's whole length
MAX_WHOLE_REPLY_LOGPROBS = 2**20


def check_reply_logprobs(reqs: list[GenerateRequest], prompt_lens: list[int]) -> None:
    """ValueError if the prompt logprobs one reply would hold pass MAX_REPLY_LOGPROBS: every
    choice of every prompt of a group (an HTTP batch is one reply). A single choice of a
    single prompt is bounded by the model's length alone.
    NOTE: the reply is built and written on the frontend's loop: its bytes (and the time
    to write them) grow with the choices x the prompt x the alternatives."""
    if len(reqs) == 1 and reqs[0].n == 1:
        return
    num = sum(
        req.n * n * (req.prompt_logprobs + 1)
        for req, n in zip(reqs, prompt_lens)
        if req.prompt_logprobs is not None
    )
    if num > MAX_REPLY_LOGPROBS:
        what = "n x prompt tokens x (prompt_logprobs + 1)"
        what += " over the prompts" if len(reqs) > 1 else ""
        raise ValueError(
            f"{what} is {num} logprobs, more than the {MAX_REPLY_LOGPROBS} a reply "
            f"of several choices may hold: ask for fewer choices, prompts or prompt "
            f"logprobs"
        )


def check_whole_reply_logprobs(reqs: list[GenerateRequest], max_model_len: int) -> None:
    """ValueError if the output logprobs a whole (not streamed) reply would hold may pass
    MAX_WHOLE_REPLY_LOGPROBS: n x max_tokens (what the model's length leaves, where unset) x
    (logprobs + 1), over a batch's prompts. A single choice of a single prompt is bounded
    by the model's length alone.
    NOTE: a whole reply keeps every token's logprobs until its last choice ends (up to 300
    bytes each, in a chat's shape), then builds and writes them on the frontend's loop; a
    stream sends them as they come."""
    if len(reqs) == 1 and reqs[0].n == 1:
        return
    num = sum(
        req.n
        * min(max_model_len if req.max_tokens is None else req.max_tokens, max_model_len)
        * (req.logprobs + 1)
        for req in reqs
        if req.logprobs is not None
    )
    if num > MAX_WHOLE_REPLY_LOGPROBS:
        raise ValueError(
            f"n x max_tokens x (logprobs + 1) over the prompts is {num} logprobs, more than "
            f"the {MAX_WHOLE_REPLY_LOGPROBS} a whole reply of several choices may hold: stream "
            f"it, or ask for fewer choices, prompts, tokens (max_tokens unset counts as the "
            f"model's length) or logprobs"
        )
