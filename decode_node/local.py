"""Prompts prefilled on the decode node itself (the frontend's --disaggregate auto routes a
prompt here when that gives its first tokens sooner than a handoff, decided per request
in frontend/paths.py).

A prompt here runs chunk by chunk between decode steps, with the node's own kernels,
into blocks taken as a reservation takes them, after the prefix the node's cache holds (a
finished sequence's full blocks, prompt and outputs, stay cached: a chat's next turn
finds its history here); its last chunk samples the first token,
and the sequence joins the batch as a committed handoff's does. A chunk is at most
LOCAL_CHUNK_TOKENS, so a running sequence's step waits for at most one chunk. Only the head
of the line runs: prompts here are short, and the first in is the first out.

While sequences run, local prompts take at most LOCAL_SHARE of the node's time, measured:
what their chunks took is owed and paid back at LOCAL_SHARE seconds a second, and no chunk
starts while more than LOCAL_SHARE * LOCAL_WINDOW_S is owed (passes while nothing runs owe
nothing). So however many prompts the frontend routes here (its rule routes by the same
share with predicted costs, frontend/paths.py), the node's own passes slow its running
sequences' steps by at most 1 / (1 - LOCAL_SHARE) over any stretch longer than the window.
"""

from __future__ import annotations

import time
from collections import deque

from common.base.request import LOCAL_CHUNK_TOKENS, LOCAL_SHARE, LOCAL_WINDOW_S, check_request
from common.engine.prefill_job import PrefillJob
from common.kv.prefix import PrefixCache, block_hashes, num_reusable_blocks
from common.kv.sequence import Sequence
from common.wire.protocol import PrefillRequest
from decode_node.scheduler import Joining


class LocalPrefill:
    def __init__(self, worker, scheduler, max_queue: int):
        self.worker, self.scheduler, self.max_queue = worker, scheduler, max_queue
        self.waiting: deque[PrefillJob] = deque()
        self.num_prefilled = 0
        self.num_tokens = 0  # prompt tokens computed here
        self.busy_s = 0.0  # in those passes
        self._owed = (0.0, time.monotonic())  # (seconds of local passes not paid back, when)

    def add(self, req: PrefillRequest, held_ids: set[str]) -> None:
        """A prompt routed here to prefill. ValueError: refused (said to the client)."""
        w = self.worker
        if req.forks:
            raise ValueError(
                "a decode node prefills one sequence per request "
                "(n > 1 goes through a prefill node)"
            )
        if req.params.num_prompt_logprobs >= 0 or req.params.is_masked_per_step:
            raise ValueError("prompt logprobs and grammars are prefilled on prefill nodes")
        check_request(
            [req.request_id],
            req.params,
            req.prompt_token_ids,
            w.spec.vocab_size,
            w.max_model_len,
            held_ids.__contains__,
        )
        if len(self.waiting) >= self.max_queue:
            raise ValueError(
                f"{len(self.waiting)} prompts wait to be prefilled on this decode node"
            )
        why = self.scheduler.refusal_for_good(
            [req.request_id], len(req.prompt_token_ids), req.params.max_tokens
        )
        if why:
            raise ValueError(why)
        self.waiting.append(PrefillJob.of(req, time.time()))

    def abort(self, request_id: str) -> bool:
        for job in self.waiting:
            if job.request_id == request_id:
                self.waiting.remove(job)
                self.scheduler.give_back(job.block_ids, job.num_reserved)
                return True
        return False

    def held_ids(self) -> list[str]:
        return [job.request_id for job in self.waiting]

    def is_runnable(self) -> bool:
        """Whether run() would compute a chunk now."""
        if not self.waiting or not self.scheduler.can_admit():
            return False
        if self.scheduler.running and self.owed_s() > LOCAL_SHARE * LOCAL_WINDOW_S:
            return False  # the running sequences' time: the share comes free as time passes
        job = self.waiting[0]
        return (
            bool(job.block_ids)
            or self.scheduler.refusal_for_now(job.prompt_len, job.params.max_tokens) is None
        )

    def owed_s(self) -> float:
        owed, when = self._owed
        return max(owed - (time.monotonic() - when) * LOCAL_SHARE, 0.0)

    def run(self) -> Joining | None:
        """One chunk of the first prompt in line (between steps: nothing on the device);
        the prompt done, its sequence joins the scheduler's running ones, and what its first
        update needs comes back."""
        if not self.is_runnable():
            return None
        job = self.waiting[0]
        sched = self.scheduler
        if not job.block_ids:
            cached = self._match(job.token_ids)
            job.block_ids, job.num_reserved = sched.take_blocks(
                job.prompt_len, job.params.max_tokens, cached=cached
            )
            job.num_computed = job.num_cached_tokens = len(cached) * sched.block_size
            job.start_time = time.time()
        chunk = job.chunk(
            job.num_computed, min(job.prompt_len, job.num_computed + LOCAL_CHUNK_TOKENS)
        )
        t0 = time.perf_counter()
        tokens, _ = self.worker.prefill([chunk])
        took = time.perf_counter() - t0
        self.busy_s += took
        if self.scheduler.running:  # NOTE: only the running sequences' time is owed
            self._owed = (self.owed_s() + took, time.monotonic())
        self.num_tokens += len(chunk.token_ids)
        job.num_computed = chunk.end
        if not chunk.is_last:
            return None
        self.waiting.popleft()
        self.num_prefilled += 1
        seq = sched.admit(
            Sequence(
                job.request_id,
                job.prompt_len,
                job.params,
                job.block_ids,
                job.num_reserved,
                prompt_ids=list(job.token_ids),
            )
        )
        done = time.time()
        stamps = {**job.ttft_stamps(done), "decode_recv": done, "decode_admit": done}
        return Joining(seq, tokens[0], chunk.logprobs, stamps)

    def _match(self, prompt: list[int]) -> list[int]:
        """The blocks of the prompt's longest cached prefix (a finished turn's history), held
        now."""
        cache, bs = self.scheduler.prefix_cache, self.scheduler.block_size
        if not isinstance(cache, PrefixCache):
            return []
        cached = cache.match(block_hashes(prompt, bs)[: num_reusable_blocks(len(prompt), bs)])
        cache.count(len(prompt), len(cached) * bs)
        return cached

    def stats(self) -> dict:
        cache = self.scheduler.prefix_cache
        return {
            "num_local_waiting": len(self.waiting),
            "num_local_prefilled": self.num_prefilled,
            "num_local_prefill_tokens": self.num_tokens,
            "local_prefill_busy_s": round(self.busy_s, 6),
            "local_owed_s": round(self.owed_s(), 6),
            **(cache.stats() if isinstance(cache, PrefixCache) else {}),
        }
