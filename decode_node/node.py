"""The decode node: receive -> admit -> launch -> collect -> send, in one loop.

Prefill nodes reserve blocks here, write their KV into them through the
transfer backend, and commit; a committed request joins the batch without a
copy. Every step sends the new token of every running request to the frontend
in one message. A request's first update carries its first token (sampled by
the prefill node) and the timings that make up its time to first token.

When a step needs a block the pool lacks, the most recently admitted request is
preempted between steps: its KV goes to host memory (up to --swap-space) or is
dropped, and it resumes, swapped back in or recomputed from its tokens, before
anything new is admitted (decode_node/scheduler.py).
"""
from __future__ import annotations

import os
import secrets
import threading
import time

from common.wire.channel import BadMessage, Channel, Poller
from common.base.config import DecodeConfig, endpoint_host
from common.runtime.process import describe_threads
from common.kv.blocks import BlockAllocator
from common.base.log import Throttle, get_logger
from common.runtime.node import NodeRuntime
from common import transfer
from common.wire.protocol import (FRONTEND_TO_NODE, PREFILL_TO_DECODE, HandoffAck, KVBlocks, KVCommit, KVDist,
                             KVHello, KVRelease, KVReserve, KVReserved, NodeAbort, NodeReady,
                             RequestFailed, TokenBatch, TokenUpdate, ttft_parts)
from common.kv.blocks import num_blocks_for
from common.kv.sequence import Sequence, blocks_to_join, finish_reason, num_blocks_short
from common.engine.worker import DecodeTicket, DeviceWorker
from decode_node.scheduler import WaitingReserve, DecodeScheduler, Reservation

log = get_logger("decode")
noisy = Throttle(log)   # lines about what peers send
ABORT_MEMORY_S = 60.0   # a handoff arriving this long after its abort is still dropped


