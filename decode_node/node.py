"""The decode node: receive -> admit -> launch -> collect -> send, one turn at a time.

Prefill nodes reserve blocks here, write their KV into them through the
transfer backend, and commit (common/handoff/receiver.py); a committed request
joins the batch without a copy; a prompt the frontend routes here is prefilled here,
a chunk per turn (decode_node/local.py). Every step sends the new token of every running
request to the frontend in one message. A request's first update carries its first token
and the timings that make up its time to first token. The batch's steps are batch.py's.

When a step needs a block the pool lacks, the most recently admitted request is
preempted between steps (decode_node/preemption.py).
"""

from __future__ import annotations

import contextlib
import time

from common import transfer
from common.base import grammar
from common.base.config import DecodeConfig, endpoint_host, is_loopback_endpoint
from common.base.log import Throttle, get_logger
from common.base.recent import Recent
from common.engine.ticket import DecodeTicket
from common.engine.worker import DeviceWorker
from common.handoff.receiver import Receiver
from common.kv.prefix import PrefixCache
from common.runtime import report_line
from common.runtime.node import NodeRuntime
from common.runtime.prefix_report import PrefixReport
from common.runtime.process import StopEvent
from common.wire.channel import BadMessage, Channel, Poller, node_tag
from common.wire.protocol import (
    FRONTEND_TO_NODE,
    PREFILL_TO_DECODE,
    NodeAbort,
    NodeSync,
    NodeSynced,
    PeerLost,
    PrefillRequest,
    RequestFailed,
    TokenBatch,
    TokenUpdate,
)
from decode_node.batch import Batch, GrammarEnded
from decode_node.grammar_wait import GrammarWait
from decode_node.local import LocalPrefill
from decode_node.preemption import Preemption
from decode_node.report import handoff_figures, log_ready, ready_message
from decode_node.scheduler import DecodeScheduler

log = get_logger("decode")
noisy = Throttle(log)  # lines about what peers send
ENDED_MEMORY = 4096  # requests ended here, remembered for the frontend's NodeSync
IDLE_WAIT_S = 0.02  # how long an idle turn waits on the links


