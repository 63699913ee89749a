"""Admission for the decode batch.

Handoffs wait in a bounded queue (their KV on the host) until the batch has a
free row and the pool can reserve every block the request will ever need, so a
running request never fails for lack of KV blocks.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from common.kv_cache import BlockAllocator, num_blocks_for
from common.protocol import KVHandoff
from common.sequence import Sequence


@dataclass
class Arrival:
    handoff: KVHandoff
    recv_time: float = field(default_factory=time.time)


class DecodeScheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch_size: int,
                 max_queue: int):
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.queue: deque[Arrival] = deque()
        self.running: dict[str, Sequence] = {}

    def blocks_needed(self, handoff: KVHandoff) -> int:
        return num_blocks_for(handoff.prompt_len + handoff.params.max_tokens - 1, self.block_size)

    def refusal(self, handoff: KVHandoff) -> tuple[str, bool] | None:
        """(reason, is_retryable) if this handoff cannot be queued now."""
        if handoff.request_id in self.running or any(
                a.handoff.request_id == handoff.request_id for a in self.queue):
            return f"request {handoff.request_id!r} is already on this decode node", False
        if self.blocks_needed(handoff) > self.allocator.capacity:
            return (f"needs {self.blocks_needed(handoff)} KV blocks, this decode node has "
                    f"{self.allocator.capacity}"), False
        if len(self.queue) >= self.max_queue:
            return f"decode queue is full ({self.max_queue})", True
        return None

    def enqueue(self, handoff: KVHandoff) -> None:
        self.queue.append(Arrival(handoff))

    def has_admissible(self) -> bool:
        return bool(self.queue) and len(self.running) < self.max_batch_size and \
            self.allocator.can_allocate(self.blocks_needed(self.queue[0].handoff))

    def next_admissible(self) -> Arrival | None:
        """The head of the queue if it fits now (FIFO: nothing overtakes it)."""
        if not self.queue or len(self.running) >= self.max_batch_size:
            return None
        if not self.allocator.can_allocate(self.blocks_needed(self.queue[0].handoff)):
            return None
        return self.queue.popleft()

    def start(self, arrival: Arrival) -> Sequence:
        """Reserve every block the request will need and take those its prompt fills."""
        h = arrival.handoff
        seq = Sequence(h.request_id, h.prompt_len, h.params)
        seq.num_reserved = self.blocks_needed(h)
        self.allocator.reserve(seq.num_reserved)
        for _ in range(num_blocks_for(h.prompt_len, self.block_size)):
            seq.take_reserved_block(self.allocator)
        self.running[seq.request_id] = seq
        return seq

    def drop_queued(self, request_id: str) -> bool:
        for a in self.queue:
            if a.handoff.request_id == request_id:
                self.queue.remove(a)
                return True
        return False

    def finish(self, request_id: str) -> Sequence:
        seq = self.running.pop(request_id)
        seq.release(self.allocator)
        return seq
