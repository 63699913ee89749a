"""Messages between the frontend and its nodes: requests and control down, tokens,
failures and health up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from common.base import kv_wire
from common.base.request import SamplingParams, TokenLogprobs
from common.wire.limits import I32, Figures, Id, MaxLen, Name, Parts, Range, Text

MAX_FORKS = 63  # a request's n - 1 further sequences (the client's MAX_N is 64)


@dataclass
class Fork:
    """One more of a request's n sequences: it shares the prompt's KV and is sampled with
    its own seed (seed + i for choice i). The prefill node sets first_token (and
    first_logprobs, when asked for) on its way to the decode node; -1: not sampled yet."""

    request_id: Id
    seed: Annotated[int, Range(0, 2**63 - 1)]
    first_token: Annotated[int, Range(-1, 2**31 - 1)] = -1
    first_logprobs: TokenLogprobs | None = None


# ---- frontend -> nodes --------------------------------------------------------


@dataclass
class PrefillRequest:
    TYPE: ClassVar[str] = "prefill"
    request_id: Id
    prompt_token_ids: list[I32]
    params: SamplingParams
    arrival_time: Annotated[float, Range(0, 1e12)]
    decode_node: Name  # the decode node chosen for this request ...
    decode_kv_endpoint: Annotated[str, MaxLen(512)]  # ... and where its KV link listens
    forks: Annotated[list[Fork], MaxLen(MAX_FORKS)] = field(
        default_factory=list
    )  # n > 1: the other n - 1 sequences, one prefill


@dataclass
class NodeAbort:
    TYPE: ClassVar[str] = "node_abort"
    request_id: Id


MAX_SYNC_IDS = 65536  # requests named per NodeSync (more go in several)


@dataclass
class NodeSync:
    """frontend -> node, when the node's link was made again (what was in flight on the
    old connection may be lost): of these requests, which does it not hold? Asked of
    everything routed there before this message, which the node reads after all of it."""

    TYPE: ClassVar[str] = "node_sync"
    sync_id: I32
    request_ids: Annotated[list[Id], MaxLen(MAX_SYNC_IDS)]


@dataclass
class PeerLost:
    """frontend -> decode nodes: prefill node NAME (the process of that epoch) is lost, so
    its reservations there may go now instead of at their lease's end; is_exited: its
    process surely ended (a new one took its name), so a late write of it cannot come."""

    TYPE: ClassVar[str] = "peer_lost"
    name: Name
    epoch: Name
    is_exited: bool = False


@dataclass
class Shutdown:
    TYPE: ClassVar[str] = "shutdown"


@dataclass
class Drain:
    """frontend -> node: take no new work, and stop once what it holds has moved
    elsewhere or finished (pdserve drain NAME)."""

    TYPE: ClassVar[str] = "drain"


@dataclass
class PrefixUpdate:
    """prefill -> frontend: route keys (common/prefix.route_key) of blocks the node's
    prefix cache added and evicted since its last update; is_reset: added is all it holds."""

    TYPE: ClassVar[str] = "prefix_update"
    name: Name
    pid: I32
    added: Annotated[list[int], MaxLen(65536)]
    removed: Annotated[list[int], MaxLen(65536)]
    is_reset: bool = False


@dataclass
class ReadyReply:
    """frontend -> node, for each NodeReady (and to a heartbeat from a node it has
    forgotten): registered, or why not. A retryable refusal is asked again."""

    TYPE: ClassVar[str] = "ready_reply"
    is_accepted: bool
    reason: Text | None = None
    is_retryable: bool = False


# ---- nodes -> frontend --------------------------------------------------------


@dataclass
class NodeReady:
    """node -> frontend: register, or (the same epoch again) say its link is back."""

    TYPE: ClassVar[str] = "ready"
    role: Name  # "prefill" or "decode"
    name: Name
    pid: I32
    epoch: Name  # new in each process: the node's messages are tagged NAME/EPOCH
    device: Name
    num_kv_blocks: I32
    block_size: Annotated[int, Range(1, 4096)]
    max_model_len: I32
    kv_endpoint: Annotated[str, MaxLen(512)] | None = None  # a decode node's KV link
    kv_transfer: Name = "auto"  # the KV transfer backend the node asked for
    max_batch_size: I32 = 0  # a decode node's batch rows (0: not said)


@dataclass
class Heartbeat:
    TYPE: ClassVar[str] = "heartbeat"
    role: Name
    name: Name
    stats: Figures
    pid: I32 = 0
    epoch: Name = ""  # counts only for the registered process (epoch) of that name


@dataclass
class RequestFailed:
    """is_retryable: the failure was the path's, not the request's (its decode node
    restarted, went silent or dropped the KV link): the frontend may move it.
    is_bad_request: the request's own (its grammar): the client is told so (a 400)."""

    TYPE: ClassVar[str] = "failed"
    request_id: Id
    error: Text
    is_retryable: bool = False
    is_bad_request: bool = False


@dataclass
class NodeSynced:
    """node -> frontend, the answer to a NodeSync: of its requests, those this node never
    had, or lost (missing), and those it is done with (ended: a decode node finished or
    dropped them; a prefill node handed them to their decode node)."""

    TYPE: ClassVar[str] = "node_synced"
    sync_id: I32
    missing: Annotated[list[Id], MaxLen(MAX_SYNC_IDS)]
    ended: Annotated[list[Id], MaxLen(MAX_SYNC_IDS)]


@dataclass
class NodeDraining:
    """node -> frontend, once it starts draining (SIGTERM or a Drain): route nothing
    more here, move what it holds."""

    TYPE: ClassVar[str] = "draining"
    name: Name
    pid: I32


@dataclass
class TokenUpdate:
    request_id: Id
    token_ids: list[I32]
    finish_reason: Name | None = None
    timings: Parts | None = None  # on a request's first update: where its TTFT went
    index: I32 = 0  # the first token's place in what this node generates (from 0):
    # the frontend sees a gap, so tokens lost on the way never go unseen
    logprobs: list[TokenLogprobs] | None = None  # one per token, when asked for
    prompt_logprobs: list[TokenLogprobs] | None = (
        None  # the prefill node's, once: prompt tokens 1..
    )


def ttft_parts(t: dict) -> dict:
    """Milliseconds spent in each stage from a request's stamps; a part whose stamps are
    not there (yet) is left out."""

    def ms(a: str, b: str) -> float | None:
        x, y = t.get(a), t.get(b)
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (x, y))
        return round((y - x) * 1e3, 3) if ok else None

    parts = {
        "queue_ms": ms("arrival", "prefill_start"),
        "prefill_ms": ms("prefill_start", "prefill_end"),
        "kv_transfer_ms": ms("prefill_end", "decode_recv"),
        # kv_transfer_ms in two: the write (reservation wait included), the commit's trip
        "kv_write_ms": ms("prefill_end", "written"),
        "kv_commit_ms": ms("written", "decode_recv"),
        "decode_admission_ms": ms("decode_recv", "decode_admit"),
    }
    cached = t.get("cached_tokens")  # the prefill node's prefix-cache hit, in tokens
    if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
        parts["cached_tokens"] = cached
    return {k: v for k, v in parts.items() if v is not None} | kv_wire.describe(t)


@dataclass
class TokenBatch:
    TYPE: ClassVar[str] = "tokens"
    updates: list[TokenUpdate]
