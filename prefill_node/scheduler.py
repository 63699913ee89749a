"""Which prompt chunks go into the next prefill pass.

A prompt takes blocks for its whole length when it starts: first the longest
run of its full blocks already in the prefix cache (computed for an earlier
prompt), then new blocks for the rest, which is all it computes. A prompt
longer than the token budget runs in chunks across passes; each full block
computed is published to the cache. When the pool cannot hold the next prompt
(blocks still wait for a handoff to be confirmed), no new prompt starts:
backpressure, not failure.

A prompt starts once its decode node has reserved blocks for it. NOTE:
otherwise prompts computed for a full decode node could fill this pool while
that node's blocks are reserved for prompts waiting here: each side would wait
for the other. The one exception keeps a light load from waiting a round trip:
a prompt whose decode node granted the previous request at once may start
before its own answer, one such prompt at a time and only while it takes at
most half the free blocks, so the pool never fills with them.
"""

from __future__ import annotations

import time
from collections import deque

from common.engine.prefill_job import PrefillChunk, PrefillJob
from common.kv.blocks import num_blocks_for
from common.kv.prefix import PrefixCache, block_hashes, num_reusable_blocks


class PrefillScheduler:
    def __init__(
        self, prefix_cache: PrefixCache, block_size: int, token_budget: int, max_batch_prompts: int
    ):
        self.prefix_cache = prefix_cache
        self.block_size = block_size
        self.token_budget = token_budget
        self.max_batch_prompts = max_batch_prompts
        self.waiting: deque[PrefillJob] = deque()
        self.prefilling: list[PrefillJob] = []  # started, not yet complete
        self.early: PrefillJob | None = None  # the last prompt started before its reservation

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_unreserved(self) -> int:
        """Waiting prompts whose decode node has no blocks for them yet."""
        return sum(not j.is_reserved for j in self.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Prompt tokens not yet computed, waiting or part-way through."""
        return sum(j.prompt_len for j in self.waiting) + sum(
            j.prompt_len - j.num_computed for j in self.prefilling
        )

    def fits_at_all(self, prompt_len: int) -> bool:
        return num_blocks_for(prompt_len, self.block_size) <= self.prefix_cache.capacity

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
                self.prefix_cache.free(job.block_ids)
                job.block_ids = []
                return job
        return None

    def schedule(self) -> list[PrefillChunk]:
        budget = self.token_budget
        chunks: list[PrefillChunk] = []
        for job in self.prefilling:  # finish what was started first
            if budget == 0 or len(chunks) == self.max_batch_prompts:
                break
            end = min(job.prompt_len, job.num_computed + budget)
            chunks.append(job.chunk(job.num_computed, end))
            budget -= end - job.num_computed
        for job in list(self.waiting):  # in arrival order, passing those not reserved yet
            if budget == 0 or len(chunks) == self.max_batch_prompts:
                break
            if (
                job.is_compiling
                or not job.is_reserved
                and not (job.is_peer_granting and self._is_early_free())
            ):
                continue
            bs = self.block_size
            if not job.hashes:
                job.hashes = block_hashes(job.token_ids, bs)
            # NOTE: prompt logprobs need every position computed: no cached prefix.
            cached = (
                self.prefix_cache.match(job.hashes[: num_reusable_blocks(job.prompt_len, bs)])
                if job.params.num_prompt_logprobs < 0
                else []
            )
            need = num_blocks_for(job.prompt_len, bs) - len(cached)
            if not self.prefix_cache.can_allocate(need if job.is_reserved else 2 * need):
                self.prefix_cache.free(cached)
                if not job.is_reserved:
                    continue
                break  # backpressure: wait for handoffs to free blocks
            if not job.is_reserved:
                self.early = job
            self.waiting.remove(job)
            job.block_ids = cached + self.prefix_cache.allocate(need)
            job.num_computed = job.num_cached_tokens = len(cached) * bs
            job.num_published = len(cached)
            self.prefix_cache.count(job.prompt_len, job.num_cached_tokens)
            job.start_time = time.time()
            self.prefilling.append(job)
            end = min(job.prompt_len, job.num_computed + budget)
            chunks.append(job.chunk(job.num_computed, end))
            budget -= end - job.num_computed
        return chunks

    def _is_early_free(self) -> bool:
        """No prompt started before its reservation still holds blocks here unreserved."""
        e = self.early
        return e is None or e.is_reserved or not e.block_ids

    def complete(self, chunks: list[PrefillChunk]) -> list[PrefillJob]:
        """Record a pass; return the jobs whose whole prompt is now in the cache."""
        done = []
        for c in chunks:
            job = c.job
            job.num_computed = c.end
            for i in range(job.num_published, min(c.end // self.block_size, len(job.hashes))):
                self.prefix_cache.publish(job.block_ids[i], job.hashes[i])
            job.num_published = max(job.num_published, c.end // self.block_size)
            if c.is_last:
                self.prefilling.remove(job)
                done.append(job)
        return done
