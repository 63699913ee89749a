"""The decode node: receive -> admit -> launch -> collect -> send, in one loop.

Prefill nodes reserve blocks here, write their KV into them through the
transfer backend, and commit (common/handoff/receiver.py); a committed request
joins the batch without a copy; a prompt the frontend routes here is prefilled here,
a chunk per turn (decode_node/local.py). Every step sends the new token of every running
request to the frontend in one message. A request's first update carries its first token
and the timings that make up its time to first token.

When a step needs a block the pool lacks, the most recently admitted request is
preempted between steps (decode_node/preemption.py).
"""

from __future__ import annotations

import contextlib
import os
import time

from common import transfer
from common.base import grammar
from common.base.config import DecodeConfig, endpoint_host, is_loopback_endpoint
from common.base.log import IdleQuiet, Throttle, get_logger
from common.base.recent import Recent
from common.engine.decode import DecodeTicket
from common.engine.worker import DeviceWorker
from common.handoff.receiver import Receiver
from common.kv.prefix import PrefixCache
from common.kv.sequence import Sequence, blocks_to_join, finish_reason, num_blocks_short
from common.runtime import report_line
from common.runtime.node import NodeRuntime
from common.runtime.prefix_report import PrefixReport
from common.runtime.process import StopEvent, describe_threads
from common.wire.channel import BadMessage, Channel, Poller, node_tag
from common.wire.protocol import (
    FRONTEND_TO_NODE,
    PREFILL_TO_DECODE,
    NodeAbort,
    NodeReady,
    NodeSync,
    NodeSynced,
    PeerLost,
    PrefillRequest,
    RequestFailed,
    TokenBatch,
    TokenUpdate,
    ttft_parts,
)
from decode_node.grammar_wait import GrammarWait
from decode_node.local import LocalPrefill
from decode_node.preemption import Preemption
from decode_node.scheduler import DecodeScheduler

log = get_logger("decode")
noisy = Throttle(log)  # lines about what peers send
ENDED_MEMORY = 4096  # requests ended here, remembered for the frontend's NodeSync


