"""The decode node: receive -> admit -> step -> sample -> send, in one loop.

Every step sends the new token of every running request to the frontend in
one message. A request's first update carries its first token (sampled by the
prefill node) and the timings that make up its time to first token.
"""
from __future__ import annotations

import os
import threading
import time

from common.channel import BadMessage, Channel, Poller, open_context
from common.config import DecodeConfig
from common.kv_cache import BlockAllocator
from common.heartbeat import HeartbeatThread
from common.log import get_logger
from common.protocol import (HandoffAck, KVHandoff, NodeAbort, NodeReady, Shutdown,
                             TokenBatch, TokenUpdate)
from common.sequence import blocks_to_join, finish_reason, grow_blocks
from common.worker import DecodeTicket, DeviceWorker
from decode_node.scheduler import DecodeScheduler

log = get_logger("decode")
ABORT_MEMORY_S = 60.0   # a handoff arriving this long after its abort is still dropped


class DecodeNode:
    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg
        self.worker = DeviceWorker(cfg.worker)
        self.recently_aborted: dict[str, float] = {}
        self.pending_aborts: set[str] = set()
        self.zombies: set[str] = set()   # finished, but their row is in the step in flight
        self.num_discarded_tokens = 0
        self.num_finished = 0
        self.num_batched_steps = 0      # steps that ran more than one request
        self._last_log = 0.0
        self._log_tokens = self._log_steps = 0

    # ---- the loop ---------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        ctx = open_context()
        links = self.cfg.links
        self.frontend = Channel(ctx, False, self.cfg.frontend_endpoint, identity=self.cfg.name,
                                max_message_bytes=links.max_message_bytes)
        try:
            with self.worker:
                kv_limit = 64 * 2**20 + self.worker.max_model_len * \
                    self.worker.spec.kv_bytes_per_token(self.worker.kv_cache.element_size())
                self.kv = Channel(ctx, True, self.cfg.kv_endpoint, max_message_bytes=kv_limit)
                poller = Poller(self.frontend, self.kv)
                self.allocator = BlockAllocator(self.worker.num_kv_blocks)
                self.scheduler = DecodeScheduler(self.allocator, self.worker.block_size,
                                                 self.cfg.worker.max_batch_size, self.cfg.max_queue)
                self._send_ready()
                self.heartbeat = HeartbeatThread(ctx, self.cfg.frontend_endpoint, "decode", self.cfg.name,
                                                 self.stats, self.cfg.links.heartbeat_s).start()
                log.info("ready on %s: %d KV blocks (%d tokens), batch up to %d, KV at %s",
                         self.cfg.worker.device, self.worker.num_kv_blocks,
                         self.worker.token_capacity, self.cfg.worker.max_batch_size,
                         self.cfg.kv_endpoint)
                inflight: DecodeTicket | None = None
                while not stop.is_set():
                    is_busy = bool(inflight or self.scheduler.running or self.scheduler.queue)
                    for ch in poller.wait(0 if is_busy else 0.02):
                        self._receive_all(ch, stop)
                    if inflight is None:
                        # Nothing on the device: the batch may change.
                        self._apply_aborts()
                        updates = self._admit()
                        inflight = self._launch() if self.worker.num_decode_seqs else None
                    else:
                        # Queue the next step behind the running one when the batch
                        # stays as it is, so the device never waits for this host work.
                        upcoming = self._launch() if self._can_pipeline() else None
                        updates = self._collect(inflight, is_next_launched=upcoming is not None)
                        inflight = upcoming
                    if not inflight and not self.scheduler.running:
                        self.worker.mark_idle()
                    if updates:
                        self._send(TokenBatch(updates))
                    self._report()
        finally:
            if hasattr(self, "heartbeat"):
                self.heartbeat.stop()
            self.frontend.close()
            if hasattr(self, "kv"):
                self.kv.close()
            ctx.term()
            log.info("stopped")

    # ---- receive ----------------------------------------------------------

    def _receive_all(self, ch: Channel, stop: threading.Event) -> None:
        while ch.has_message():
            sender, msg = ch.recv()
            if isinstance(msg, BadMessage):
                log.warning("dropped a malformed message: %s", msg.error)
                if msg.request_id and ch is self.kv:
                    self.kv.send(HandoffAck(msg.request_id, False, False, msg.error), to=sender)
            elif isinstance(msg, KVHandoff):
                self._on_handoff(sender, msg)
            elif isinstance(msg, NodeAbort):
                self._abort(msg.request_id)
            elif isinstance(msg, Shutdown):
                log.info("shutdown requested by the frontend")
                stop.set()
            else:
                log.warning("ignored an unexpected %s message", type(msg).__name__)

    def _on_handoff(self, sender: bytes, h: KVHandoff) -> None:
        h.timings["decode_recv"] = time.time()
        if h.request_id in self.recently_aborted:
            self.kv.send(HandoffAck(h.request_id, True), to=sender)  # taken, and dropped
            return
        refusal = self._check_handoff(h)
        if refusal:
            reason, is_retryable = refusal
            if not is_retryable:
                log.warning("refused handoff %s: %s", h.request_id, reason)
            self.kv.send(HandoffAck(h.request_id, False, is_retryable, reason), to=sender)
            return
        # NOTE: the KV frames are only read, when the request is admitted; the
        # tensor aliases zmq's receive buffer, which it keeps alive.
        self.scheduler.enqueue(h)
        self.kv.send(HandoffAck(h.request_id, True), to=sender)

    def _check_handoff(self, h: KVHandoff) -> tuple[str, bool] | None:
        w = self.worker
        expected = (*w.kv_cache.shape[:2], -1, *w.kv_cache.shape[3:])
        shape_ok = h.kv.dim() == 6 and all(e in (-1, s) for e, s in zip(expected, h.kv.shape))
        if not shape_ok or h.kv.dtype != w.dtype:
            return (f"KV of shape {tuple(h.kv.shape)} {h.kv.dtype} does not fit this node's cache "
                    f"{tuple(expected)} {w.dtype}"), False
        if h.kv.shape[2] * w.block_size < h.prompt_len:
            return f"{h.kv.shape[2]} blocks cannot hold a prompt of {h.prompt_len} tokens", False
        try:
            h.params.validate(w.spec.vocab_size)
        except ValueError as e:
            return str(e), False
        if h.prompt_len + h.params.max_tokens > w.max_model_len:
            return f"prompt + max_tokens exceeds max_model_len {w.max_model_len}", False
        return self.scheduler.refusal(h)

    def _abort(self, request_id: str) -> None:
        now = time.monotonic()
        self.recently_aborted = {r: t for r, t in self.recently_aborted.items()
                                 if now - t < ABORT_MEMORY_S}
        if request_id in self.scheduler.running:
            self.pending_aborts.add(request_id)  # removed between steps, not under one
        elif not self.scheduler.drop_queued(request_id):
            self.recently_aborted[request_id] = now  # its handoff may still be on the way

    def _apply_aborts(self) -> None:
        for rid in self.pending_aborts:
            if rid in self.scheduler.running:
                self._finished(rid, in_batch=True, count=False)
        self.pending_aborts.clear()

    # ---- admit, step --------------------------------------------------------

    def _admit(self) -> list[TokenUpdate]:
        updates = []
        while (arrival := self.scheduler.next_admissible()) is not None:
            h = arrival.handoff
            seq = self.scheduler.start(arrival)
            self.worker.import_blocks(seq.block_ids, h.kv[:, :, : len(seq.block_ids)])
            h.timings["decode_admit"] = time.time()
            seq.output_ids.append(h.first_token)
            reason = finish_reason(seq, h.first_token, self.worker.spec.eos_token_ids,
                                   self.worker.max_model_len)
            updates.append(TokenUpdate(h.request_id, [h.first_token], reason, _ttft_parts(h.timings)))
            if reason:
                self._finished(h.request_id, in_batch=False)
                continue
            blocks_to_join(seq, self.worker.block_size, self.allocator)
            self.worker.add_decode_seq(h.request_id, h.first_token, h.prompt_len,
                                       seq.block_ids, h.params)
        return updates

    def _launch(self) -> DecodeTicket:
        grow_blocks(self.worker, self.scheduler.running, self.allocator)
        return self.worker.launch_decode()

    def _can_pipeline(self) -> bool:
        """The next step may run before this one's tokens are seen only if the batch
        will not change: no abort, admission or leftover row to remove, and no
        request that surely ends with the running step (its extra step would write
        past its reserved blocks)."""
        if self.pending_aborts or self.zombies or self.scheduler.has_admissible():
            return False
        limit = self.worker.max_model_len
        return not any(len(s.output_ids) + 1 >= s.params.max_tokens
                       or s.prompt_len + len(s.output_ids) + 1 >= limit
                       for s in self.scheduler.running.values())

    def _collect(self, ticket: DecodeTicket, is_next_launched: bool) -> list[TokenUpdate]:
        tokens = self.worker.collect_decode(ticket)
        self._log_steps += 1
        if len(tokens) > 1:
            self.num_batched_steps += 1
        updates = []
        for key, token in zip(ticket.keys, tokens):
            if key in self.zombies or key not in self.scheduler.running:
                self.num_discarded_tokens += 1  # ended in the previous step: past its end
                continue
            self._log_tokens += 1
            seq = self.scheduler.running[key]
            seq.output_ids.append(token)
            reason = finish_reason(seq, token, self.worker.spec.eos_token_ids,
                                   self.worker.max_model_len)
            updates.append(TokenUpdate(key, [token], reason))
            if reason:
                self.num_finished += 1
                if is_next_launched:
                    self.zombies.add(key)  # its row runs once more; removed after that
                else:
                    self._finished(key, in_batch=True, count=False)
        if not is_next_launched:
            for key in self.zombies:
                self._finished(key, in_batch=True, count=False)
            self.zombies.clear()
        return updates

    def _finished(self, request_id: str, in_batch: bool, count: bool = True) -> None:
        if in_batch:
            self.worker.remove_decode_seq(request_id)
        self.scheduler.finish(request_id)
        self.num_finished += count

    # ---- send and report ------------------------------------------------------

    def _send(self, msg) -> None:
        if not self.frontend.send(msg, block=False):
            log.error("frontend queue full: dropped a %s message", type(msg).__name__)

    def _send_ready(self) -> None:
        w = self.worker
        self._send(NodeReady("decode", self.cfg.name, os.getpid(), self.cfg.worker.device,
                             w.num_kv_blocks, w.block_size, w.max_model_len,
                             peer=self.cfg.kv_endpoint))

    def stats(self) -> dict:
        return {**self.worker.stats(), "num_running": len(self.scheduler.running),
                "num_queued": len(self.scheduler.queue), "num_finished": self.num_finished,
                "num_batched_steps": self.num_batched_steps,
                "num_discarded_tokens": self.num_discarded_tokens,
                "num_free_blocks": self.allocator.num_free,
                "num_reserved_blocks": self.allocator.num_reserved,
                "num_usable_blocks": self.allocator.capacity}

    def _report(self) -> None:
        now = time.monotonic()
        self.heartbeat.last_turn = now
        if now - self._last_log >= self.cfg.links.log_interval_s:
            elapsed = now - self._last_log if self._last_log else 0.0
            s = self.stats()
            log.info("%.0f tok/s, %.1f avg batch | running %d, queued %d | free blocks %d/%d "
                     "(%d reserved)", self._log_tokens / elapsed if elapsed else 0.0,
                     self._log_tokens / max(self._log_steps, 1), s["num_running"], s["num_queued"],
                     s["num_free_blocks"], s["num_usable_blocks"], s["num_reserved_blocks"])
            self._last_log, self._log_tokens, self._log_steps = now, 0, 0


def _ttft_parts(t: dict) -> dict:
    """Milliseconds spent in each stage before the first token could be streamed."""
    ms = lambda a, b: round((t[b] - t[a]) * 1e3, 3) if t.get(a) and t.get(b) else None  # noqa: E731
    return {"queue_ms": ms("arrival", "prefill_start"), "prefill_ms": ms("prefill_start", "prefill_end"),
            "kv_transfer_ms": ms("prefill_end", "decode_recv"),
            "decode_admission_ms": ms("decode_recv", "decode_admit"),
            "first_token_at": t.get("decode_admit")}