class DecodeNode:
    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg
        self.worker = DeviceWorker(cfg.worker)
        self.epoch = f"{os.getpid()}-{secrets.token_hex(4)}"   # new on every start
        self.recently_aborted: dict[str, float] = {}
        self.pending_aborts: set[str] = set()
        self.finished_in_flight: set[str] = set()   # finished, but their row is in the step in flight
        self.num_discarded_tokens = 0
        self.num_finished = 0
        self.num_batched_steps = 0      # steps that ran more than one request
        self.num_preemptions = 0
        self.num_swapped = 0            # preemptions that kept the KV in host memory
        self.num_recomputed = 0         # resumptions that prefilled the KV again
        self.num_expired_reservations = 0   # not renewed or committed within the lease
        self.num_granted = 0            # reservations granted from the waiting line
        self._last_log = 0.0
        self._log_tokens = self._log_steps = 0

    # ---- the loop ---------------------------------------------------------

    def run(self, stop: threading.Event) -> int:
        """Serve until stopped; the process's exit code (1: refused by the frontend)."""
        rt = self.runtime = NodeRuntime("decode", self.cfg.name, self.cfg.frontend_endpoint,
                                        self.cfg.keys_dir, self.cfg.links, stop, log)
        self.frontend = rt.frontend
        try:
            with self.worker:
                kv_limit = 64 * 2**20 + self.worker.max_model_len * \
                    self.worker.spec.kv_bytes_per_token(self.worker.kv_cache.element_size())
                # With keys, only the cluster's nodes get past the handshake.
                self.kv = Channel(rt.ctx, True, self.cfg.kv_endpoint, max_message_bytes=kv_limit,
                                  domain="nodes")
                self.sink = transfer.KVSink(self.worker.kv_cache, self.worker.kv_shm_name,
                                            transfer.accepted_backends(self.cfg.kv_transfer,
                                                                       self.worker.device),
                                            endpoint_host(self.cfg.kv_endpoint))
                self._poller = Poller(self.frontend, self.kv)
                self.blocks = BlockAllocator(self.worker.num_kv_blocks)
                self.scheduler = DecodeScheduler(self.blocks, self.worker.block_size,
                                                 self.cfg.worker.max_batch_size, self.cfg.max_queue,
                                                 self.cfg.is_preemptive)
                rt.start(self._send_ready, self.stats)
                log.info("ready on %s (%s): %d KV blocks (%d tokens), batch up to %d, KV at %s (%s), %s",
                         self.cfg.worker.device, describe_threads(), self.worker.num_kv_blocks,
                         self.worker.token_capacity, self.cfg.worker.max_batch_size,
                         self.cfg.kv_endpoint, ", ".join(self.sink.accepted),
                         f"preemption on, {self.cfg.swap_space / 2**20:.4g} MiB swap"
                         if self.cfg.is_preemptive else "full reservation")
                inflight: DecodeTicket | None = None
                while not stop.is_set():
                    is_busy = bool(inflight or self.scheduler.running or self.scheduler.ready
                                   or self.scheduler.preempted)
                    self._receive(timeout=0 if is_busy else 0.02)
                    self._expire_reservations()
                    self._grant()
                    if inflight is None:
                        # Nothing on the device: the batch may change.
                        self._apply_aborts()
                        updates = self._admit()          # first tokens of the newly admitted
                        self._make_room()
                        inflight = self._launch()
                    else:
                        # Step k runs. Queue step k+1 behind it when the batch stays as it
                        # is, so the device never waits for this host work; then read the
                        # links until step k is done (nothing read changes the batch:
                        # aborts wait for the next turn) and take its tokens.
                        upcoming = self._launch() if self._can_pipeline() else None
                        while not self.worker.is_step_done(inflight):
                            self._receive(timeout=0)
                        updates = self._collect(inflight, is_next_launched=upcoming is not None)
                        inflight = upcoming
                    if not inflight and not self.scheduler.running:
                        self.worker.mark_idle()
                    if updates:
                        self.runtime.send(TokenBatch(updates))
                    self._report()
        finally:
            rt.close()
            if hasattr(self, "sink"):
                self.sink.close()
            if hasattr(self, "kv"):
                self.kv.close()
            rt.term()
        return rt.exit_code

    # ---- receive ----------------------------------------------------------

    def _receive(self, timeout: float) -> None:
        """Everything waiting on both links."""
        for ch in self._poller.wait(timeout):
            self._receive_all(ch)

    def _receive_all(self, ch: Channel) -> None:
        allowed = PREFILL_TO_DECODE if ch is self.kv else FRONTEND_TO_NODE
        while ch.has_message():
            sender, msg = ch.recv(allowed)
            if ch is self.frontend and self.runtime.on_control(msg):
                continue
            if isinstance(msg, BadMessage):
                noisy.warning("dropped a malformed message: %s", msg.error)
                if msg.request_id and ch is self.kv:
                    self._refuse_write(sender, msg.request_id, msg.error)
            elif isinstance(msg, KVHello):
                noisy.info("prefill node %s connected to the KV link", msg.prefill_node)
                self.kv.send(self.sink.welcome(self.epoch), to=sender)
            elif isinstance(msg, KVReserve):
                self._on_reserve(sender, msg)
            elif isinstance(msg, (KVBlocks, KVDist)):
                self._on_blocks(sender, msg)
            elif isinstance(msg, KVCommit):
                self._on_commit(sender, msg)
            elif isinstance(msg, KVRelease):
                if self._reservation_of(sender, msg.request_id):
                    self._release(msg.request_id)
                else:
                    self.scheduler.drop_waiting(msg.request_id, sender)
            elif isinstance(msg, NodeAbort):
                self._abort(msg.request_id)

    def _reservation_of(self, sender: bytes, request_id: str) -> Reservation | None:
        """A reservation, if the sender is the prefill node that made it."""
        r = self.scheduler.reservations.get(request_id)
        return r if r is not None and r.sender == sender else None

    def _on_reserve(self, sender: bytes, m: KVReserve) -> None:
        w = self.worker
        lease_s = self.cfg.reservation_lease_s
        if m.request_id in self.recently_aborted:
            got = ("the request was aborted", False)
        elif m.prompt_len < 1 or m.max_tokens < 1:
            got = (f"bad reservation: prompt_len {m.prompt_len}, max_tokens {m.max_tokens}", False)
        elif m.prompt_len + m.max_tokens > w.max_model_len:
            got = (f"prompt + max_tokens exceeds max_model_len {w.max_model_len}", False)
        else:
            # NOTE: first come, first served: a request in line is granted unasked (_grant).
            got = self.scheduler.request(m.request_id, sender, m.prompt_len, m.max_tokens, lease_s,
                                         self.cfg.max_queue)
        if isinstance(got, Reservation):
            reply = KVReserved(m.request_id, self.epoch, list(got.block_ids), lease_s=lease_s)
        elif isinstance(got, WaitingReserve):
            reply = KVReserved(m.request_id, self.epoch, None, True, got.reason, lease_s, is_queued=True)
        else:
            reason, is_retryable = got
            if not is_retryable:
                noisy.warning("refused reservation %s: %s", m.request_id, reason)
            reply = KVReserved(m.request_id, self.epoch, None, is_retryable, reason)
        self.kv.send(reply, to=sender)

    def _grant(self) -> None:
        """Reserve blocks for waiting requests, oldest first, while they fit."""
        lease_s = self.cfg.reservation_lease_s
        while (turn := self.scheduler.next_grant()) is not None:
            a, refusal = turn
            if refusal is not None:
                self.kv.send(KVReserved(a.request_id, self.epoch, None, False, refusal[0]), to=a.sender)
                continue
            r = self.scheduler.reserve(a.request_id, a.sender, a.prompt_len, a.max_tokens, lease_s)
            self.num_granted += 1
            self.kv.send(KVReserved(a.request_id, self.epoch, list(r.block_ids), lease_s=lease_s,
                                    is_queued=True), to=a.sender)

    def _on_blocks(self, sender: bytes, m: KVBlocks | KVDist) -> None:
        r = self._reservation_of(sender, m.request_id)
        if r is None or r.commit is not None:
            return  # released, expired, or not this sender's
        # NOTE: taken even once the request failed or was aborted: a dist send waits for
        # its receive, and every later send from that node waits behind it.
        try:
            self.sink.receive(sender, m, r.block_ids)
        except transfer.TransferError as e:
            noisy.warning("refused KV frame for %s: %s", m.request_id, e)
            r.error = str(e)

    def _on_commit(self, sender: bytes, c: KVCommit) -> None:
        c.timings["decode_recv"] = time.time()
        r = self._reservation_of(sender, c.request_id)
        if r is None:
            reason = "the request was aborted" if c.request_id in self.recently_aborted else \
                "no reservation for this request (expired or released)"
            self._refuse_write(sender, c.request_id, reason)
            return
        try:
            c.params.validate(self.worker.spec.vocab_size)
            if len(c.prompt_ids) != c.prompt_len or \
                    any(t >= self.worker.spec.vocab_size for t in c.prompt_ids):
                raise ValueError("the commit's prompt ids do not match its length or the vocabulary")
            if c.prompt_len != r.prompt_len or c.params.max_tokens > r.max_tokens:
                raise ValueError(f"commit for {c.prompt_len} tokens + {c.params.max_tokens} outputs "
                                 f"does not match the reservation ({r.prompt_len} + {r.max_tokens})")
            if not 0 <= c.first_token < self.worker.spec.vocab_size:
                raise ValueError(f"first token {c.first_token} is outside the vocabulary")
            if r.error:
                raise ValueError(r.error)
        except ValueError as e:
            self._refuse_write(sender, c.request_id, str(e))
            return
        self.scheduler.commit(r, c)
        self.kv.send(HandoffAck(c.request_id, True), to=sender)

    def _refuse_write(self, sender: bytes, request_id: str, reason: str) -> None:
        """Refuse a handoff for good; its reservation, if the sender made one, is freed."""
        if self._reservation_of(sender, request_id):
            self._release(request_id)
        noisy.warning("refused handoff %s: %s", request_id, reason)
        self.kv.send(HandoffAck(request_id, False, False, reason), to=sender)

    def _release(self, request_id: str) -> None:
        self.sink.forget(request_id)  # waits for frames still landing in its blocks
        self.scheduler.release(request_id)

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        for a in [a for a in self.scheduler.waiting if now > a.deadline]:
            noisy.warning("reservation request %s was not asked again within %.0fs: dropped",
                          a.request_id, self.cfg.reservation_lease_s)
            self.scheduler.waiting.remove(a)
        for rid in self.scheduler.expired(now):
            noisy.warning("reservation %s was neither renewed nor committed within %.0fs: freed", rid,
                          self.cfg.reservation_lease_s)
            self.num_expired_reservations += 1
            self._release(rid)

    def _abort(self, request_id: str) -> None:
        now = time.monotonic()
        self.recently_aborted = {r: t for r, t in self.recently_aborted.items()
                                 if now - t < ABORT_MEMORY_S}
        if request_id in self.scheduler.running:
            self.pending_aborts.add(request_id)  # removed between steps, not under one
        elif self.scheduler.drop_preempted(request_id):
            self.worker.drop_swapped(request_id)
        elif (r := self.scheduler.reservations.get(request_id)) is not None:
            if r.commit is None:
                # NOTE: its prefill node may be writing into these blocks right now (ipc
                # copies, a dist send waiting for its receive): they are freed when that node
                # releases them or commits (refused), or when the lease ends, never under a write.
                r.error = r.error or "the request was aborted"
            else:
                self._release(request_id)
            self.recently_aborted[request_id] = now  # a late commit is refused, not an error
        elif self.scheduler.drop_waiting(request_id):
            self.recently_aborted[request_id] = now
        else:
            self.recently_aborted[request_id] = now  # its reservation may still be on the way

    def _apply_aborts(self) -> None:
        for rid in self.pending_aborts:
            if rid in self.scheduler.running:
                self._finished(rid, in_batch=True, count=False)
        self.pending_aborts.clear()

    # ---- admit, step --------------------------------------------------------

    def _admit(self) -> list[TokenUpdate]:
        while (seq := self.scheduler.next_resumable()) is not None:
            self._resume(seq)
        updates = []
        while (r := self.scheduler.next_admissible(self.sink.is_landed)) is not None:
            c = r.commit
            seq = self.scheduler.start(r)
            error = self.sink.landing_error(c.request_id)
            if error:
                self.sink.forget(c.request_id)
                self._finished(c.request_id, in_batch=False, count=False)
                self.runtime.send(RequestFailed(c.request_id, error))
                continue
            c.timings["decode_admit"] = time.time()
            seq.output_ids.append(c.first_token)
            reason = finish_reason(seq, c.first_token, self.worker.spec.eos_token_ids,
                                   self.worker.max_model_len)
            updates.append(TokenUpdate(c.request_id, [c.first_token], reason, ttft_parts(c.timings)))
            if reason:
                self._finished(c.request_id, in_batch=False)
                continue
            blocks_to_join(seq, self.worker.block_size, self.blocks)
            self.worker.add_decode_seq(c.request_id, c.first_token, c.prompt_len,
                                       seq.block_ids, c.params)
        return updates

    def _launch(self) -> DecodeTicket | None:
        self.worker.grow_blocks(self.scheduler.running, self.blocks)
        return self.worker.launch_decode()

    # ---- preemption (between steps only: no step in flight) -------------------

    def _make_room(self) -> None:
        """Preempt until the next step's new blocks fit in the pool."""
        while num_blocks_short(self.worker.keys_needing_block, self.scheduler.running, self.blocks):
            self._preempt(self.scheduler.victim())

    def _preempt(self, seq: Sequence) -> None:
        rid = seq.request_id
        self.worker.remove_decode_seq(rid)
        keep = seq.block_ids[:num_blocks_for(seq.num_cached, self.worker.block_size)]
        seq.is_swapped = self.worker.swapped_bytes + len(keep) * self.worker.block_bytes() \
            <= self.cfg.swap_space
        if seq.is_swapped:
            try:
                self.worker.swap_out(rid, keep)
                self.num_swapped += 1
            except RuntimeError as e:   # host memory could not be had: recompute instead
                noisy.warning("swap-out of %s failed, it will be recomputed: %s", rid, e)
                seq.is_swapped = False
        self.scheduler.preempt(seq, time.monotonic())
        self.num_preemptions += 1
        log.debug("preempted %s at %d tokens (%s): %d KV blocks free, %d running", rid, seq.num_cached,
                  "swapped to host" if seq.is_swapped else "to be recomputed",
                  self.blocks.num_free, len(self.scheduler.running))

    def _resume(self, seq: Sequence) -> None:
        rid = seq.request_id
        block_ids = self.scheduler.resume(seq, time.monotonic())
        if seq.is_swapped:
            self.worker.swap_in(rid, block_ids)
        else:
            self.worker.recompute(seq.prompt_ids + seq.output_ids[:-1], block_ids)
            self.num_recomputed += 1
        self.worker.add_decode_seq(rid, seq.output_ids[-1], seq.num_cached, block_ids, seq.params)
        log.debug("resumed %s after %.0f ms (%s)", rid, seq.preempted_s * 1e3,
                  "swapped in" if seq.is_swapped else "recomputed")
        seq.is_swapped = False

    def _can_pipeline(self) -> bool:
        """The next step may run before this one's tokens are seen only if the batch
        will not change: no abort, admission or leftover row to remove, and no
        request that surely ends with the running step (its extra step would write
        past its reserved blocks), no preempted request that could resume, and no
        block the next step needs that only a preemption would free."""
        if self.pending_aborts or self.finished_in_flight or self.scheduler.has_admissible(self.sink.is_landed) \
                or self.scheduler.next_resumable() \
                or num_blocks_short(self.worker.keys_needing_block, self.scheduler.running, self.blocks):
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
            if key in self.finished_in_flight or key not in self.scheduler.running:
                self.num_discarded_tokens += 1  # ended in the previous step: past its end
                continue
            self._log_tokens += 1
            seq = self.scheduler.running[key]
            seq.output_ids.append(token)
            reason = finish_reason(seq, token, self.worker.spec.eos_token_ids,
                                   self.worker.max_model_len)
            updates.append(TokenUpdate(key, [token], reason, _preemption_parts(seq) if reason else None))
            if reason:
                self.num_finished += 1
                if is_next_launched:
                    self.finished_in_flight.add(key)  # its row runs once more; removed after that
                else:
                    self._finished(key, in_batch=True, count=False)
        if not is_next_launched:
            for key in self.finished_in_flight:
                self._finished(key, in_batch=True, count=False)
            self.finished_in_flight.clear()
        return updates

    def _finished(self, request_id: str, in_batch: bool, count: bool = True) -> None:
        if in_batch:
            self.worker.remove_decode_seq(request_id)
        self.scheduler.finish(request_id)
        self.num_finished += count

    # ---- send and report ------------------------------------------------------

    def _send_ready(self) -> bool:
        w = self.worker
        return self.frontend.send(NodeReady("decode", self.cfg.name, os.getpid(), self.cfg.worker.device,
                                            w.num_kv_blocks, w.block_size, w.max_model_len,
                                            kv_endpoint=self.cfg.kv_endpoint,
                                            kv_transfer=self.cfg.kv_transfer,
                                            max_batch_size=self.cfg.worker.max_batch_size), block=False)

    def stats(self) -> dict:
        return {**self.worker.stats(), "num_running": len(self.scheduler.running),
                "num_queued": len(self.scheduler.ready),
                "num_reservations": len(self.scheduler.reservations), "num_finished": self.num_finished,
                "num_expired_reservations": self.num_expired_reservations,
                "num_asking": len(self.scheduler.waiting), "num_granted": self.num_granted,
                "num_batched_steps": self.num_batched_steps,
                "num_preemptions": self.num_preemptions, "num_swapped": self.num_swapped,
                "num_recomputed": self.num_recomputed, "num_preempted": len(self.scheduler.preempted),
                "num_discarded_tokens": self.num_discarded_tokens,
                "num_free_blocks": self.blocks.num_free,
                "num_reserved_blocks": self.blocks.num_reserved,
                "num_available_blocks": self.blocks.num_available,
                "num_bad_messages": self.frontend.num_bad + self.kv.num_bad,
                "is_registered": self.runtime.is_registered,
                "num_usable_blocks": self.blocks.capacity}

    def _report(self) -> None:
        now = time.monotonic()
        self.runtime.turn()
        if now - self._last_log >= self.cfg.links.log_interval_s:
            elapsed = now - self._last_log if self._last_log else 0.0
            s = self.stats()
            preempted = f" | preempted {s['num_preempted']} now, {s['num_preemptions']} in all " \
                f"({s['num_swapped']} swapped, {s['num_recomputed']} recomputed)" \
                if s["num_preemptions"] else ""
            log.info("%.0f tok/s, %.1f avg batch | running %d, queued %d | free blocks %d/%d "
                     "(%d reserved)%s", self._log_tokens / elapsed if elapsed else 0.0,
                     self._log_tokens / max(self._log_steps, 1), s["num_running"], s["num_queued"],
                     s["num_free_blocks"], s["num_usable_blocks"], s["num_reserved_blocks"], preempted)
            self._last_log, self._log_tokens, self._log_steps = now, 0, 0


def _preemption_parts(seq: Sequence) -> dict | None:
    """On a preempted request's last update: how often and how long it was preempted."""
    if not seq.num_preemptions:
        return None
    return {"num_preemptions": seq.num_preemptions, "preempted_ms": round(seq.preempted_s * 1e3, 3)}
