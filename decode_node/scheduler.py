"""Reservations and admission for the decode batch.

A handoff reserves first: the prompt's blocks are taken (their ids go back to
the prefill node, which writes into them) and every further block the request
could need is promised, so a running request never fails for lack of KV
blocks. A committed reservation waits for a free batch row; admission copies
nothing. A reservation not committed before its lease ends is freed.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from common.kv_cache import BlockAllocator, num_blocks_for
from common.protocol import KVCommit
from common.sequence import Sequence


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


class DecodeScheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch_size: int,
                 max_queue: int):
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.reservations: dict[str, Reservation] = {}   # reserved, not yet running
        self.ready: deque[str] = deque()                  # committed, waiting for a row
        self.running: dict[str, Sequence] = {}

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        """Every token written to the cache: the prompt and all outputs but the last."""
        return num_blocks_for(prompt_len + max_tokens - 1, self.block_size)

    def refusal(self, request_id: str, prompt_len: int, max_tokens: int) -> tuple[str, bool] | None:
        """(reason, is_retryable) if this request cannot be reserved now."""
        if request_id in self.running or request_id in self.reservations:
            return f"request {request_id!r} is already on this decode node", False
        need = self.blocks_needed(prompt_len, max_tokens)
        if need > self.allocator.capacity:
            return f"needs {need} KV blocks, this decode node has {self.allocator.capacity}", False
        if len(self.reservations) >= self.max_queue:
            return f"decode queue is full ({self.max_queue})", True
        if not self.allocator.can_allocate(need):
            return f"needs {need} KV blocks, {self.allocator.num_available} are free now", True
        return None

    def reserve(self, request_id: str, sender: bytes, prompt_len: int, max_tokens: int,
                lease_s: float) -> Reservation:
        need = self.blocks_needed(prompt_len, max_tokens)
        num_prompt = num_blocks_for(prompt_len, self.block_size)
        block_ids = self.allocator.allocate(num_prompt)
        self.allocator.reserve(need - num_prompt)
        r = Reservation(request_id, sender, prompt_len, max_tokens, block_ids, need - num_prompt,
                        time.monotonic() + lease_s)
        self.reservations[request_id] = r
        return r

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
        self.allocator.free(r.block_ids)
        self.allocator.unreserve(r.num_reserved)
        r.block_ids, r.num_reserved = [], 0
        return r

    def expired(self, now: float) -> list[str]:
        return [rid for rid, r in self.reservations.items() if r.commit is None and now > r.deadline]

    def has_admissible(self, is_landed) -> bool:
        return bool(self.ready) and len(self.running) < self.max_batch_size and is_landed(self.ready[0])

    def next_admissible(self, is_landed) -> Reservation | None:
        """The oldest committed reservation whose blocks have landed, if a row is free
        (FIFO: nothing overtakes it)."""
        if not self.has_admissible(is_landed):
            return None
        return self.reservations.pop(self.ready.popleft())

    def start(self, r: Reservation) -> Sequence:
        """A committed reservation becomes a running sequence with the same blocks."""
        seq = Sequence(r.request_id, r.prompt_len, r.commit.params, r.block_ids, r.num_reserved)
        self.running[seq.request_id] = seq
        return seq

    def finish(self, request_id: str) -> Sequence:
        seq = self.running.pop(request_id)
        seq.release(self.allocator)
        return seq
