"""A client's request at the frontend: its prompt's token ids and sampling
parameters (or a ValueError saying what is wrong, which the client gets as the
request's error), and its state while it runs."""
from __future__ import annotations

import dataclasses
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


class LostTokens(ValueError):
    """A node's update skips tokens: some were lost on its link (a reset); the request
    moves on from what the client has."""


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
    timings: dict = field(default_factory=dict)
    is_prefilled: bool = False   # its first token came back (or it ended)
    early_token: int | None = None   # the first token, streamed by the prefill node
    is_decoding: bool = False    # its decode node has sent its first update
    life_base: int = 0           # output tokens the client had when this route began
    work_tokens: int = 0         # prompt tokens its prefill node was expected to compute
    route_keys: dict[int, list[int]] = field(default_factory=dict)   # block size -> its blocks' keys
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None   # monotonic
    output_ids: list[int] = field(default_factory=list)   # every token sent to the client
    last_output_at: float | None = None   # monotonic
    # Moves to other nodes (a node lost or drained): how many, since when it waits to go
    # on, and the client's wait for its next token (from the last token before the move).
    num_migrations: int = 0
    moved_at: float | None = None         # monotonic; None once routed again
    moved_from: str = ""                  # "decode node X (why)", for the log
    stalled_since: float | None = None    # monotonic; None once a token came after the move
    migrated_s: float = 0.0
    earlier_parts: dict = field(default_factory=dict)   # what its earlier lives' nodes reported (preemptions)

    @property
    def num_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def kv_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    def new_tokens(self, node_name: str, index: int, token_ids: list[int],
                   finish_reason: str | None) -> list[int] | None:
        """Of a node's update (its first token at `index` of this route's tokens), the tokens
        new to the client; None for an update to drop. LostTokens: the update starts past
        what arrived. ValueError: the decode node began with another token than the prefill node."""
        num_have = len(self.output_ids) - self.life_base
        if node_name != self.decode_node:
            # The prefill node's first token, streamed while its KV travels. The decode
            # node's first update repeats it; if that came first, this one is late.
            if num_have or self.is_decoding or index or len(token_ids) != 1 or finish_reason:
                return None
            self.early_token = token_ids[0]
            return token_ids
        if index > num_have:
            raise LostTokens(f"decode node {node_name} sent token {index} of this request while "
                             f"{num_have} arrived: tokens were lost on its link")
        num_known = num_have - index   # the prefill node's first token, repeated
        if num_known > len(token_ids):
            return None   # a repeat of what arrived
        if token_ids[:num_known] != self.output_ids[self.life_base + index:]:
            raise ValueError(f"decode node {node_name} began with another first token than the prefill node")
        self.is_decoding = True
        return token_ids[num_known:]

    def add_output(self, token_ids: list[int]) -> None:
        """Tokens on their way to the client (a moved request's wait ends with the first)."""
        self.output_ids += token_ids
        self.detok.add(token_ids)
        if token_ids:
            now = time.monotonic()
            if self.stalled_since is not None:
                self.migrated_s += now - self.stalled_since
                self.stalled_since = None
            self.last_output_at = now

    def continuation(self) -> tuple[list[int], SamplingParams]:
        """What its next prefill computes: the prompt and every token streamed so far,
        for the tokens still to come. Sampling is seeded by position, so the tokens that
        follow are the ones an undisturbed run gives."""
        if not self.output_ids:
            return self.prompt_ids, self.params
        return self.prompt_ids + self.output_ids, dataclasses.replace(
            self.params, max_tokens=self.params.max_tokens - len(self.output_ids))

    def move(self, node_id: str, moved_from: str) -> None:
        """Forget its route: it waits to be routed again under a new id (what its old
        nodes still say under the old one is dropped)."""
        self.node_id, self.moved_from = node_id, moved_from
        self.prefill_node = self.decode_node = None
        self.is_prefilled = self.is_decoding = False
        self.early_token = None
        self.life_base = len(self.output_ids)
        self.work_tokens = 0
        self.route_keys = {}
        self.num_migrations += 1
        self.moved_at = time.monotonic()
        if self.stalled_since is None:
            self.stalled_since = self.last_output_at or self.submitted_at


# NOTE: what a request costs the frontend's event loop is bounded: a prompt of more text
# than this is tokenized on a thread of its own (at low priority), and one of more text
# than any prompt the model can take (max_prompt_chars) is refused unread.
OFF_LOOP_CHARS = 64 * 2**10
MAX_STOP_CHARS = 16 * 2**10   # all stop strings of a request together


def text_len(req: GenerateRequest) -> int:
    """Characters of text the request's prompt holds (0 for token ids)."""
    if req.prompt is not None:
        return len(req.prompt) if isinstance(req.prompt, str) else 0
    return sum(len(m.get("content")) for m in req.messages or () if isinstance(m.get("content"), str))


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """More text than this cannot fit in max_model_len tokens: no token's text is longer
    than its longest vocabulary entry (one character per byte, or longer), and the four
    covers a normalizer that composes characters."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return 4 * max_model_len * max(longest, 1)


def _count_tokens(tokenizer, text: str, add_special_tokens: bool) -> int | None:
    """A long text's token count, counted without making a list of its ids (the fast
    tokenizer's encoding keeps them): None where the tokenizer cannot say."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or len(text) <= OFF_LOOP_CHARS:
        return None
    return len(backend.encode(text, add_special_tokens=add_special_tokens))


def _check_count(n: int | None, max_model_len: int) -> None:
    if n is not None and n > max_model_len:
        raise ValueError(f"the prompt is {n} tokens: more than the model's maximum length {max_model_len}")


def prompt_ids(tokenizer, req: GenerateRequest, max_model_len: int = 2**31) -> list[int]:
    given = [x is not None for x in (req.prompt, req.prompt_token_ids, req.messages)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
    if req.prompt is not None:
        _check_count(_count_tokens(tokenizer, req.prompt, True), max_model_len)
        return tokenizer.encode(req.prompt)
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    for m in req.messages:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each message needs a string role and string content")
    if text_len(req) > OFF_LOOP_CHARS:
        text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
        _check_count(_count_tokens(tokenizer, text, False), max_model_len)
    ids = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # an encoding or a list


def check_size(req: GenerateRequest, max_chars: int) -> None:
    """What can be refused before any tokenizing: too much text, too many stop characters."""
    n = text_len(req)
    if n > max_chars:
        raise ValueError(f"the prompt is {n} characters: no text of more than {max_chars} fits in the "
                         f"model's maximum length")
    if sum(len(s) for s in req.stop) > MAX_STOP_CHARS:
        raise ValueError(f"the stop strings hold more than {MAX_STOP_CHARS} characters together")


def prepare(req: GenerateRequest, tokenizer, spec: ModelSpec,
            max_model_len: int) -> tuple[list[int], SamplingParams]:
    """max_tokens None (HTTP chat) means what the model length leaves."""
    if req.timeout_s is not None and not req.timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {req.timeout_s}")
    if "" in req.stop:   # it would match at once: an answer of nothing, surely not what was meant
        raise ValueError("a stop string must not be empty")
    ids = prompt_ids(tokenizer, req, max_model_len)
    max_tokens = req.max_tokens if req.max_tokens is not None else max(max_model_len - len(ids), 1)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, seed=req.seed if req.seed is not None else random.getrandbits(63),
        stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos)
    params.validate(spec.vocab_size)
    validate_prompt(ids, params.max_tokens, spec.vocab_size, max_model_len)
    return ids, params
