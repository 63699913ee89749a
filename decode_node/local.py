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
from dataclasses import dataclass, field

from common.base.request import LOCAL_CHUNK_TOKENS, LOCAL_SHARE, LOCAL_WINDOW_S, validate_prompt
from common.engine.worker import PrefillChunk
from common.kv.prefix import PrefixCache, block_hashes, num_reusable_blocks
from common.kv.sequence import Sequence
from common.wire.protocol import PrefillRequest


@dataclass
class LocalJob:
    request: PrefillRequest
    recv_time: float  # wall clock
    start_time: float = 0.0  # wall clock, at its first chunk
    block_ids: list[int] = field(default_factory=list)
    num_reserved: int = 0  # further blocks promised for its outputs
    num_computed: int = 0  # prompt tokens whose KV is written
    num_cached: int = 0  # of them, taken from the prefix cache

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)


@dataclass
class Prefilled:
    """A prompt done here: its sequence (running now), its first token and the stamps
    of its time to first token."""

    seq: Sequence
    token: int
    logprobs: object
    stamps: dict


class LocalPrefill:
    def __init__(self, worker, scheduler, max_queue: int):
        self.worker, self.scheduler, self.max_queue = worker, scheduler, max_queue
        self.waiting: deque[LocalJob] = deque()
        self.num_prefilled = 0
        self.num_tokens = 0  # prompt tokens computed here
        self.busy_s = 0.0  # in those passes
        self._owed = (0.0, time.monotonic())  # (seconds of local passes not paid back, when)

    def add(self, req: PrefillRequest, held_ids: set[str]) -> None:
        """A prompt routed here to prefill. ValueError: refused (said to the client)."""
        w = self.worker
        if req.forks:
            raise ValueError(
                "a decode node prefills one sequence per request (n > 1 goes through a prefill node)"
            )
        if req.params.num_prompt_logprobs >= 0 or req.params.is_masked_per_step:
            raise ValueError("prompt logprobs and grammars are prefilled on prefill nodes")
        req.params.validate(w.spec.vocab_size)
        validate_prompt(
            req.prompt_token_ids, req.params.max_tokens, w.spec.vocab_size, w.max_model_len
        )
        if req.request_id in held_ids:
            raise ValueError("a request of this id is already here")
        if len(self.waiting) >= self.max_queue:
            raise ValueError(
                f"{len(self.waiting)} prompts wait to be prefilled on this decode node"
            )
        why = self.scheduler.refusal_for_good(
            [req.request_id], len(req.prompt_token_ids), req.params.max_tokens
        )
        if why:
            raise ValueError(why)
        self.waiting.append(LocalJob(req, time.time()))

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
            or self.scheduler.refusal_for_now(job.prompt_len, job.request.params.max_tokens) is None
        )

    def owed_s(self) -> float:
        owed, when = self._owed
        return max(owed - (time.monotonic() - when) * LOCAL_SHARE, 0.0)

    def run(self) -> Prefilled | None:
        """One chunk of the first prompt in line (between steps: nothing on the device);
        the prompt done, its sequence joins the scheduler's running ones."""
        if not self.is_runnable():
            return None
        job = self.waiting[0]
        req, sched = job.request, self.scheduler
        if not job.block_ids:
            cached = self._match(list(req.prompt_token_ids))
            job.block_ids, job.num_reserved = sched.take_blocks(
                job.prompt_len, req.params.max_tokens, cached=cached
            )
            job.num_computed = job.num_cached = len(cached) * sched.block_size
            job.start_time = time.time()
        start, end = job.num_computed, min(job.prompt_len, job.num_computed + LOCAL_CHUNK_TOKENS)
        is_last = end == job.prompt_len
        chunk = PrefillChunk(
            list(req.prompt_token_ids[start:end]),
            start,
            job.block_ids,
            req.params if is_last else None,
        )
        if is_last and req.params.is_processing:
            chunk.history = req.params.split(list(req.prompt_token_ids))
        t0 = time.perf_counter()
        tokens, _ = self.worker.prefill([chunk])
        took = time.perf_counter() - t0
        self.busy_s += took
        if self.scheduler.running:  # NOTE: only the running sequences' time is owed
            self._owed = (self.owed_s() + took, time.monotonic())
        self.num_tokens += end - start
        job.num_computed = end
        if not is_last:
            return None
        self.waiting.popleft()
        self.num_prefilled += 1
        seq = sched.admit(
            Sequence(
                req.request_id,
                job.prompt_len,
                req.params,
                job.block_ids,
                job.num_reserved,
                prompt_ids=list(req.prompt_token_ids),
            )
        )
        done = time.time()
        stamps = {
            "arrival": req.arrival_time,
            "prefill_recv": job.recv_time,
            "prefill_start": job.start_time,
            "prefill_end": done,
            "decode_recv": done,
            "decode_admit": done,
            "cached_tokens": job.num_cached,
        }
        return Prefilled(seq, tokens[0], chunk.logprobs, stamps)

    def _match(self, prompt: list[int]) -> list[int]:
        """The blocks of the prompt's longest cached prefix (a finished turn's history), held now."""
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
