"""Messages between a client and the frontend (docs/protocol.md documents them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from common.base.request import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    TokenLogprobs,
)
from common.wire.limits import (
    I32,
    I32_MAX,
    Id,
    MaxItems,
    MaxLen,
    Name,
    NodeFigures,
    Plain,
    Range,
)

# ---- client <-> frontend (documented in docs/protocol.md) ---------------------
# NOTE: every list is bounded, and its length is checked before its items: a client
# cannot make the frontend's loop walk millions of entries.
MAX_PROMPT_IDS = 2**20  # the frontend refuses more than its max_model_len anyway
MAX_STOP = 64  # stop strings per request (and MAX_STOP_CHARS in all, frontend/request.py)
MAX_MESSAGES = 4096  # chat messages per request
# their items in all (a message's fields, its content parts, its tool calls and theirs)
MAX_MESSAGE_ITEMS = 2**16
MAX_N = 64  # choices per request


@dataclass
class Structured:
    """A grammar the output obeys: kind json_schema (spec: the schema, as JSON text),
    json_object (spec unused), regex, choice (spec: a JSON list of strings) or grammar
    (EBNF); whitespace "compact" (JSON without free whitespace) or "any"."""

    kind: Name
    spec: Annotated[str, MaxLen(2**16)] = ""
    whitespace: Name = "compact"


@dataclass
class GenerateRequest:
    TYPE: ClassVar[str] = "generate"
    request_id: Id
    prompt: str | None = None
    prompt_token_ids: Annotated[list[I32], MaxLen(MAX_PROMPT_IDS)] | None = None
    # A message: role, content (text or null), and an assistant's tool_calls or a tool's
    # tool_call_id.
    messages: (
        Annotated[
            list[Annotated[dict, Plain(depth=5, max_items=64)]],
            MaxLen(MAX_MESSAGES),
            MaxItems(MAX_MESSAGE_ITEMS),
        ]
        | None
    ) = None
    max_tokens: Annotated[int, Range(0, I32_MAX)] = 16  # 0: the prompt alone (with prompt_logprobs)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: Annotated[int, Range(-1, I32_MAX)] = -1
    seed: Annotated[int, Range(0, 2**63 - 1)] | None = None
    stop: Annotated[list[Annotated[str, MaxLen(1024)]], MaxLen(MAX_STOP)] = field(
        default_factory=list
    )
    stop_token_ids: Annotated[list[I32], MaxLen(MAX_STOP_TOKEN_IDS)] = field(default_factory=list)
    ignore_eos: bool = False
    speculative: bool = True  # False: no drafts verified for it (where the node speculates)
    timeout_s: float | None = None
    # Reported: each output token's log-probability and this many likeliest alternatives;
    # prompt_logprobs: the same for each prompt token after the first.
    logprobs: Annotated[int, Range(0, MAX_LOGPROBS)] | None = None
    prompt_logprobs: Annotated[int, Range(0, MAX_LOGPROBS)] | None = None
    # Penalties and masks (OpenAI's and vLLM's meanings; docs/protocol.md).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: Annotated[int, Range(0, I32_MAX)] = 0
    logit_bias: Annotated[dict, Plain(depth=1, max_items=MAX_LOGIT_BIAS)] | None = (
        None  # "token id" -> bias
    )
    allowed_token_ids: Annotated[list[I32], MaxLen(MAX_PROMPT_IDS)] | None = None
    bad_words: Annotated[list[Annotated[str, MaxLen(1024)]], MaxLen(MAX_BAD_WORDS)] = field(
        default_factory=list
    )
    n: Annotated[int, Range(1, MAX_N)] = (
        1  # choices, each streamed under its index; choice i takes seed + i
    )
    structured: Structured | None = None
    tools: Annotated[str, MaxLen(2**18)] | None = None  # the chat template's tools, as JSON text
    chat_template_kwargs: Annotated[dict, Plain(depth=1, max_items=16)] | None = (
        None  # enable_thinking, ...
    )


@dataclass
class AbortRequest:
    TYPE: ClassVar[str] = "abort"
    request_id: Id


@dataclass
class StatsRequest:
    TYPE: ClassVar[str] = "stats"


@dataclass
class DrainRequest:
    """Stop routing to a node, move its requests to others, and let it exit once empty."""

    TYPE: ClassVar[str] = "drain_node"
    node: Name


@dataclass
class GenerateOutput:
    TYPE: ClassVar[str] = "output"
    request_id: str
    token_ids: list[int]
    text: str
    is_finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    usage: dict | None = None
    timings: dict | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when asked for
    prompt_logprobs: list[TokenLogprobs] | None = None  # on the first output: prompt tokens 1..
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs: the prompt they are of
    index: int = 0  # which of the request's n choices


@dataclass
class OutputBatch:
    """Outputs for several of one client's requests, sent together: one message per
    client per decode step instead of one per request."""

    TYPE: ClassVar[str] = "outputs"
    outputs: list[GenerateOutput]


@dataclass
class StatsReply:
    TYPE: ClassVar[str] = "stats_reply"
    is_ready: bool
    nodes: NodeFigures
    model: dict | None = None  # {"name", "vocab_size", "max_model_len"}
    frontend: dict | None = None  # {"pid", "is_draining", "num_waiting", "num_running", ...}


@dataclass
class DrainReply:
    TYPE: ClassVar[str] = "drain_reply"
    node: str
    num_moved: int  # requests it held that are moving to other nodes
    num_staying: int = 0  # requests it held that finish there (no other node can take them)
    has_peer: bool = True  # another live node of its role takes what it would have been sent


@dataclass
class ErrorReply:
    """For a message that named no request we could answer about."""

    TYPE: ClassVar[str] = "error"
    error: str
    request_id: str | None = None
