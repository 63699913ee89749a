"""What each side of a handoff holds, and the states it moves through.

Prefill side, one Handoff per request (sender.py), its Stage:
    ASKING -> (QUEUED ->) RESERVED -> WRITING -> WRITTEN -> COMMITTED -> ended by the ack
    RESERVED -> ASKING        its reservation ran out or the decode node restarted
    WRITING -> CANCELLING     failed or aborted under a write: ends when the write does
    any other -> CANCELLED    failed holding blocks there: ends, releasing them, next turn

Decode side, one Reservation per request (receiver.py), its Hold:
    WAITING -> RESERVED -> COMMITTED -> taken into the batch
    RESERVED, its commit held  a commit that overtook its KV waits for it (at most a lease)
    RESERVED -> FAILED        a write failed or it was aborted: its commit is refused
    freed when released by its prefill node, refused, or its lease ends uncommitted
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from common.base.request import SamplingParams, validate_prompt
from common.handoff.lease import INF, Lease
from common.transfer import KVWriter
from common.wire.protocol import KVCommit, KVReserve

DATA = "kv"  # a prefill node's KV data connection is tagged "NAME/EPOCH/kv" (links.py)


class Stage(enum.Enum):
    ASKING = "asking"  # no blocks there: a KVReserve is out, or due at next_ask_at
    QUEUED = "queued"  # in the decode node's waiting line: its blocks come unasked
    RESERVED = "reserved"  # blocks reserved there; written once the prompt's KV is computed
    WRITING = "writing"  # a copy reads the local blocks
    WRITTEN = "written"  # local blocks freed; committed once the first token is sampled
    COMMITTED = "committed"  # the decode node's answer to the commit ends the handoff
    CANCELLING = "cancelling"  # failed or aborted during a write: ends when the write does
    CANCELLED = "cancelled"  # failed holding blocks there: ends, releasing them, next advance


class Job(Protocol):
    """What the handoff reads of a prompt (common/engine/prefill_job.py's PrefillJob)."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    decode_node: str
    decode_kv_endpoint: str
    block_ids: list[int]  # local blocks; emptied once freed
    is_reserved: bool  # set here: its decode node holds blocks for it
    is_peer_granting: bool  # set here: that node granted the previous request at once
    prompt_len: int
    forks: list  # n > 1: the other sequences (Fork), first tokens set once sampled


class Link(Protocol):
    """The KV link to one decode node (common/wire/channel.py's Channel)."""

    num_bad: int

    def send(self, msg, block: bool = True) -> bool: ...
    def has_message(self) -> bool: ...
    def recv(self, allowed: tuple) -> tuple[bytes, object]: ...
    def take_reconnects(self) -> int: ...  # its connection made again since the last call
    def close(self) -> None: ...


@dataclass
class DecodePeer:
    name: str
    endpoint: str
    link: Link  # control
    data_link: Link | None = None  # the KV itself (links.py), from the first frame
    epoch: str | None = None  # of the welcome the writer was opened from
    writer: KVWriter | None = None
    error: str | None = None  # why this decode node cannot be written to
    hello_at: float = -INF
    num_blocks: int = 0  # in its cache, from its welcome
    is_granting: bool = False  # its last answer granted blocks at once
    is_layerwise: bool = False  # its welcome takes writes layer by layer


@dataclass
class Handoff:
    job: Job
    peer: DecodePeer
    stage: Stage = Stage.ASKING
    dst_block_ids: list[int] | None = None
    reservation: str = ""  # the grant's name (KVReserved.reservation)
    epoch: str | None = None  # the decode node's, when it reserved or queued
    lease: Lease = Lease()
    next_ask_at: float = 0.0  # the next KVReserve (ask or renew) goes then
    asks: dict = field(default_factory=dict)  # ask number -> when it was sent, until answered
    silent_since: float | None = None  # asked, no answer since
    queued_at: float = -INF  # when the KVReserve that queued it was sent
    num_refusals: int = 0  # retryable ones in a row
    is_kv_queued: bool = False  # every layer's KV is queued on the device
    first_token: int | None = None  # set when the prompt is done
    first_logprobs: object = None  # what is reported of it (TokenLogprobs), when asked for
    timings: dict = field(default_factory=dict)
    lease_deadline: float = INF  # the decode node must acknowledge the commit by then
    write_started: float = 0.0  # monotonic, by the handoff's clock
    write_deadline: float = INF  # a write still under way then is stopped
    num_written: int = 0  # units of the write, as its backend counts them
    layers_sent: int = -1  # pushed layer by layer: the layers written so far
    wire: str = "same"  # the format its KV crosses in (common/base/kv_wire.py)
    wire_bytes: int = 0  # what its write puts on the link
    blocks_sent: int = 0  # (of its blocks from blocks_sent on); those before, all
    pushed_at: float = -INF  # a pass computing its prompt last pushed it then
    # --kv-verify: of each block, taken when its write starts (a device tensor; its list once
    # committed)
    checksums: object = None
    written_at: float = 0.0  # wall clock
    error: str | None = None  # why it ends, once its write has finished
    is_retryable: bool = False  # error is the path's (the decode node), not the request's
    aborted_ids: set = field(default_factory=set)  # n > 1: of it and its forks, those given up

    @property
    def ids(self) -> list[str]:
        """The request's id, then its forks' (n > 1)."""
        return [self.job.request_id, *(f.request_id for f in self.job.forks)]

    def give_up(self, request_id: str) -> bool:
        """The frontend gave up request_id, one of ids: does the handoff end? Not while
        another of its n sequences goes on (its decode node drops this one)."""
        self.aborted_ids.add(request_id)
        return len(self.aborted_ids) >= len(self.ids)

    def drop_reservation(self, now: float) -> None:
        """Its blocks there are not ours to write any more: ask again."""
        self.stage = Stage.ASKING
        self.dst_block_ids = None
        self.epoch = None
        self.lease = Lease()
        self.reservation = ""
        self.next_ask_at = now
        self.job.is_reserved = False


class Hold(enum.Enum):
    WAITING = "waiting"  # in line for blocks, oldest first; granted unasked
    RESERVED = "reserved"  # the prompt's blocks are held for its prefill node to write
    # held, but a write failed or it was aborted: its commit is refused; freed when released,
    # committed or its lease ends
    FAILED = "failed"
    COMMITTED = "committed"  # written: waits for a batch row


@dataclass
class Reservation:
    request_id: str
    sender: bytes  # the prefill node that asked ("NAME/EPOCH"): only it writes, commits, releases
    prompt_len: int
    max_tokens: int
    lease: Lease  # renewed by each KVReserve for it
    hold: Hold = Hold.WAITING
    name: str = ""  # the grant's nonce, new for each (KVReserved.reservation)
    block_ids: list[int] = field(default_factory=list)  # the prompt's, written by the prefill node
    num_reserved: int = 0  # further blocks promised for the outputs
    commit: KVCommit | None = None
    error: str | None = None  # FAILED: why; once taken by next_ready(): why its KV is unusable
    is_lossy: bool = False  # taken by next_ready(): its KV landed from int8 rows (kv_wire.py)
    reason: str = "waiting for blocks"  # WAITING: why, for the answer
    reserved_at: float = field(default_factory=time.time)
    fork_ids: list[str] = field(default_factory=list)  # n > 1: the others, forked at admission
    aborted_ids: set[str] = field(default_factory=set)  # of it and its forks, those given up
    is_quarantined: bool = False  # its lease ended, and a one-sided writer may still be writing

    @property
    def num_seqs(self) -> int:
        return 1 + len(self.fork_ids)

    @property
    def is_given_up(self) -> bool:
        """The frontend gave up every one of its sequences."""
        return len(self.aborted_ids) >= self.num_seqs

    def why_not(self, c: KVCommit, vocab_size: int, max_model_len: int) -> str | None:
        """Why a commit for this reservation is refused (it does not fit it, or is malformed)."""
        try:
            c.params.validate(vocab_size)
            if len(c.prompt_ids) != c.prompt_len:
                return (
                    f"the commit names {len(c.prompt_ids)} prompt ids "
                    f"for a {c.prompt_len}-token prompt"
                )
            validate_prompt(c.prompt_ids, c.params.max_tokens, vocab_size, max_model_len)
        except ValueError as e:
            return str(e)
        if c.prompt_len != self.prompt_len or c.params.max_tokens > self.max_tokens:
            return (
                f"commit for {c.prompt_len} tokens + {c.params.max_tokens} outputs does not match "
                f"the reservation ({self.prompt_len} + {self.max_tokens})"
            )
        if [f.request_id for f in c.forks] != self.fork_ids:
            return "the commit's forks are not the ones reserved"
        if not all(0 <= t < vocab_size for t in [c.first_token, *(f.first_token for f in c.forks)]):
            return "a first token is outside the vocabulary"
        if c.checksums is not None and len(c.checksums) != len(self.block_ids):
            return f"{len(c.checksums)} block checksums for {len(self.block_ids)} blocks"
        return None

    def give_up(self, request_id: str) -> bool:
        """The frontend gave up request_id, it or one of its forks: does all of it go? Not
        while another of its n sequences goes on (the one given up ends as it is admitted)."""
        self.aborted_ids.add(request_id)
        return self.is_given_up


class Pool(Protocol):
    """The decode batch's block accounting (decode_node/scheduler.py)."""

    def refusal_for_good(
        self, request_ids: list[str], prompt_len: int, max_tokens: int
    ) -> str | None: ...
    def refusal_for_now(self, prompt_len: int, max_tokens: int, num_seqs: int) -> str | None: ...
    def take_blocks(
        self, prompt_len: int, max_tokens: int, num_seqs: int
    ) -> tuple[list[int], int]: ...
    def give_back(self, block_ids: list[int], num_reserved: int) -> None: ...
    def num_aside(self) -> int: ...


def why_malformed(m: KVReserve, max_model_len: int) -> str | None:
    """Why a KVReserve can never be granted anywhere, if it cannot."""
    if len({m.request_id, *m.fork_ids}) != 1 + len(m.fork_ids):
        return "a request's forks must have ids of their own"
    if m.prompt_len < 1 or m.max_tokens < 1:
        return f"bad reservation: prompt_len {m.prompt_len}, max_tokens {m.max_tokens}"
    if m.prompt_len + m.max_tokens > max_model_len:
        return f"prompt + max_tokens exceeds max_model_len {max_model_len}"
    return None
