"""Reservations, admission and preemption for the decode batch.

A handoff reserves first: the prompt's blocks are taken (their ids go back to
the prefill node, which writes into them). A request that does not fit now
waits its turn in `waiting` (first come, first served) and is granted its
blocks as they free up, without being asked again. A committed reservation waits for a
free batch row; admission copies nothing. A reservation neither renewed nor
committed before its lease ends is freed (its prefill node is gone).

Preemptive (the default): a reservation takes what the request needs to join
the batch, and only while a watermark of the pool stays free for running
sequences to grow into. When a step needs a block the pool does not have, the
most recently admitted sequence is preempted (the node swaps its KV to host
memory or drops it to be recomputed) and waits; preempted sequences are resumed,
oldest first, before anything new is admitted or reserved.
Full reservation (is_preemptive=False): every block a request could need is
promised at reservation, so nothing is ever preempted and the batch is smaller.
"""
from __future__ import annotations

import time
import math
from collections import deque
from dataclasses import dataclass, field

from common.kv.blocks import BlockAllocator, num_blocks_for
from common.wire.protocol import KVCommit
from common.kv.sequence import Sequence


@dataclass
class Reservation:
    request_id: str
    sender: bytes                 # the prefill node that asked: only it may write, commit, release
    prompt_len: int
    max_tokens: int
    block_ids: list[int]          # the prompt's blocks, written by the prefill node
    num_reserved: int             # further blocks promised for the outputs
    deadline: float               # monotonic: freed if not committed by then
    commit: KVCommit | None = None
    error: str | None = None      # a write that failed: the commit is refused with this
    reserved_at: float = field(default_factory=time.time)


@dataclass
class WaitingReserve:
    """A reservation request waiting for blocks."""
    request_id: str
    sender: bytes
    prompt_len: int
    max_tokens: int
    deadline: float               # monotonic: dropped unless asked again by then
    reason: str = "waiting for blocks"   # why it waits, for the answer


WATERMARK = 0.01   # of the pool, kept free by admission for running sequences to grow into


