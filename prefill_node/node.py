"""The prefill node: receive -> schedule -> forward -> sample -> hand off, in one loop.

A finished prompt's KV blocks stay allocated (under a lease) until the decode
node confirms it holds them; an unconfirmed handoff is failed and freed when
its lease runs out.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from common.channel import BadMessage, Channel, Poller, open_context
from common.config import PrefillConfig
from common.kv_cache import BlockAllocator
from common.heartbeat import HeartbeatThread
from common.log import get_logger
from common.protocol import (HandoffAck, KVHandoff, NodeAbort, NodeReady,
                             PrefillRequest, RequestFailed, Shutdown)
from common.sampling import validate_prompt
from common.worker import DeviceWorker, PrefillChunk
from prefill_node.scheduler import PrefillJob, PrefillScheduler, ScheduledChunk

log = get_logger("prefill")
RETRY_S = 0.05


@dataclass
class PendingHandoff:
    job: PrefillJob
    msg: KVHandoff
    lease_deadline: float
    next_send: float          # 0: sent, waiting for the ack


class PrefillNode:
    def __init__(self, cfg: PrefillConfig):
        self.cfg = cfg
        self.worker = DeviceWorker(cfg.worker)
        self.pending: dict[str, PendingHandoff] = {}
        self.num_handoffs = 0
        self.num_failed = 0
        self._last_log = 0.0
        self._log_tokens = 0

    # ---- the loop ---------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        ctx = open_context()
        links = self.cfg.links
        self.frontend = Channel(ctx, False, self.cfg.frontend_endpoint, identity=self.cfg.name,
                                max_message_bytes=links.max_message_bytes)
        self.kv = Channel(ctx, False, self.cfg.decode_kv_endpoint, is_immediate=True,
                          max_message_bytes=links.max_message_bytes)
        poller = Poller(self.frontend, self.kv)
        try:
            with self.worker:
                self.allocator = BlockAllocator(self.worker.num_kv_blocks)
                self.scheduler = PrefillScheduler(self.allocator, self.worker.block_size,
                                                  self.cfg.token_budget, self.cfg.max_batch_prompts)
                self._send_ready()
                self.heartbeat = HeartbeatThread(ctx, self.cfg.frontend_endpoint, "prefill", self.cfg.name,
                                                 self.stats, self.cfg.links.heartbeat_s).start()
                log.info("ready on %s: %d KV blocks (%d tokens), token budget %d",
                         self.cfg.worker.device, self.worker.num_kv_blocks,
                         self.worker.token_capacity, self.cfg.token_budget)
                while not stop.is_set():
                    is_busy = bool(self.scheduler.prefilling or self.scheduler.waiting)
                    for ch in poller.wait(0 if is_busy else 0.02):
                        self._receive_all(ch, stop)
                    self._resend_and_expire()
                    chunks = self.scheduler.schedule()
                    if chunks:
                        self._forward(chunks)
                    self._report()
        finally:
            if hasattr(self, "heartbeat"):
                self.heartbeat.stop()
            self.frontend.close()
            self.kv.close()
            ctx.term()
            log.info("stopped")

    # ---- receive ----------------------------------------------------------

    def _receive_all(self, ch: Channel, stop: threading.Event) -> None:
        while ch.has_message():
            _, msg = ch.recv()
            if isinstance(msg, BadMessage):
                log.warning("dropped a malformed message: %s", msg.error)
                if msg.request_id and ch is self.frontend:
                    self._fail(msg.request_id, f"malformed prefill message: {msg.error}")
            elif isinstance(msg, PrefillRequest):
                self._accept(msg)
            elif isinstance(msg, HandoffAck):
                self._on_ack(msg)
            elif isinstance(msg, NodeAbort):
                self._abort(msg.request_id)
            elif isinstance(msg, Shutdown):
                log.info("shutdown requested by the frontend")
                stop.set()
            else:
                log.warning("ignored an unexpected %s message", type(msg).__name__)

    def _accept(self, req: PrefillRequest) -> None:
        try:
            req.params.validate(self.worker.spec.vocab_size)
            validate_prompt(req.prompt_token_ids, req.params.max_tokens,
                            self.worker.spec.vocab_size, self.worker.max_model_len)
            if not self.scheduler.fits_at_all(len(req.prompt_token_ids)):
                raise ValueError(f"prompt of {len(req.prompt_token_ids)} tokens exceeds this "
                                 f"prefill node's KV cache ({self.worker.token_capacity} tokens)")
        except ValueError as e:
            self._fail(req.request_id, str(e))
            return
        self.scheduler.add(PrefillJob(req.request_id, list(req.prompt_token_ids), req.params,
                                      req.arrival_time))

    def _on_ack(self, ack: HandoffAck) -> None:
        pending = self.pending.get(ack.request_id)
        if pending is None:
            return  # aborted or expired meanwhile; its blocks are already free
        if ack.is_accepted:
            self._release(ack.request_id)
        elif ack.is_retryable:
            pending.next_send = time.monotonic() + RETRY_S
        else:
            self._release(ack.request_id)
            self._fail(ack.request_id, f"decode node refused the request: {ack.reason}")

    def _abort(self, request_id: str) -> None:
        if request_id in self.pending:
            self._release(request_id)
        elif self.scheduler.abort(request_id) is None:
            log.debug("abort for unknown request %s", request_id)

    # ---- forward and hand off ----------------------------------------------

    def _forward(self, chunks: list[ScheduledChunk]) -> None:
        batch = [PrefillChunk(c.job.token_ids[c.start:c.end], c.start, c.job.block_ids,
                              c.job.params if c.is_last else None) for c in chunks]
        tokens, _ = self.worker.prefill(batch)
        self._log_tokens += sum(c.end - c.start for c in chunks)
        done_at = time.time()
        for c, token in zip(chunks, tokens):
            if not c.is_last:
                continue
            job = c.job
            timings = {"arrival": job.arrival_time, "prefill_recv": job.recv_time,
                       "prefill_start": job.start_time, "prefill_end": done_at}
            msg = KVHandoff(job.request_id, job.prompt_len, token, job.params, timings,
                            self.worker.export_blocks(job.block_ids))
            self.pending[job.request_id] = PendingHandoff(
                job, msg, time.monotonic() + self.cfg.handoff_lease_s, time.monotonic())
        self.scheduler.complete(chunks)
        self._resend_and_expire()

    def _resend_and_expire(self) -> None:
        now = time.monotonic()
        for rid, p in list(self.pending.items()):
            if now > p.lease_deadline:
                self._release(rid)
                self._fail(rid, f"decode node did not confirm the KV handoff within "
                                f"{self.cfg.handoff_lease_s:.0f}s")
            elif p.next_send and now >= p.next_send:
                if self.kv.send(p.msg, block=False):
                    p.msg.timings["sent"] = time.time()
                    p.next_send = 0.0
                    self.num_handoffs += 1
                else:
                    p.next_send = now + RETRY_S  # no decode node connected yet

    def _release(self, request_id: str) -> None:
        p = self.pending.pop(request_id)
        self.allocator.free(p.job.block_ids)
        p.job.block_ids = []

    def _fail(self, request_id: str, error: str) -> None:
        self.num_failed += 1
        log.warning("request %s failed: %s", request_id, error)
        if not self.frontend.send(RequestFailed(request_id, error), block=False):
            log.error("could not tell the frontend that %s failed", request_id)

    # ---- report -------------------------------------------------------------

    def _send_ready(self) -> None:
        w = self.worker
        self.frontend.send(NodeReady("prefill", self.cfg.name, os.getpid(), self.cfg.worker.device,
                                     w.num_kv_blocks, w.block_size, w.max_model_len,
                                     peer=self.cfg.decode_kv_endpoint))

    def stats(self) -> dict:
        return {**self.worker.stats(), "num_waiting": self.scheduler.num_waiting,
                "num_prefilling": len(self.scheduler.prefilling),
                "num_pending_handoffs": len(self.pending), "num_handoffs": self.num_handoffs,
                "num_failed": self.num_failed, "num_free_blocks": self.allocator.num_free,
                "num_usable_blocks": self.allocator.capacity}

    def _report(self) -> None:
        now = time.monotonic()
        self.heartbeat.last_turn = now
        if now - self._last_log >= self.cfg.links.log_interval_s:
            elapsed = now - self._last_log if self._last_log else 0.0
            s = self.stats()
            log.info("%.0f prompt tok/s | waiting %d, prefilling %d, pending handoffs %d | "
                     "free blocks %d/%d", self._log_tokens / elapsed if elapsed else 0.0,
                     s["num_waiting"], s["num_prefilling"], s["num_pending_handoffs"],
                     s["num_free_blocks"], s["num_usable_blocks"])
            self._last_log, self._log_tokens = now, 0