class DecodeNode:
    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg
        # NOTE: prepared here (the model loaded, the KV cache allocated): the parts below
        # are sized by its cache. run() closes it.
        self.worker = DeviceWorker(cfg.worker).prepare()
        w = self.worker
        self.compiles = grammar.Compiles(
            lambda: grammar.for_model(cfg.worker.model, w.spec.vocab_size)
        )
        self.grammars = GrammarWait(self.compiles)  # committed, their grammar compiling
        self.prefix_cache = PrefixCache(w.num_kv_blocks, cfg.is_prefix_caching)
        self.scheduler = DecodeScheduler(
            self.prefix_cache, w.block_size, cfg.worker.max_batch_size, cfg.is_preemptive
        )
        self.scheduler.aside = self.grammars.waiting  # taken ids, in the queue
        self.sink = transfer.KVSink(
            transfer.LocalCache(w.kv_cache, endpoint_host(cfg.kv_reachable), w.kv_shm_name),
            transfer.offered(cfg.kv_transfer, w.device, not is_loopback_endpoint(cfg.kv_reachable)),
            is_layerwise=cfg.kv_layerwise != "off",
        )
        self.local = LocalPrefill(w, self.scheduler, cfg.max_queue)
        self.ended = Recent(ENDED_MEMORY)  # the latest requests that ended here
        self.batch = Batch(w, self.scheduler, self.compiles, self.ended)
        self.preemption = Preemption(w, self.scheduler, cfg.swap_space, self.batch.resumed)
        self.in_flight: DecodeTicket | None = None  # the step on the device
        self.pending_aborts: set[str] = set()  # running: removed between steps, not under one
        self.num_forked = 0  # sequences admitted over another's prompt blocks (n > 1)
        self.line = report_line.PeriodicLine(log, cfg.links.log_interval_s)

    # ---- the loop ---------------------------------------------------------

    def run(self, stop: StopEvent) -> int:
        """Serve until stopped; the process's exit code (1: refused by the frontend)."""
        with contextlib.ExitStack() as parts:  # parts close as they were made, last first
            parts.callback(self.worker.close)
            parts.callback(self.sink.close)
            parts.callback(self.compiles.close)
            self._open_links(stop, parts)
            self.runtime.start(self._send_ready, self.stats, self._is_empty)
            log_ready(self.cfg, self.worker, self.prefix_cache.capacity, self.sink.accepted)
            while not stop.is_set():
                self.turn()
        return self.runtime.exit_code

    def _open_links(self, stop: StopEvent, parts: contextlib.ExitStack) -> None:
        """The links and what talks on them: the node's runtime (the frontend's link), the
        KV link prefill nodes write to, and the handoff that answers them on it. NOTE: made
        here, on the loop's thread: a ZeroMQ socket is used only on the thread that made it
        (tests run the loop on a thread of their own); the runtime stops with run()'s stop."""
        cfg, w = self.cfg, self.worker
        rt = self.runtime = NodeRuntime(
            "decode",
            cfg.name,
            cfg.frontend_endpoint,
            cfg.keys_dir,
            cfg.links,
            stop,
            log,
            cfg.drain_timeout_s,
        )
        parts.callback(rt.term)
        parts.callback(rt.close)
        self.frontend = rt.frontend
        kv_limit = 64 * 2**20 + w.max_model_len * w.block_bytes() // w.block_size
        # With keys, only the cluster's nodes get past the handshake.
        self.kv = Channel(rt.ctx, True, cfg.kv_endpoint, max_message_bytes=kv_limit, domain="nodes")
        parts.callback(self.kv.close)
        self.poller = Poller(self.frontend, self.kv)
        # NOTE: a step that waits for a prefill pass's cores still reads the links (its grants)
        w.decode.runner.while_yielding = self._read_links
        self.handoff = Receiver(
            epoch=rt.epoch,
            lease_s=cfg.reservation_lease_s,
            max_queue=cfg.max_queue,
            pool=self.scheduler,
            sink=self.sink,
            send=self.kv.send,
            vocab_size=w.spec.vocab_size,
            max_model_len=w.max_model_len,
            is_verifying=cfg.is_kv_verified,
        )
        self.prefix_report = PrefixReport(cfg.name, self.prefix_cache, rt, cfg.is_prefix_caching)

    def turn(self) -> None:
        """One turn: read the links; with no step on the device the batch may change, and
        the next step is launched; with one in flight, the pipelined turn; then upkeep."""
        self._receive()
        if self.in_flight is not None:
            self._pipelined_turn()
        else:
            self._apply_aborts()
            # NOTE: first tokens go now, not after the launch: on the host the step runs in it
            self._send(self._admit())
            self.preemption.make_room()
            self.in_flight = self.batch.launch()
        self._end_turn()

    def _pipelined_turn(self) -> None:
        """Step k runs. Queue step k+1 behind it when the batch stays as it is, so the device
        never waits for this host work; then read the links until step k is done (nothing
        read changes the batch: aborts wait for the next turn) and send its tokens."""
        running = self.in_flight
        upcoming = self.batch.launch() if self._can_pipeline() else None
        self.grammars.ask(self.handoff)  # compiles start at commit here too
        while not self.worker.decode.is_done(running):
            self._read_links(timeout=0)
        self._send(self.batch.collect(running, is_next_launched=upcoming is not None))
        self.in_flight = upcoming

    # ---- receive ----------------------------------------------------------

    def _receive(self) -> None:
        """Everything waiting on both links (an idle node waits IDLE_WAIT_S for it); then the
        handoff's leases expire and its waiting line is granted, with the renewals just read."""
        # NOTE: the transfers move first, every turn: one this process drives (nixl) lands
        # only as it is polled (is_landed polls it too: polling more is harmless), and while
        # one is under way the loop must not sleep on the links, which its landing never wakes.
        is_moving = self.handoff.progress()
        self._read_links(timeout=0 if is_moving or self._has_work() else IDLE_WAIT_S)
        self.handoff.turn()

    def _has_work(self) -> bool:
        s = self.scheduler
        return bool(
            self.in_flight
            or s.running
            or self.handoff.ready
            or self.local.waiting
            or s.preempted
            or self.grammars.waiting
        )

    def _read_links(self, timeout: float) -> None:
        """Everything waiting on both links, waiting up to timeout for the first."""
        for ch in self.poller.wait(timeout):
            self._read(ch)

    def _read(self, ch: Channel) -> None:
        """Every message waiting on one link."""
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
        return {
            *self.scheduler.held_ids(),
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
        """Aborted running sequences leave the batch (between steps)."""
        for rid in self.pending_aborts:
            if rid in self.scheduler.running:
                self.batch.finish(rid, in_batch=True, count=False)
        self.pending_aborts.clear()

    # ---- admit --------------------------------------------------------------

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
            update = self._join(done.seq, done.token, done.logprobs, done.timings)
            if update is not None:
                updates.append(update)
        return updates

    def _fail_committed(self, r, error: str, is_retryable: bool) -> None:
        """A committed request whose grammar failed: its blocks go back, its sequences fail
        (retryable: this node's fault, it moves on; else the grammar's own, a 400)."""
        self._give_back(r)
        for rid in [r.request_id, *r.fork_ids]:
            self.ended.add(rid)
            failed = RequestFailed(rid, error, is_retryable, is_bad_request=not is_retryable)
            self.runtime.send(failed)

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

    def _join(self, seq, token: int, logprobs, timings: dict, compiled=None) -> TokenUpdate | None:
        """A newly admitted sequence joins the batch (batch.py); its first update, or None
        if its grammar cannot go on from its tokens (the request fails)."""
        try:
            return self.batch.join(seq, token, logprobs, timings, compiled)
        except GrammarEnded as e:
            self.runtime.send(RequestFailed(seq.request_id, str(e), is_bad_request=True))
            return None

    def _can_pipeline(self) -> bool:
        """The next step may run before this one's tokens are seen only where steps are
        queued (on the host, where a step runs in its launch, it would only hold these
        tokens back a step) and the batch will not change: no abort or admission, no
        preempted request that could resume, and nothing the running sequences forbid
        (Batch.can_run_ahead)."""
        return (
            self.worker.is_step_queued
            and not self.pending_aborts
            and not self._can_admit_ready()
            and not self.local.is_runnable()
            and not (self.scheduler.joining and self.scheduler.has_row())
            and not self.scheduler.next_resumable()
            and self.batch.can_run_ahead()
        )

    def _can_admit_ready(self) -> bool:
        return self.scheduler.can_admit() and (
            self.handoff.has_ready() or self.grammars.has_ended()
        )

    # ---- send and report ------------------------------------------------------

    def _send(self, updates: list[TokenUpdate]) -> None:
        """The turn's tokens to the frontend, one message for all; then who failed in it."""
        if updates:
            self.runtime.send(TokenBatch(updates))
        while self.batch.failed:
            self.runtime.send(RequestFailed(*self.batch.failed.pop(), is_bad_request=True))

    def _end_turn(self) -> None:
        """Each turn's upkeep: the device's idle time, the runtime (registration, heartbeat,
        draining), the prefix cache's report, the periodic line."""
        if self.in_flight is None and not self.scheduler.running:
            self.worker.decode.runner.mark_idle()
        self.runtime.turn()
        self.prefix_report.turn()
        self._log_line()

    def _send_ready(self) -> bool:
        msg = ready_message(self.cfg, self.worker, self.runtime.epoch)
        return self.frontend.send(msg, block=False)

    def _is_empty(self) -> bool:
        h = self.handoff
        return not (
            self.scheduler.holds_any()
            or h.held
            or h.ready
            or h.waiting
            or self.local.waiting
            or self.grammars.waiting
        )

    def stats(self) -> dict:
        return {
            **self.worker.stats(),
            **self.batch.stats(),
            "num_queued": len(self.handoff.ready) + len(self.grammars.waiting),
            **handoff_figures(self.handoff),
            **self.preemption.stats(),
            "num_forked": self.num_forked,
            **self.scheduler.stats(),
            "num_bad_messages": self.frontend.num_bad + self.kv.num_bad,
            "num_link_resets": self.runtime.num_link_resets + self.kv.num_reroutes,
            "is_registered": self.runtime.is_registered,
            **self.local.stats(),
        }

    def _log_line(self) -> None:
        """The periodic line: while busy, and once as the node goes idle."""
        if (elapsed := self.line.due_s()) is not None:
            num_tokens, num_steps = self.batch.take_log_counts()
            self.line.say(*report_line.decode(self.stats(), num_tokens, num_steps, elapsed))
