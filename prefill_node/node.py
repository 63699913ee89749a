"""The prefill node: receive -> schedule -> forward -> sample -> hand off, in one loop.

Each request names its decode node. Its reservation there is asked for when
the request arrives; once the prompt's KV is computed, the transfer backend
writes the blocks into the reserved ones and the commit follows
(common/handoff/sender.py). The first token goes to the frontend as soon as it
is sampled, so the client sees it while the KV is on its way.
A prompt's blocks stay allocated here until that write has completed.
"""

from __future__ import annotations

import os
import time

from common import transfer
from common.base import grammar
from common.base.config import PrefillConfig, check_endpoint
from common.base.log import Throttle, get_logger
from common.base.request import check_request
from common.engine.kv_cache import format_name
from common.engine.prefill_job import PrefillChunk, PrefillJob
from common.engine.worker import DeviceWorker
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
)
from prefill_node.first_tokens import first_token_updates
from prefill_node.grammars import PrefillGrammars
from prefill_node.pass_budget import PassBudget
from prefill_node.scheduler import PrefillScheduler

log = get_logger("prefill")
noisy = Throttle(log)  # lines about what peers send


class PrefillNode:
    def __init__(self, cfg: PrefillConfig):
        self.cfg = cfg
        self.worker = DeviceWorker(cfg.worker).prepare()  # the weights and the KV cache, once
        vocab_size = self.worker.spec.vocab_size
        self.grammars = PrefillGrammars(
            lambda: grammar.for_model(cfg.worker.model, vocab_size), vocab_size
        )
        self.prefix_cache = PrefixCache(self.worker.num_kv_blocks, cfg.is_prefix_caching)
        self.scheduler = PrefillScheduler(
            self.prefix_cache, self.worker.block_size, cfg.token_budget, cfg.max_batch_prompts
        )
        self.pass_budget = PassBudget(cfg.token_budget, cfg.max_pass_s, self.worker.block_size)
        cache = self.worker.kv_cache
        self.handoffs = Sender(
            name=cfg.name,
            handoff_lease_s=cfg.handoff_lease_s,
            block_size=cache_block_size(cache.shape),
            block_bytes=block_bytes(cache),
            connect=self._connect,
            open_writer=lambda w, send: transfer.open_writer(cfg.kv_transfer, w, cache, send),
            free_blocks=self.prefix_cache.free,
            drop_job=self._drop_job,
            fail=self._fail,
            checksums=(lambda ids, wire: transfer.block_checksums(cache, ids, wire))
            if cfg.is_kv_verified
            else None,
            num_layers=cache.shape[0],
            layerwise=cfg.kv_layerwise,
            wire_dtype=cfg.kv_wire_dtype,
            prefill_s=self.pass_budget.seconds_for,
        )
        # Made by run(), on its thread (_open_frontend): the frontend's channel and the rest
        # that rides on its ZeroMQ context.
        self.runtime: NodeRuntime | None = None
        self.frontend: Channel | None = None
        self._poller: Poller | None = None
        self.prefix_report: PrefixReport | None = None
        self.num_failed = 0
        self.line = report_line.PeriodicLine(log, cfg.links.log_interval_s)
        self._log_tokens = 0  # prompt tokens since the last line

    # ---- the loop ---------------------------------------------------------

    def run(self, stop: StopEvent) -> int:
        """Serve until stopped; the process's exit code (1: refused by the frontend)."""
        try:
            self._open_frontend(stop)
            while not stop.is_set():
                self.turn()
        finally:
            self._close()
        return self.runtime.exit_code

    def turn(self) -> None:
        """Take what arrived, start the prompts that may, run a pass over their chunks, hand
        its first tokens on, and report."""
        self._receive(self._poll_timeout_s())
        self._admit()
        chunks = self.scheduler.schedule()
        if chunks:
            first_tokens = self._forward(chunks)
            self._send(self._collect(chunks, first_tokens))
            self._catch_up()
        self._report()

    def _open_frontend(self, stop: StopEvent) -> None:
        """The frontend's channel, registration and heartbeat (NodeRuntime), the poller the
        turn waits on, and the prefix-cache report sent over that channel; then ready.
        NOTE: made here, not in __init__: ZeroMQ sockets belong to the thread that uses them,
        and this context is closed by run(), once every socket on it is."""
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
        self.prefix_report = PrefixReport(
            self.cfg.name, self.prefix_cache, rt, self.cfg.is_prefix_caching
        )
        rt.start(self._send_ready, self.stats, self._is_empty)
        log.info(
            "ready on %s (%s): %d KV blocks (%d tokens in %s), token budget %d, KV transfer %s; %s",
            self.cfg.worker.device,
            describe_threads(self.worker.num_threads),
            self.prefix_cache.capacity,
            self.worker.token_capacity,
            format_name(str(self.worker.kv_cache.dtype).removeprefix("torch.")),
            self.cfg.token_budget,
            self.cfg.kv_transfer,
            self.worker.describe_kernels(),
        )

    def _close(self) -> None:
        """The grammar compiles, the handoffs (their KV links), the worker, then the
        frontend's channel and the ZeroMQ context, once every socket on it is closed."""
        self.grammars.close()
        self.handoffs.close()
        self.worker.close()
        if self.runtime is not None:
            self.runtime.close()
            self.runtime.term()

    def _poll_timeout_s(self) -> float:
        """How long the turn may wait for a message. Writes are polled; reservations (which
        let prompts start), acks (which free blocks) and retries come by message.
        NOTE: a write that only waits on its peer (a link refusing frames) is polled every
        5 ms, not in a spin."""
        if self.scheduler.prefilling or self.handoffs.is_writing:
            return 0
        if self.handoffs.by_id:
            return 0.005
        return 0.02

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
                self._sync(msg)

    def _sync(self, msg: NodeSync) -> None:
        """Which of the frontend's requests this node no longer holds, and which it handed
        off (every request here has its handoff)."""
        passed = self.handoffs.handed_off
        unknown = [r for r in msg.request_ids if not self.handoffs.holds(r) and r not in passed]
        self.runtime.send(
            NodeSynced(msg.sync_id, unknown, [r for r in msg.request_ids if r in passed])
        )

    def _accept(self, req: PrefillRequest) -> None:
        ids = [req.request_id, *(f.request_id for f in req.forks)]
        try:
            check_request(
                ids,
                req.params,
                req.prompt_token_ids,
                self.worker.spec.vocab_size,
                self.worker.max_model_len,
                self.handoffs.holds,
            )
            if not self.scheduler.fits_at_all(len(req.prompt_token_ids)):
                raise ValueError(
                    f"prompt of {len(req.prompt_token_ids)} tokens exceeds this "
                    f"prefill node's KV cache ({self.worker.token_capacity} tokens)"
                )
            check_endpoint("decode_kv_endpoint", req.decode_kv_endpoint, self.cfg.allow_remote)
            job = PrefillJob.of(req, time.time())
            self.handoffs.begin(job)  # the reservation comes back while the prompt waits or runs
            self.grammars.submit(job)  # compiled beside the loop; the prompt waits for it
        except (ValueError, LinkError) as e:
            for rid in dict.fromkeys(ids):
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
        self.grammars.drop(job.request_id)

    # ---- admit ------------------------------------------------------------

    def _admit(self) -> None:
        """Prompts may start: reservations answered, grammars compiled (acks free blocks)."""
        self.handoffs.advance()
        self._take_compiled()

    def _take_compiled(self) -> None:
        """Prompts whose grammar has compiled may start; one that does not compile fails."""
        for job, e in self.grammars.take_compiled(self.scheduler.waiting):
            is_ours = getattr(e, "is_retryable", False)  # the frontend moves it elsewhere
            for rid in job.request_ids:
                self.handoffs.abort(rid)
            for rid in job.request_ids:
                self._fail(rid, str(e), is_retryable=is_ours, is_bad_request=not is_ours)

    # ---- forward, collect, send --------------------------------------------

    def _forward(self, chunks: list[PrefillChunk]) -> list[int | None]:
        """The pass; the first token of each prompt it finishes. The KV writes of finished
        prompts start during the pass (layer by layer, and a chunked prompt's chunk by chunk:
        (job, the blocks it completes)) or right behind it, before the first tokens are
        sampled, so their commits go out at once."""
        for c in chunks:
            if c.is_last and c.params.is_masked_per_step:
                c.mask = self.grammars.first_token_mask(c)
        finished = [c.job for c in chunks if c.is_last]
        bs = self.worker.block_size
        parts = [(c.job, None if c.is_last else c.end // bs) for c in chunks]
        started = time.perf_counter()
        tokens, _ = self.worker.prefill(
            chunks,
            on_kv_queued=lambda: self.handoffs.start_writes(finished),
            on_layers=(lambda idx, n: self.handoffs.push_layers([parts[i] for i in idx], n))
            if self.cfg.kv_layerwise != "off"
            else None,
        )
        num_tokens = sum(len(c.token_ids) for c in chunks)
        self._log_tokens += num_tokens
        self.scheduler.token_budget = self.pass_budget.after_pass(
            self.scheduler.token_budget, num_tokens, time.perf_counter() - started
        )
        return tokens

    def _collect(self, chunks: list[PrefillChunk], tokens: list[int | None]) -> list[TokenUpdate]:
        """What the pass computed: each chunk's prompt logprobs, each finished prompt's first
        tokens (its forks' too) to its handoff; the updates that stream now. The pass is
        recorded in the scheduler."""
        done_at = time.time()
        updates = []
        for c, token in zip(chunks, tokens):
            job = c.job
            if c.prompt_logprobs is not None:
                job.prompt_logprobs += c.prompt_logprobs
            if not c.is_last:
                continue
            stamps = job.ttft_stamps(done_at)
            for f, t, lp in zip(job.forks, c.fork_tokens, c.fork_logprobs):
                f.first_token, f.first_logprobs = t, lp
            self.handoffs.set_first_token(job, token, stamps, c.logprobs)
            spec = self.worker.spec
            updates += first_token_updates(
                job, token, c.logprobs, stamps, spec.eos_token_ids, self.worker.max_model_len
            )
        self.scheduler.complete(chunks)
        return updates

    def _send(self, updates: list[TokenUpdate]) -> None:
        """First tokens stream to the frontend at once; any it cannot take now the decode
        nodes send (a prompt's logprobs are not among them: the frontend prefills again)."""
        if updates and not self.frontend.send(TokenBatch(updates), block=False):
            noisy.warning(
                "could not stream %d first tokens early: the decode nodes will", len(updates)
            )

    def _catch_up(self) -> None:
        """What arrived during the pass.
        NOTE: at once: an answer read only after its deadline is judged by when it is read,
        and a long pass on a slow host would fail reservations that were answered in time."""
        self._receive(0)
        self.handoffs.advance()

    def _fail(
        self, request_id: str, error: str, is_retryable: bool = False, is_bad_request: bool = False
    ) -> None:
        """is_bad_request: the request's own fault (its grammar): the client is told, a 400."""
        self.num_failed += 1
        noisy.warning("request %s failed: %s", request_id, error)
        failed = RequestFailed(request_id, error, is_retryable, is_bad_request)
        if not self.frontend.send(failed, block=False):
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
        self.runtime.turn()
        self.prefix_report.turn()
        if (elapsed := self.line.due_s()) is not None:
            self.line.say(*report_line.prefill(self.stats(), self._log_tokens, elapsed))
            self._log_tokens = 0
