"""A client's request at the frontend: its prompt's token ids and sampling
parameters (or a ValueError saying what is wrong, which the client gets as the
request's error), and its state while it runs."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from common.base.model_spec import ModelSpec
from common.base.request import SamplingParams, validate_prompt
from common.wire.protocol import GenerateRequest
from frontend.detok import IncrementalDetokenizer

# A ZeroMQ client is its routing id; an in-process one (HTTP) a (kind, peer) pair, so
# the two can never share a key.
Client = bytes | tuple[str, str]


@dataclass(eq=False)
class RequestState:
    node_id: str                 # the id the nodes know it by
    request_id: str              # the client's id, unique within its connection
    client: Client
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    arrival_time: float          # wall clock, comparable with the nodes' stamps
    deadline: float              # monotonic
    prefill_node: str | None = None   # None while it waits here for its turn
    decode_node: str | None = None
    num_tokens: int = 0
    timings: dict = field(default_factory=dict)
    is_prefilled: bool = False   # its first token came back (or it ended)
    early_token: int | None = None   # the first token, streamed by the prefill node
    is_decoding: bool = False    # its decode node has sent its first update
    work_tokens: int = 0         # prompt tokens its prefill node was expected to compute
    route_keys: dict[int, list[int]] = field(default_factory=dict)   # block size -> its blocks' keys
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None   # monotonic

    @property
    def kv_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens


def prompt_ids(tokenizer, req: GenerateRequest) -> list[int]:
    given = [x is not None for x in (req.prompt, req.prompt_token_ids, req.messages)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
    if req.prompt is not None:
        return tokenizer.encode(req.prompt)
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    for m in req.messages:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each message needs a string role and string content")
    ids = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # an encoding or a list


def prepare(req: GenerateRequest, tokenizer, spec: ModelSpec,
            max_model_len: int) -> tuple[list[int], SamplingParams]:
    """max_tokens None (HTTP chat) means what the model length leaves."""
    if req.timeout_s is not None and not req.timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {req.timeout_s}")
    if "" in req.stop:   # it would match at once: an answer of nothing, surely not what was meant
        raise ValueError("a stop string must not be empty")
    ids = prompt_ids(tokenizer, req)
    max_tokens = req.max_tokens if req.max_tokens is not None else max(max_model_len - len(ids), 1)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, seed=req.seed if req.seed is not None else random.getrandbits(63),
        stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos)
    params.validate(spec.vocab_size)
    validate_prompt(ids, params.max_tokens, spec.vocab_size, max_model_len)
    return ids, params