class DecodeScheduler:
    def __init__(self, blocks: BlockAllocator, block_size: int, max_batch_size: int,
                 max_queue: int, is_preemptive: bool = True):
        self.blocks = blocks
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.is_preemptive = is_preemptive
        self.watermark = math.ceil(blocks.capacity * WATERMARK) if is_preemptive else 0
        self.reservations: dict[str, Reservation] = {}   # reserved, not yet running
        self.ready: deque[str] = deque()                  # committed, waiting for a row
        self.running: dict[str, Sequence] = {}
        self.preempted: list[Sequence] = []               # oldest admission first
        self.waiting: deque[WaitingReserve] = deque()                 # waiting for blocks, oldest first
        self.num_admitted = 0

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        """Every token written to the cache: the prompt and all outputs but the last."""
        return num_blocks_for(prompt_len + max_tokens - 1, self.block_size)

    def blocks_at_reserve(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks a reservation takes: enough to join the batch (the prompt and the
        first output's position), or with full reservation, everything."""
        need = self.blocks_needed(prompt_len, max_tokens)
        return min(num_blocks_for(prompt_len + 1, self.block_size), need) if self.is_preemptive else need

    def refusal(self, request_id: str, prompt_len: int, max_tokens: int) -> tuple[str, bool] | None:
        """(reason, is_retryable) if this request cannot be reserved now."""
        if request_id in self.running or request_id in self.reservations or \
                any(s.request_id == request_id for s in self.preempted):
            return f"request {request_id!r} is already on this decode node", False
        need = self.blocks_needed(prompt_len, max_tokens)
        if need > self.blocks.capacity:
            # NOTE: this also guarantees that a preempted sequence, alone, always fits.
            return f"needs {need} KV blocks, this decode node has {self.blocks.capacity}", False
        if len(self.reservations) >= self.max_queue:
            return f"decode queue is full ({self.max_queue})", True
        if self.preempted:
            return f"{len(self.preempted)} preempted requests resume first", True
        now = self.blocks_at_reserve(prompt_len, max_tokens)
        if not self.blocks.can_allocate(now + self.watermark):
            return f"needs {now} KV blocks, {self.blocks.num_available} are free now", True
        return None

    def reserve(self, request_id: str, sender: bytes, prompt_len: int, max_tokens: int,
                lease_s: float) -> Reservation:
        need = self.blocks_at_reserve(prompt_len, max_tokens)
        num_prompt = num_blocks_for(prompt_len, self.block_size)
        block_ids = self.blocks.allocate(num_prompt)
        self.blocks.reserve(need - num_prompt)
        r = Reservation(request_id, sender, prompt_len, max_tokens, block_ids, need - num_prompt,
                        time.monotonic() + lease_s)
        self.reservations[request_id] = r
        return r

    def request(self, request_id: str, sender: bytes, prompt_len: int, max_tokens: int,
                lease_s: float, max_line: int) -> Reservation | WaitingReserve | tuple[str, bool]:
        """A KVReserve: its reservation (new, or renewed when the sender asks again for
        what it holds), its place in line (new, or kept), or a refusal (reason,
        is_retryable) when the line is full or the request can never be held."""
        now = time.monotonic()
        r = self.reservations.get(request_id)
        if r is not None and r.sender == sender and r.commit is None and \
                (r.prompt_len, r.max_tokens) == (prompt_len, max_tokens):
            r.deadline = now + lease_s
            return r
        a = self.find_waiting(request_id)
        if a is not None:
            if (a.sender, a.prompt_len, a.max_tokens) != (sender, prompt_len, max_tokens):
                return f"request {request_id!r} is already on this decode node", False
            a.deadline, a.reason = now + lease_s, "waiting for blocks"
            return a
        refusal = self.refusal(request_id, prompt_len, max_tokens)
        if refusal is None and self.waiting:
            refusal = f"{len(self.waiting)} requests wait for blocks first", True
        if refusal is None:
            return self.reserve(request_id, sender, prompt_len, max_tokens, lease_s)
        if refusal[1] and len(self.waiting) < max_line:
            a = WaitingReserve(request_id, sender, prompt_len, max_tokens, now + lease_s, refusal[0])
            self.waiting.append(a)
            return a
        return refusal

    def find_waiting(self, request_id: str) -> WaitingReserve | None:
        return next((a for a in self.waiting if a.request_id == request_id), None)

    def drop_waiting(self, request_id: str, sender: bytes | None = None) -> bool:
        a = self.find_waiting(request_id)
        if a is None or (sender is not None and a.sender != sender):
            return False
        self.waiting.remove(a)
        return True

    def next_grant(self) -> tuple[WaitingReserve, tuple[str, bool] | None] | None:
        """The oldest waiting request and its refusal (None: grant it), once it no
        longer has to wait; None while it does."""
        if not self.waiting:
            return None
        a = self.waiting[0]
        refusal = self.refusal(a.request_id, a.prompt_len, a.max_tokens)
        if refusal is not None and refusal[1]:
            return None
        self.waiting.popleft()
        return a, refusal

    def commit(self, r: Reservation, commit: KVCommit) -> None:
        r.commit = commit
        self.ready.append(r.request_id)

    def release(self, request_id: str) -> Reservation | None:
        """Give a reservation's blocks back (aborted, expired or refused)."""
        r = self.reservations.pop(request_id, None)
        if r is None:
            return None
        if r.commit is not None:
            self.ready.remove(request_id)
        self.blocks.free(r.block_ids)
        self.blocks.unreserve(r.num_reserved)
        r.block_ids, r.num_reserved = [], 0
        return r

    def expired(self, now: float) -> list[str]:
        return [rid for rid, r in self.reservations.items() if r.commit is None and now > r.deadline]

    def has_admissible(self, is_landed) -> bool:
        # Preempted sequences go first, unless nothing runs that could free blocks for them.
        return bool(self.ready) and len(self.running) < self.max_batch_size and \
            (not self.preempted or not self.running) and is_landed(self.ready[0])

    def next_admissible(self, is_landed) -> Reservation | None:
        """The oldest committed reservation whose blocks have landed, if a row is free
        (FIFO: nothing overtakes it)."""
        if not self.has_admissible(is_landed):
            return None
        return self.reservations.pop(self.ready.popleft())

    def start(self, r: Reservation) -> Sequence:
        """A committed reservation becomes a running sequence with the same blocks."""
        seq = Sequence(r.request_id, r.prompt_len, r.commit.params, r.block_ids, r.num_reserved,
                       prompt_ids=r.commit.prompt_ids, admit_order=self.num_admitted)
        self.num_admitted += 1
        self.running[seq.request_id] = seq
        return seq

    # ---- preemption ----------------------------------------------------------

    def victim(self) -> Sequence:
        """The running sequence to preempt: the most recently admitted."""
        return max(self.running.values(), key=lambda s: s.admit_order)

    def preempt(self, seq: Sequence, now: float) -> None:
        """seq leaves the batch and gives its blocks back (its KV saved or not by the caller)."""
        del self.running[seq.request_id]
        seq.release(self.blocks)
        seq.num_preemptions += 1
        seq.preempted_at = now
        self.preempted.append(seq)
        self.preempted.sort(key=lambda s: s.admit_order)

    def blocks_to_resume(self, seq: Sequence) -> int:
        """Blocks for its cached tokens and its next position."""
        return num_blocks_for(seq.num_cached + 1, self.block_size)

    def next_resumable(self) -> Sequence | None:
        """The oldest preempted sequence, if a row and its blocks are free; while others
        run, the watermark stays free too, so it is not preempted again at once."""
        if not self.preempted or len(self.running) >= self.max_batch_size:
            return None
        seq = self.preempted[0]
        margin = self.watermark if self.running else 0
        return seq if self.blocks.can_allocate(self.blocks_to_resume(seq) + margin) else None

    def resume(self, seq: Sequence, now: float) -> list[int]:
        """seq runs again; its new blocks (for the caller to fill)."""
        self.preempted.remove(seq)
        seq.block_ids = self.blocks.allocate(self.blocks_to_resume(seq))
        seq.preempted_s += now - seq.preempted_at
        self.running[seq.request_id] = seq
        return seq.block_ids

    def drop_preempted(self, request_id: str) -> Sequence | None:
        """An aborted preempted sequence: it holds no blocks."""
        for seq in self.preempted:
            if seq.request_id == request_id:
                self.preempted.remove(seq)
                return seq
        return None

    def finish(self, request_id: str) -> Sequence:
        seq = self.running.pop(request_id)
        seq.release(self.blocks)
        return seq
