"""The prefill node: receive -> schedule -> forward -> sample -> hand off, in one loop.

Each request names its decode node. Its reservation there is asked for when
the request arrives; once the prompt's KV is computed, the transfer backend
writes the blocks into the reserved ones and the commit follows
(common/handoff/sender.py). The first token goes to the frontend as soon as it
is sampled, so the client sees it while the KV is on its way.
A prompt's blocks stay allocated here until that write has completed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

from common import transfer
from common.base import grammar
from common.base.config import PrefillConfig, check_endpoint
from common.base.log import IdleQuiet, Throttle, get_logger
from common.base.request import stop_reason, validate_prompt
from common.engine.worker import DeviceWorker, PrefillChunk
from common.handoff.sender import Sender
from common.kv.blocks import block_bytes, cache_block_size
from common.kv.prefix import PrefixCache
from common.runtime import report_line
from common.runtime.node import NodeRuntime
from common.runtime.prefix_report import PrefixReport
from common.runtime.process import StopEvent, describe_threads
from common.wire.channel import BadMessage, Channel, LinkError, Poller
from common.wire.protocol import (
    FRONTEND_TO_NODE,
    NodeAbort,
    NodeReady,
    NodeSync,
    NodeSynced,
    PrefillRequest,
    RequestFailed,
    TokenBatch,
    TokenUpdate,
    ttft_parts,
)
from prefill_node.scheduler import PrefillJob, PrefillScheduler, ScheduledChunk

MIN_PASS_TOKENS = 256  # a pass bounded in time still holds this many (a matmul's rate falls below)
log = get_logger("prefill")
noisy = Throttle(log)  # lines about what peers send


class PrefillNode:
    def __init__(self, cfg: PrefillConfig):
        self.cfg = cfg
        self.worker = DeviceWorker(cfg.worker)
        self.num_failed = 0
        self.compiles = grammar.Compiles(
            lambda: grammar.for_model(cfg.worker.model, self.worker.spec.vocab_size)
        )
        self._last_log = 0.0
        self.quiet = IdleQuiet()  # the periodic line: while busy, and once as it goes idle
        self._log_tokens = 0
        self._pass_rate: float | None = None  # prompt tokens/s of recent passes (smoothed)

    # ---- the loop ---------------------------------------------------------

    def run(self, stop: StopEvent) -> int:
        """Serve until stopped; the process's exit code (1: refused by the frontend)."""
        rt = self.runtime = NodeRuntime(
            "prefill",
            self.cfg.name,
            self.cfg.frontend_endpoint,
            self.cfg.keys_dir,
            self.cfg.links,
            stop,
            log,
            self.cfg.drain_timeout_s,
        )
        self.frontend = rt.frontend
        self._poller = Poller(self.frontend)
        try:
            with (
                self.worker,
                contextlib.ExitStack() as parts,
            ):  # parts close as they were made, last first
                self.prefix_cache = PrefixCache(
                    self.worker.num_kv_blocks, self.cfg.is_prefix_caching
                )
                self.prefix_report = PrefixReport(
                    self.cfg.name, self.prefix_cache, rt, self.cfg.is_prefix_caching
                )
                self.scheduler = PrefillScheduler(
                    self.prefix_cache,
                    self.worker.block_size,
                    self.cfg.token_budget,
                    self.cfg.max_batch_prompts,
                )
                cache = self.worker.kv_cache
                self.handoffs = Sender(
                    name=self.cfg.name,
                    handoff_lease_s=self.cfg.handoff_lease_s,
                    block_size=cache_block_size(cache.shape),
                    block_bytes=block_bytes(cache),
                    connect=self._connect,
                    open_writer=lambda w, send: transfer.open_writer(
                        self.cfg.kv_transfer, w, cache, send
                    ),
                    free_blocks=self.prefix_cache.free,
                    drop_job=self._drop_job,
                    fail=self._fail,
                    checksums=(lambda ids: transfer.block_checksums(cache, ids))
                    if self.cfg.is_kv_verified
                    else None,
                    num_layers=cache.shape[0],
                    layerwise=self.cfg.kv_layerwise,
                )
                parts.callback(self.handoffs.close)
                parts.callback(self.compiles.close)
                rt.start(self._send_ready, self.stats, self._is_empty)
                log.info(
                    "ready on %s (%s): %d KV blocks (%d tokens), token budget %d, KV transfer %s",
                    self.cfg.worker.device,
                    describe_threads(self.worker.num_threads),
                    self.prefix_cache.capacity,
                    self.worker.token_capacity,
                    self.cfg.token_budget,
                    self.cfg.kv_transfer,
                )
                while not stop.is_set():
                    # Writes are polled; reservations (which let prompts start), acks (which
                    # free blocks) and retries come by message or within 50 ms.
                    # NOTE: a write that only waits on its peer (a link refusing frames) is
                    # polled every 5 ms, not in a spin.
                    is_busy = bool(self.scheduler.prefilling or self.handoffs.is_writing)
                    self._receive(0 if is_busy else 0.005 if self.handoffs.by_id else 0.02)
                    self.handoffs.advance()
                    self._take_compiled()
                    chunks = self.scheduler.schedule()
                    if chunks:
                        self._forward(chunks)
                        # NOTE: what arrived during the pass first: an answer read only after
                        # its deadline is judged by when it is read, and a long pass on a slow
                        # host would fail reservations that were answered in time.
                        self._receive(0)
                        self.handoffs.advance()
                    self._report()
        finally:
            rt.close()
            rt.term()
        return rt.exit_code

    # ---- receive ----------------------------------------------------------

    def _receive(self, timeout_s: float) -> None:
        # NOTE: a data connection a write waits on wakes the loop when it can take more KV
        for ch in self._poller.wait(timeout_s, self.handoffs.links.waiting_to_send()):
            if ch is self.frontend:
                self._receive_all()
            else:
                self.handoffs.receive(ch)

    def _receive_all(self) -> None:
        while self.frontend.has_message():
            _, msg = self.frontend.recv(FRONTEND_TO_NODE)
            if self.runtime.on_control(msg):
                continue
            if isinstance(msg, BadMessage):
                noisy.warning("dropped a malformed message: %s", msg.error)
                if msg.request_id:
                    self._fail(msg.request_id, f"malformed prefill message: {msg.error}")
            elif isinstance(msg, PrefillRequest):
                self._accept(msg)
            elif isinstance(msg, NodeAbort):
                self.handoffs.abort(msg.request_id)
            elif isinstance(msg, NodeSync):
                passed = self.handoffs.handed_off  # every request here has its handoff
                self.runtime.send(
                    NodeSynced(
                        msg.sync_id,
                        [
                            r
                            for r in msg.request_ids
                            if not self.handoffs.holds(r) and r not in passed
                        ],
                        [r for r in msg.request_ids if r in passed],
                    )
                )

    def _accept(self, req: PrefillRequest) -> None:
        try:
            req.params.validate(self.worker.spec.vocab_size)
            validate_prompt(
                req.prompt_token_ids,
                req.params.max_tokens,
                self.worker.spec.vocab_size,
                self.worker.max_model_len,
            )
            if not self.scheduler.fits_at_all(len(req.prompt_token_ids)):
                raise ValueError(
                    f"prompt of {len(req.prompt_token_ids)} tokens exceeds this "
                    f"prefill node's KV cache ({self.worker.token_capacity} tokens)"
                )
            check_endpoint("decode_kv_endpoint", req.decode_kv_endpoint, self.cfg.allow_remote)
            ids = [req.request_id, *(f.request_id for f in req.forks)]
            if len(set(ids)) != len(ids) or any(self.handoffs.holds(r) for r in ids):
                raise ValueError("a request of this id is already here")
            job = PrefillJob(
                req.request_id,
                list(req.prompt_token_ids),
                req.params,
                req.arrival_time,
                req.decode_node,
                req.decode_kv_endpoint,
                forks=list(req.forks),
            )
            self.handoffs.begin(job)  # the reservation comes back while the prompt waits or runs
            if req.params.grammar:  # compiled beside the loop; the prompt waits for it
                self.compiles.submit(job.request_id, req.params.grammar)
                job.is_compiling = True
        except (ValueError, LinkError) as e:
            for rid in {req.request_id, *(f.request_id for f in req.forks)}:
                self._fail(rid, str(e))
            return
        self.scheduler.add(job)

    def _connect(self, name: str, endpoint: str, suffix: str, max_queued: int | None) -> Channel:
        """A connection of the KV link to a decode node (common/handoff/links.py); with keys,
        it must prove the key of the name the frontend chose."""
        tag = self.runtime.tag + (f"/{suffix}" if suffix else "")
        ch = Channel(
            self.runtime.ctx,
            False,
            endpoint,
            tag=tag,
            is_immediate=True,
            max_message_bytes=self.cfg.links.max_message_bytes,
            server=name,
            max_queued=max_queued,
        )
        self._poller.add(ch)
        return ch

    def _drop_job(self, job: PrefillJob) -> None:
        """A handoff ended before its write: the prompt leaves the scheduler (waiting or
        part-way) and its blocks are freed."""
        if self.scheduler.abort(job.request_id) is None and job.block_ids:
            self.prefix_cache.free(job.block_ids)
        job.block_ids = []
        self.compiles.drop(job.request_id)

    def _take_compiled(self) -> None:
        """Prompts whose grammar has compiled may start; one that does not compile fails."""
        for job in [j for j in self.scheduler.waiting if j.is_compiling]:
            if not self.compiles.is_done(job.request_id):
                continue
            try:
                job.grammar, job.is_compiling = self.compiles.take(job.request_id), False
            except ValueError as e:  # GrammarError, said to the client
                ids = [job.request_id, *(f.request_id for f in job.forks)]
                for rid in ids:
                    self.handoffs.abort(rid)
                for rid in ids:
                    self._fail(rid, str(e))

    # ---- forward and hand off ----------------------------------------------

    def _forward(self, chunks: list[ScheduledChunk]) -> None:
        batch = [self._chunk(c) for c in chunks]
        finished = [c.job for c in chunks if c.is_last]
        # The KV writes of finished prompts start during the pass (layer by layer, and a
        # chunked prompt's chunk by chunk: (job, the blocks it completes)) or right behind it,
        # before the first tokens are sampled, so their commits go out at once.
        bs = self.worker.block_size
        parts = [(c.job, None if c.is_last else c.end // bs) for c in chunks]
        started = time.perf_counter()
        tokens, _ = self.worker.prefill(
            batch,
            on_kv_queued=lambda: self.handoffs.start_writes(finished),
            on_layers=(lambda idx, n: self.handoffs.push_layers([parts[i] for i in idx], n))
            if self.cfg.kv_layerwise != "off"
            else None,
        )
        num_tokens = sum(c.end - c.start for c in chunks)
        self._log_tokens += num_tokens
        self._bound_pass(num_tokens, time.perf_counter() - started)
        done_at = time.time()
        early = []
        for c, pc, token in zip(chunks, batch, tokens):
            job = c.job
            if pc.prompt_logprobs is not None:
                job.prompt_logprobs += pc.prompt_logprobs
            if c.is_last:
                stamps = {
                    "arrival": job.arrival_time,
                    "prefill_recv": job.recv_time,
                    "prefill_start": job.start_time,
                    "prefill_end": done_at,
                    "cached_tokens": job.num_cached_tokens,
                }  # a count riding with the stamps
                for f, t, lp in zip(job.forks, pc.fork_tokens, pc.fork_logprobs):
                    f.first_token, f.first_logprobs = t, lp
                self.handoffs.set_first_token(job, token, stamps, pc.logprobs)
                prompt_logprobs = (
                    job.prompt_logprobs if job.params.num_prompt_logprobs >= 0 else None
                )
                # The first token streams now, while its KV travels; one that ends the
                # request is left to the decode node, which ends it (the prompt's
                # logprobs go now all the same). Each fork's likewise.
                # NOTE: the prompt's logprobs go once, with the request's own update (the
                # frontend gives them to its other choices): n copies could pass the link's
                # message limit, and that would drop the link.
                for rid, t, lp in [
                    (job.request_id, token, pc.logprobs),
                    *((f.request_id, f.first_token, f.first_logprobs) for f in job.forks),
                ]:
                    if (
                        stop_reason(
                            job.params,
                            t,
                            1,
                            job.prompt_len,
                            self.worker.spec.eos_token_ids,
                            self.worker.max_model_len,
                        )
                        is None
                    ):
                        early.append(
                            TokenUpdate(
                                rid,
                                [t],
                                None,
                                ttft_parts(stamps),
                                index=0,
                                logprobs=[lp] if lp else None,
                                prompt_logprobs=prompt_logprobs,
                            )
                        )
                    elif prompt_logprobs is not None:
                        early.append(
                            TokenUpdate(rid, [], None, index=0, prompt_logprobs=prompt_logprobs)
                        )
                    prompt_logprobs = None
        if early and not self.frontend.send(TokenBatch(early), block=False):
            noisy.warning(
                "could not stream %d first tokens early: the decode nodes will", len(early)
            )
        self.scheduler.complete(chunks)

    def _bound_pass(self, num_tokens: int, elapsed_s: float) -> None:
        """The next passes' token budget: what this node computes in --max-pass-time at the
        rate measured (smoothed), within [MIN_PASS_TOKENS, --token-budget]. NOTE: a pass is
        a stretch in which the node answers nothing; on a slow host the full budget would be
        tens of seconds, past its leases, and every prompt in it waits for the whole pass."""
        if self.cfg.max_pass_s <= 0 or num_tokens < MIN_PASS_TOKENS // 4 or elapsed_s <= 0:
            return
        rate = num_tokens / elapsed_s
        self._pass_rate = rate if self._pass_rate is None else (self._pass_rate + rate) / 2
        bs = self.worker.block_size
        fit = int(self._pass_rate * self.cfg.max_pass_s) // bs * bs
        budget = max(min(fit, self.cfg.token_budget), min(MIN_PASS_TOKENS, self.cfg.token_budget))
        if abs(budget - self.scheduler.token_budget) * 4 >= self.scheduler.token_budget:
            log.info(
                "token budget per pass %d -> %d (%.0f prompt tokens/s measured, passes of at most "
                "%.1fs)",
                self.scheduler.token_budget,
                budget,
                self._pass_rate,
                self.cfg.max_pass_s,
            )
        self.scheduler.token_budget = budget

    def _chunk(self, c: ScheduledChunk) -> PrefillChunk:
        """What the worker computes of a scheduled chunk: its first token if it is the
        prompt's last (with the history its penalties need), the logprobs of its prompt
        tokens if they were asked for."""
        job = c.job
        chunk = PrefillChunk(
            job.token_ids[c.start : c.end],
            c.start,
            job.block_ids,
            job.params if c.is_last else None,
        )
        if c.is_last:
            chunk.fork_params = [dataclasses.replace(job.params, seed=f.seed) for f in job.forks]
        if c.is_last and job.params.is_processing:
            chunk.history = job.params.split(job.token_ids)
        if c.is_last and job.params.is_masked_per_step:  # after any tokens streamed before a move
            chunk.mask = (
                grammar.matcher_for(
                    job.params,
                    chunk.history[1],
                    self.worker.spec.vocab_size,
                    self.compiles.grammars,
                    job.grammar,
                )
                .fill()
                .clone()
            )
        if job.params.num_prompt_logprobs >= 0:
            chunk.prompt_targets = job.token_ids[c.start + 1 : c.end + 1] + (
                [-1] if c.is_last else []
            )
            chunk.num_prompt_logprobs = job.params.num_prompt_logprobs
        return chunk

    def _fail(self, request_id: str, error: str, is_retryable: bool = False) -> None:
        self.num_failed += 1
        noisy.warning("request %s failed: %s", request_id, error)
        if not self.frontend.send(RequestFailed(request_id, error, is_retryable), block=False):
            log.error("could not tell the frontend that %s failed", request_id)

    # ---- report -------------------------------------------------------------

    def _send_ready(self) -> bool:
        w = self.worker
        return self.frontend.send(
            NodeReady(
                "prefill",
                self.cfg.name,
                os.getpid(),
                self.runtime.epoch,
                self.cfg.worker.device,
                w.num_kv_blocks,
                w.block_size,
                w.max_model_len,
                kv_transfer=self.cfg.kv_transfer,
            ),
            block=False,
        )

    def _is_empty(self) -> bool:
        return not (self.scheduler.waiting or self.scheduler.prefilling or self.handoffs.by_id)

    def stats(self) -> dict:
        return {
            **self.worker.stats(),
            "num_waiting": self.scheduler.num_waiting,
            "num_unreserved": self.scheduler.num_unreserved,
            "num_waiting_tokens": self.scheduler.num_waiting_tokens,
            "num_prefilling": len(self.scheduler.prefilling),
            "num_pending_handoffs": self.handoffs.num_pending,
            "num_handoffs": self.handoffs.num_handoffs,
            "num_kv_bytes_written": self.handoffs.bytes_written,
            "num_failed": self.num_failed,
            "num_free_blocks": self.prefix_cache.num_free,
            "pass_token_budget": self.scheduler.token_budget,
            "num_bad_messages": self.frontend.num_bad + self.handoffs.num_bad,
            "num_link_resets": self.runtime.num_link_resets + self.handoffs.num_link_resets,
            "num_writing": sum(
                h.stage.value in ("writing", "cancelling") for h in self.handoffs.by_id.values()
            ),
            "is_registered": self.runtime.is_registered,
            **self.prefix_cache.stats(),
            "num_usable_blocks": self.prefix_cache.capacity,
            "kv_links": self.handoffs.links.describe(),
            "kv_writes": self.handoffs.transfer_figures(),
            # what the frontend's --disaggregate auto reads (frontend/paths.py)
            "kv_token_bytes": self.handoffs.block_bytes // self.handoffs.block_size,
            "kv_layerwise": self.cfg.kv_layerwise,
        }

    def _report(self) -> None:
        now = time.monotonic()
        self.runtime.turn()
        self.prefix_report.turn()
        if now - self._last_log >= self.cfg.links.log_interval_s:
            elapsed = now - self._last_log if self._last_log else 0.0
            is_busy, line = report_line.prefill(self.stats(), self._log_tokens, elapsed)
            if self.quiet.says(is_busy):
                log.info("%s", line)
            self._last_log, self._log_tokens = now, 0