class DecodeNode:
    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg
        self.worker = DeviceWorker(cfg.worker)
        self.pending_aborts: set[str] = set()
        self.ended = Recent(ENDED_MEMORY)  # the latest requests that ended here
        self.compiles = grammar.Compiles(
            lambda: grammar.for_model(cfg.worker.model, self.worker.spec.vocab_size)
        )
        self.grammars = GrammarWait(self.compiles)  # committed, their grammar compiling
        self.finished_in_flight: set[str] = (
            set()
        )  # finished, but their row is in the step in flight
        self.num_discarded_tokens = 0
        self.num_finished = 0
        self.num_batched_steps = 0  # steps that ran more than one request
        self.num_forked = 0  # sequences admitted over another's prompt blocks (n > 1)
        self._last_log, self._log_tokens, self._log_steps = 0.0, 0, 0
        self.quiet = IdleQuiet()  # the periodic line: while busy, and once as it goes idle

    # ---- the loop ---------------------------------------------------------

    def run(self, stop: StopEvent) -> int:
        """Serve until stopped; the process's exit code (1: refused by the frontend)."""
        rt = self.runtime = NodeRuntime(
            "decode",
            self.cfg.name,
            self.cfg.frontend_endpoint,
            self.cfg.keys_dir,
            self.cfg.links,
            stop,
            log,
            self.cfg.drain_timeout_s,
        )
        self.frontend = rt.frontend
        try:
            with (
                self.worker,
                contextlib.ExitStack() as parts,
            ):  # parts close as they were made, last first
                kv_limit = (
                    64 * 2** 20
                    + self.worker.max_model_len
                    * self.worker.spec.kv_bytes_per_token(self.worker.kv_cache.element_size())
                )
                # With keys, only the cluster's nodes get past the handshake.
                self.kv = Channel(
                    rt.ctx, True, self.cfg.kv_endpoint, max_message_bytes=kv_limit, domain="nodes"
                )
                parts.callback(self.kv.close)
                sink = transfer.KVSink(
                    transfer.LocalCache(
                        self.worker.kv_cache,
                        endpoint_host(self.cfg.kv_reachable),
                        self.worker.kv_shm_name,
                    ),
                    transfer.offered(
                        self.cfg.kv_transfer,
                        self.worker.device,
                        not is_loopback_endpoint(self.cfg.kv_reachable),
                    ),
                    is_layerwise=self.cfg.kv_layerwise != "off",
                )
                self._poller = Poller(self.frontend, self.kv)
                self.prefix_cache = PrefixCache(
                    self.worker.num_kv_blocks, self.cfg.is_prefix_caching
                )
                self.prefix_report = PrefixReport(
                    self.cfg.name, self.prefix_cache, rt, self.cfg.is_prefix_caching
                )
                self.scheduler = DecodeScheduler(
                    self.prefix_cache,
                    self.worker.block_size,
                    self.cfg.worker.max_batch_size,
                    self.cfg.is_preemptive,
                )
                self.scheduler.aside = self.grammars.waiting  # taken ids, in the queue
                self.handoff = Receiver(
                    epoch=rt.epoch,
                    lease_s=self.cfg.reservation_lease_s,
                    max_queue=self.cfg.max_queue,
                    pool=self.scheduler,
                    sink=sink,
                    send=self.kv.send,
                    vocab_size=self.worker.spec.vocab_size,
                    max_model_len=self.worker.max_model_len,
                    is_verifying=self.cfg.is_kv_verified,
                )
                parts.callback(self.handoff.close)
                parts.callback(self.compiles.close)
                self.local = LocalPrefill(self.worker, self.scheduler, self.cfg.max_queue)
                self.preemption = Preemption(self.worker, self.scheduler, self.cfg.swap_space)
                rt.start(self._send_ready, self.stats, self._is_empty)
                log.info(
                    "ready on %s (%s): %d KV blocks (%d tokens), batch up to %d, KV at %s (%s), %s",
                    self.cfg.worker.device,
                    describe_threads(self.worker.num_threads),
                    self.prefix_cache.capacity,
                    self.worker.token_capacity,
                    self.cfg.worker.max_batch_size,
                    self.cfg.kv_endpoint
                    if self.cfg.kv_advertise is None
                    else f"{self.cfg.kv_endpoint}, advertised as {self.cfg.kv_advertise}",
                    ", ".join(sink.accepted),
                    f"preemption on, {self.cfg.swap_space / 2**20:.4g} MiB swap"
                    if self.cfg.is_preemptive
                    else "full reservation",
                )
                inflight: DecodeTicket | None = None
                while not stop.is_set():
                    is_busy = (
                        bool(
                            inflight
                            or self.scheduler.running
                            or self.handoff.ready
                            or self.local.waiting
                            or self.scheduler.preempted
                            or self.grammars.waiting
                        )
                        or self.handoff.progress()
                    )
                    self._receive(timeout=0 if is_busy else 0.02)
                    self.handoff.turn()  # expire and grant reservations
                    if inflight is None:
                        # Nothing on the device: the batch may change.
                        self._apply_aborts()
                        updates = self._admit()  # first tokens of the newly admitted
                        if (
                            updates
                        ):  # NOTE: now, not after the launch: on the host the step runs in it
                            self.runtime.send(TokenBatch(updates))
                        self.preemption.make_room()
                        inflight = self._launch()
                    else:
                        # Step k runs. Queue step k+1 behind it when the batch stays as it
                        # is, so the device never waits for this host work; then read the
                        # links until step k is done (nothing read changes the batch:
                        # aborts wait for the next turn) and take its tokens.
                        upcoming = self._launch() if self._can_pipeline() else None
                        self.grammars.ask(self.handoff)  # compiles start at commit here too
                        while not self.worker.decode.is_done(inflight):
                            self._receive(timeout=0)
                        updates = self._collect(inflight, is_next_launched=upcoming is not None)
                        inflight = upcoming
                        if updates:
                            self.runtime.send(TokenBatch(updates))
                    if not inflight and not self.scheduler.running:
                        self.worker.decode.mark_idle()
                    self._report()
        finally:
            rt.close()
            rt.term()
        return rt.exit_code

    # ---- receive ----------------------------------------------------------

    def _receive(self, timeout: float) -> None:
        """Everything waiting on both links."""
        for ch in self._poller.wait(timeout):
            self._receive_all(ch)

    def _receive_all(self, ch: Channel) -> None:
        while ch.has_message():
            if ch is self.kv:
                self.handoff.receive(*ch.recv(PREFILL_TO_DECODE))
                continue
            _, msg = ch.recv(FRONTEND_TO_NODE)
            if self.runtime.on_control(msg):
                continue
            if isinstance(msg, BadMessage):
                noisy.warning("dropped a malformed message: %s", msg.error)
            elif isinstance(msg, NodeAbort):
                self._abort(msg.request_id)
            elif isinstance(msg, PrefillRequest):  # routed here to prefill (decode_node/local.py)
                try:
                    self.local.add(msg, self._held_ids())
                except ValueError as e:
                    self.runtime.send(RequestFailed(msg.request_id, str(e)))
            elif isinstance(msg, PeerLost):
                self.handoff.drop_peer(node_tag(msg.name, msg.epoch).encode(), msg.is_exited)
            elif isinstance(msg, NodeSync):
                held = self._held_ids()
                self.runtime.send(
                    NodeSynced(
                        msg.sync_id,
                        [r for r in msg.request_ids if r not in held and r not in self.ended],
                        [r for r in msg.request_ids if r not in held and r in self.ended],
                    )
                )

    def _held_ids(self) -> set[str]:
        """Every request here: running, preempted, or in the handoff (forks included)."""
        s = self.scheduler
        return {
            *s.running,
            *(q.request_id for q in s.preempted),
            *(j.seq.request_id for j in s.joining),
            *self.handoff.held_ids(),
            *self.local.held_ids(),
            *self.grammars.ids(),
        }

    def _abort(self, request_id: str) -> None:
        self._abort_one(request_id)
        # A grammar compiled for a committed request that is gone now (its last sequence given up)
        self.grammars.prune(self.handoff.held)

    def _abort_one(self, request_id: str) -> None:
        if request_id in self.scheduler.running:
            self.pending_aborts.add(request_id)  # removed between steps, not under one
        elif self.scheduler.drop_preempted(request_id):
            self.worker.swap.drop(request_id)
        elif self.scheduler.drop_joining(request_id):
            self.ended.add(request_id)
        elif (r := self.grammars.abort(request_id)) is not None:
            if r.is_given_up:  # its last sequence: its blocks go back
                self._give_back(r)
                self.ended.add(r.request_id)
        elif not self.local.abort(request_id):
            self.handoff.abort(request_id)

    def _apply_aborts(self) -> None:
        for rid in self.pending_aborts:
            if rid in self.scheduler.running:
                self._finished(rid, in_batch=True, count=False)
        self.pending_aborts.clear()

    # ---- admit, step --------------------------------------------------------

    def _admit(self) -> list[TokenUpdate]:
        self.preemption.resume_all()
        updates = []
        self._join_started(updates)
        self.grammars.ask(self.handoff)  # compiles start at commit, beside the handoff
        for r, error, is_retryable in self.grammars.failed():
            self._fail_committed(r, error, is_retryable)
        # NOTE: first committed, first admitted, of those that may start: one whose grammar
        # still compiles waits aside, holding its blocks. A request's n sequences start
        # together, and those that do not fit take the next rows that free, before anything.
        taken = None
        while self.scheduler.can_admit() and (taken := self.grammars.next(self.handoff)):
            r, compiled, error, is_retryable = taken
            if error is not None:  # retryable: it moves on elsewhere (grammar_wait.py)
                self._fail_committed(r, error, is_retryable)
                continue
            c = r.commit
            c.timings["decode_admit"] = time.time()
            self.num_forked += len(c.forks)
            started, copies = self.scheduler.start(
                r
            )  # its own, then one per fork (n > 1), sharing its blocks
            if copies:  # NOTE: before any step writes into the partial last block they copy
                self.worker.copy_blocks(*map(list, zip(*copies)))
            for j in started:
                j.compiled = compiled
                if j.seq.request_id in r.aborted_ids:  # one of n, given up while the others went on
                    self.scheduler.release(j.seq)
                    self.ended.add(j.seq.request_id)
                else:
                    self.scheduler.joining.append(j)
            self._join_started(updates)
        if taken is None and (done := self.local.run()) is not None:  # a chunk of a prompt here
            update = self._join(done.seq, done.token, done.logprobs, done.stamps)
            if update is not None:
                updates.append(update)
        return updates

    def _fail_committed(self, r, error: str, is_retryable: bool) -> None:
        """A committed request that cannot start: its blocks go back, its sequences fail."""
        self._give_back(r)
        for rid in [r.request_id, *r.fork_ids]:
            self.ended.add(rid)
            self.runtime.send(RequestFailed(rid, error, is_retryable=is_retryable))

    def _give_back(self, r) -> None:
        self.scheduler.give_back(r.block_ids, r.num_reserved)
        r.block_ids, r.num_reserved = [], 0  # NOTE: freed once, whichever path ends it

    def _join_started(self, updates: list[TokenUpdate]) -> None:
        """Sequences started here join the batch as rows allow, oldest first."""
        while (j := self.scheduler.next_joining()) is not None:
            update = self._join(
                self.scheduler.admit(j.seq), j.token, j.logprobs, j.timings, j.compiled
            )
            if update is not None:
                updates.append(update)

    def _join(
        self, seq: Sequence, token: int, logprobs, timings: dict, compiled=None
    ) -> TokenUpdate | None:
        """A newly admitted sequence takes its first token (sampled by the prefill node) and
        joins the batch, unless that token ends it; its first update, or None if it failed.
        compiled: its grammar, compiled (Compiles.take)."""
        rid = seq.request_id
        seq.output_ids.append(token)
        if (
            seq.params.is_masked_per_step
        ):  # its matcher takes every token so far: the mask goes on from there
            try:
                seq.matcher = grammar.matcher_for(
                    seq.params,
                    seq.history()[1],
                    self.worker.spec.vocab_size,
                    self.compiles.grammars,
                    compiled,
                )
            except ValueError as e:
                self._finished(rid, in_batch=False, count=False)
                self.runtime.send(RequestFailed(rid, str(e)))
                return None
        reason = finish_reason(
            seq, token, self.worker.spec.eos_token_ids, self.worker.max_model_len
        )
        update = TokenUpdate(
            rid,
            [token],
            reason,
            ttft_parts(timings),
            index=0,
            logprobs=[logprobs] if logprobs else None,
        )
        if reason:
            self._finished(rid, in_batch=False)
            return update
        blocks_to_join(seq, self.worker.block_size, self.prefix_cache)
        self.worker.decode.add(rid, token, seq.prompt_len, seq.block_ids, seq.params, seq.history())
        return update

    def _launch(self) -> DecodeTicket | None:
        self.worker.decode.grow_blocks(self.scheduler.running, self.prefix_cache)
        for key, seq in self.scheduler.running.items():
            if seq.matcher is not None:
                self.worker.decode.set_mask(key, seq.matcher.fill())
        return self.worker.decode.launch()

    def _can_pipeline(self) -> bool:
        """The next step may run before this one's tokens are seen only where steps are
        queued (on the host, where a step runs in its launch, it would only hold these
        tokens back a step) and the batch will not change: no abort, admission or leftover
        row to remove, no request that surely ends with the running step (its extra step
        would write past its reserved blocks), no preempted request that could resume, and
        no block the next step needs that only a preemption would free."""
        if (
            not self.worker.is_step_queued
            or self.pending_aborts
            or self.finished_in_flight
            or self._can_admit_ready()
            or self.local.is_runnable()
            or (self.scheduler.joining and self.scheduler.has_row())
            or self.scheduler.next_resumable()
            or num_blocks_short(
                self.worker.decode.keys_needing_block, self.scheduler.running, self.prefix_cache
            )
        ):
            return False
        if any(s.matcher is not None for s in self.scheduler.running.values()):
            return False  # the next mask needs this step's token
        limit = self.worker.max_model_len
        return not any(
            len(s.output_ids) + 1 >= s.params.max_tokens
            or s.prompt_len + len(s.output_ids) + 1 >= limit
            for s in self.scheduler.running.values()
        )

    def _can_admit_ready(self) -> bool:
        return self.scheduler.can_admit() and (
            self.handoff.has_ready() or self.grammars.has_ended()
        )

    def _collect(self, ticket: DecodeTicket, is_next_launched: bool) -> list[TokenUpdate]:
        tokens = self.worker.decode.collect(ticket)
        logprobs = ticket.logprobs or [None] * len(tokens)
        self._log_steps += 1
        if len(tokens) > 1:
            self.num_batched_steps += 1
        updates = []
        for key, token, lp in zip(ticket.keys, tokens, logprobs):
            if key in self.finished_in_flight or key not in self.scheduler.running:
                self.num_discarded_tokens += 1  # ended in the previous step: past its end
                continue
            self._log_tokens += 1
            seq = self.scheduler.running[key]
            seq.output_ids.append(token)
            if seq.matcher is not None and not seq.matcher.accept(token):
                noisy.warning("request %s: token %d breaks its grammar", key, token)
            reason = finish_reason(
                seq, token, self.worker.spec.eos_token_ids, self.worker.max_model_len
            )
            # NOTE: its preemptions are told after each resume too: a request that moves on
            # elsewhere keeps them in its timings.
            parts = seq.preemption_parts() if reason or seq.is_preemption_untold else None
            seq.is_preemption_untold = False
            updates.append(
                TokenUpdate(
                    key,
                    [token],
                    reason,
                    parts,
                    index=len(seq.output_ids) - 1,
                    logprobs=[lp] if lp else None,
                )
            )
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
            self.worker.decode.remove(request_id)
        self.scheduler.finish(request_id)
        self.num_finished += count
        self.ended.add(request_id)

    # ---- send and report ------------------------------------------------------

    def _send_ready(self) -> bool:
        w = self.worker
        return self.frontend.send(
            NodeReady(
                "decode",
                self.cfg.name,
                os.getpid(),
                self.runtime.epoch,
                self.cfg.worker.device,
                w.num_kv_blocks,
                w.block_size,
                w.max_model_len,
                kv_endpoint=self.cfg.kv_reachable,
                kv_transfer=self.cfg.kv_transfer,
                max_batch_size=self.cfg.worker.max_batch_size,
            ),
            block=False,
        )

    def _is_empty(self) -> bool:
        h = self.handoff
        return not (
            self.scheduler.running
            or self.scheduler.preempted
            or self.scheduler.joining
            or h.held
            or h.ready
            or h.waiting
            or self.local.waiting
            or self.grammars.waiting
        )

    def stats(self) -> dict:
        return {
            **self.worker.stats(),
            "num_running": len(self.scheduler.running),
            "num_queued": len(self.handoff.ready) + len(self.grammars.waiting),
            "num_reservations": len(self.handoff.held),
            "num_finished": self.num_finished,
            "num_expired_reservations": self.handoff.num_expired,
            "num_asking": len(self.handoff.waiting),
            "num_granted": self.handoff.num_granted,
            "num_batched_steps": self.num_batched_steps,
            **self.preemption.stats(),
            "num_forked": self.num_forked,
            "num_joining": len(self.scheduler.joining),
            "num_discarded_tokens": self.num_discarded_tokens,
            "num_free_blocks": self.prefix_cache.num_free,
            "num_reserved_blocks": self.prefix_cache.num_reserved,
            "num_available_blocks": self.prefix_cache.num_available,
            "num_bad_messages": self.frontend.num_bad + self.kv.num_bad,
            "num_link_resets": self.runtime.num_link_resets + self.kv.num_reroutes,
            "num_incomplete_commits": self.handoff.num_incomplete,
            "num_early_commits": self.handoff.num_early_commits,
            "num_kv_verify_failures": self.handoff.num_verify_failures,
            "num_peer_drops": self.handoff.num_peer_drops,
            "is_registered": self.runtime.is_registered,
            "num_usable_blocks": self.prefix_cache.capacity,
            **self.local.stats(),
        }

    def _report(self) -> None:
        now = time.monotonic()
        self.runtime.turn()
        self.prefix_report.turn()
        if now - self._last_log >= self.cfg.links.log_interval_s:
            elapsed = now - self._last_log if self._last_log else 0.0
            is_busy, line = report_line.decode(
                self.stats(), self._log_tokens, self._log_steps, elapsed
            )
            if self.quiet.says(is_busy):
                log.info("%s", line)
            self._last_log, self._log_tokens, self._log_steps = now, 0, 0
