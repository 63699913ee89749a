"""Messages on the KV link between a prefill node and a decode node: the handoff's
reserve, write and commit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar

import torch

from common.base.request import SamplingParams, TokenLogprobs
from common.wire.limits import I32, Id, MaxLen, Name, Plain, Range, Stamps, Text
from common.wire.node import MAX_FORKS, Fork

# What a transfer backend puts on the wire: plain maps (bytes allowed, bounded) that
# the backend itself checks field by field (common/transfer: codec.parse).
Descriptor = Annotated[dict, Plain(depth=2, max_items=32, max_bytes=64 * 2**10)]
Descriptors = Annotated[
    dict, Plain(depth=3, max_items=16, max_bytes=64 * 2**10)
]  # backend -> its Descriptor


# ---- prefill <-> decode (KV link) ----------------------------------------------
# A handoff is reserve -> write -> commit: the decode node reserves destination
# blocks, the prefill node's transfer backend writes its blocks into them, and
# the commit makes the request runnable on the decode node without a copy.


@dataclass
class KVHello:
    """prefill -> decode, on first contact and whenever the decode node's epoch changes."""

    TYPE: ClassVar[str] = "kv_hello"
    prefill_node: Name


@dataclass
class KVWelcome:
    """decode -> prefill: the decode node's cache, and how it may be written."""

    TYPE: ClassVar[str] = "kv_welcome"
    epoch: Name  # changes when the decode node restarts
    host_id: Annotated[str, MaxLen(512)]  # machine identity: ipc only between equal host ids
    device: Name
    cache_shape: list[I32]  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    dtype: Name
    backends: Descriptors  # backend name -> how it reaches this cache, for each accepted
    is_layerwise: bool = True  # it takes a write's layers as the prefill computes them


@dataclass
class KVReserve:
    """prefill -> decode: reserve blocks for the prompt (or renew them, or keep the
    request's place in line). ask: numbers the asks, echoed in the answer."""

    TYPE: ClassVar[str] = "kv_reserve"
    request_id: Id
    prompt_len: I32
    max_tokens: I32
    ask: I32 = 0
    fork_ids: Annotated[list[Id], MaxLen(MAX_FORKS)] = field(
        default_factory=list
    )  # n > 1: the sequences forked from it


@dataclass
class KVReserved:
    """decode -> prefill: block_ids for the prompt, or a refusal. The blocks stay
    reserved for lease_s from when the KVReserve reached the decode node (0: until
    released); the same KVReserve again renews them.
    is_queued, without blocks: the request waits its turn there and the blocks will
    follow unasked; the same KVReserve within lease_s keeps its place. With blocks:
    they are that turn (no request is answered, and the lease runs from now).
    reservation: the name of this grant (new for each): writes and the commit name it,
    so nothing meant for another grant of the same request, or another life of this
    node, lands in these blocks."""

    TYPE: ClassVar[str] = "kv_reserved"
    request_id: Id
    epoch: Name
    block_ids: list[I32] | None = None
    is_retryable: bool = False
    reason: Text | None = None
    lease_s: Annotated[float, Range(0, 86400)] = 0.0
    is_queued: bool = False
    ask: I32 = 0  # the KVReserve this answers (0: none, a grant from the line)
    reservation: Name = ""


@dataclass
class KVTransfer:
    """prefill -> decode: what a transfer backend sends on the KV link for one request
    (tcp: a group of layers of its blocks; dist, nixl: the write that will follow).
    data [any shape] travels as one raw frame, empty when the backend sends none."""

    TYPE: ClassVar[str] = "kv_transfer"
    request_id: Id
    reservation: Name  # the grant it writes into (KVReserved.reservation)
    backend: Name
    header: Descriptor
    data: torch.Tensor


@dataclass
class KVCommit:
    """prefill -> decode: the reserved blocks hold the prompt's KV; start decoding.
    Refused unless it names the grant the blocks belong to and everything the backend
    says a whole write is arrived (num_written of its units: tcp, layers; dist and
    nixl, the announced write; ipc, none). checksums (--kv-verify): one per block, of
    its KV in every layer, checked once it has landed."""

    TYPE: ClassVar[str] = "kv_commit"
    request_id: Id
    prompt_len: I32
    first_token: I32
    params: SamplingParams
    timings: Stamps
    backend: Name
    prompt_ids: list[I32]  # the decode node recomputes from them if it preempts
    reservation: Name = ""
    num_written: I32 = 0
    checksums: list[int] | None = None
    first_logprobs: TokenLogprobs | None = None  # what is reported of first_token, when asked for
    forks: Annotated[list[Fork], MaxLen(MAX_FORKS)] = field(
        default_factory=list
    )  # the reservation's fork_ids, in order, sampled


@dataclass
class KVRelease:
    """prefill -> decode: drop a reservation that will never be committed (the grant named:
    nothing else of this request's, e.g. a newer grant, goes), or, naming none, the
    request's place in line."""

    TYPE: ClassVar[str] = "kv_release"
    request_id: Id
    reservation: Name = ""


@dataclass
class HandoffAck:
    TYPE: ClassVar[str] = "kv_ack"
    request_id: Id
    is_accepted: bool
    is_retryable: bool = False
    reason: Text | None = None
