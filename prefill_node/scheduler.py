"""Which prompt chunks go into the next prefill pass.

A prompt takes blocks for its whole length when it starts; a prompt longer
than the token budget runs in chunks across passes. When the pool cannot hold
the next prompt (blocks still wait for a handoff to be confirmed), no new
prompt starts: backpressure, not failure.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from common.kv_cache import BlockAllocator, num_blocks_for
from common.sampling import SamplingParams


@dataclass
class PrefillJob:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival_time: float            # at the frontend (wall clock)
    decode_node: str               # where its KV goes
    decode_kv_endpoint: str
    recv_time: float = field(default_factory=time.time)
    start_time: float | None = None
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.token_ids)


@dataclass
class ScheduledChunk:
    job: PrefillJob
    start: int
    end: int

    @property
    def is_last(self) -> bool:
        return self.end == self.job.prompt_len


class PrefillScheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, token_budget: int,
                 max_batch_prompts: int):
        self.allocator = allocator
        self.block_size = block_size
        self.token_budget = token_budget
        self.max_batch_prompts = max_batch_prompts
        self.waiting: deque[PrefillJob] = deque()
        self.prefilling: list[PrefillJob] = []   # started, not yet complete

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Prompt tokens not yet computed, waiting or part-way through."""
        return sum(j.prompt_len for j in self.waiting) + \
            sum(j.prompt_len - j.num_computed for j in self.prefilling)

    def fits_at_all(self, prompt_len: int) -> bool:
        return num_blocks_for(prompt_len, self.block_size) <= self.allocator.capacity

    def add(self, job: PrefillJob) -> None:
        self.waiting.append(job)

    def abort(self, request_id: str) -> PrefillJob | None:
        """Drop a waiting or half-done prompt; its blocks go back to the pool."""
        for job in list(self.waiting):
            if job.request_id == request_id:
                self.waiting.remove(job)
                return job
        for job in self.prefilling:
            if job.request_id == request_id:
                self.prefilling.remove(job)
                self.allocator.free(job.block_ids)
                job.block_ids = []
                return job
        return None

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.token_budget
        chunks: list[ScheduledChunk] = []
        for job in self.prefilling:  # finish what was started first
            if budget == 0 or len(chunks) == self.max_batch_prompts:
                break
            end = min(job.prompt_len, job.num_computed + budget)
            chunks.append(ScheduledChunk(job, job.num_computed, end))
            budget -= end - job.num_computed
        while self.waiting and budget > 0 and len(chunks) < self.max_batch_prompts:
            job = self.waiting[0]
            need = num_blocks_for(job.prompt_len, self.block_size)
            if not self.allocator.can_allocate(need):
                break  # backpressure: wait for handoffs to free blocks
            self.waiting.popleft()
            job.block_ids = self.allocator.allocate(need)
            job.start_time = time.time()
            self.prefilling.append(job)
            end = min(job.prompt_len, budget)
            chunks.append(ScheduledChunk(job, 0, end))
            budget -= end
        return chunks

    def complete(self, chunks: list[ScheduledChunk]) -> list[PrefillJob]:
        """Record a pass; return the jobs whose whole prompt is now in the cache."""
        done = []
        for c in chunks:
            c.job.num_computed = c.end
            if c.is_last:
                self.prefilling.remove(c.job)
                done.append(c.job)
        return done
