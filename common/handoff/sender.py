"""The prefill node's half of a handoff: reserve -> write -> commit.

A request's reservation is asked for when it arrives; its write starts right behind the
pass that computed its KV, or during it, layer by layer, chunk by chunk (writes.py); its
local blocks are freed when the write completes; the commit goes once the first token is
sampled too. A handoff not acknowledged within the handoff lease after its prefill, or
whose decode node leaves a KVReserve unanswered that long, fails, and what it holds on
both sides is released. Every write is stopped at a deadline before its reservation can
end (lease.py), whatever the peer does. Asks are numbered and answers echo the number; a
grant is named, and the writes and the commit name it. When the KV link is made again (a
reset), what may have been lost on it is asked again (a repeated commit is the same one);
when its data connection is, what sent KV on it fails over. NOTE: ipc writes straight into
the decode node's memory: a write into blocks whose reservation has ended could land in
another request's KV (lease.py).
"""

from __future__ import annotations

import time
from typing import Callable

from common.base.log import get_logger
from common.base.recent import Recent
from common.handoff import asks, peer_events, writes
from common.handoff.links import KVLinks
from common.handoff.states import DecodePeer, Handoff, Job, Link, Stage
from common.kv.blocks import num_blocks_for
from common.transfer import KVWriter, TransferError
from common.wire.figures import TransferFigures
from common.wire.protocol import HandoffAck, KVCommit, KVRelease, KVReserved, KVWelcome

log = get_logger("prefill")
HANDED_OFF_MEMORY = 4096  # requests handed to their decode node, remembered for NodeSync


class Sender:
    """Every handoff of one prefill node, to any decode node. connect and open_writer:
    links.py's; free_blocks(ids) gives local blocks back once written; drop_job(job) takes
    a job that ends unwritten off the prefill scheduler and frees its blocks; fail(request_id,
    error, is_retryable) tells the frontend (retryable: the decode node restarted, went
    silent or the write failed, so the request may go on elsewhere)."""

    def __init__(
        self,
        *,
        name: str,
        handoff_lease_s: float,
        block_size: int,
        block_bytes: int,
        connect: Callable[[str, str, str, int | None], Link],
        open_writer: Callable[[KVWelcome, Callable], KVWriter],
        free_blocks: Callable[[list[int]], None],
        drop_job: Callable[[Job], None],
        fail: Callable[[str, str, bool], None],
        clock: Callable[[], float] = time.monotonic,
        checksums: Callable[[list[int], str], object] | None = None,
        num_layers: int = 0,
        layerwise: str = "off",
        wire_dtype: str = "same",
        prefill_s: Callable[[int], float] = lambda num_tokens: 0.0,
    ):
        """checksums (--kv-verify): (local block ids, the wire's format) -> their checksums as
        the decode node lands them (a device tensor, queued with the write), sent with the
        commit. layerwise: --kv-layerwise (writes.py); wire_dtype: --kv-wire-dtype; prefill_s:
        a prompt's length -> the seconds its prefill is expected to take (0: unknown)."""
        self.handoff_lease_s = handoff_lease_s
        self.wire_dtype, self.prefill_s = wire_dtype, prefill_s
        self.num_layers = num_layers
        self.layerwise = layerwise
        self.checksums = checksums
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.links = KVLinks(name, connect, open_writer, clock)
        self.free_blocks = free_blocks
        self.drop_job = drop_job
        self.fail = fail
        self.clock = clock
        self.by_id: dict[str, Handoff] = {}
        # n > 1: each fork's id -> its request's (a key of by_id)
        self.fork_of: dict[str, str] = {}
        self.num_handoffs = 0
        self.bytes_written = 0
        self.transfers: dict[str, TransferFigures] = {}  # by backend
        self.num_bad_replies = 0
        self.handed_off = Recent(HANDED_OFF_MEMORY)  # requests its decode node took: its now
        self.num_asks = 0  # the last ask's number (asks.py)
        self.num_link_resets = 0

    # ---- peers --------------------------------------------------------------

    def _on_welcome(self, peer: DecodePeer, w: KVWelcome) -> None:
        if w.epoch != peer.epoch:
            peer_events.on_restart(self, peer, w)

    def count_failed(self, peer: DecodePeer) -> None:
        self._figures(peer).num_failed += 1

    def receive(self, link: Link) -> None:
        """Everything waiting on one decode node's KV link."""
        on = {KVWelcome: self._on_welcome, KVReserved: self._on_reserved, HandoffAck: self._on_ack}
        for peer, msg in self.links.messages(link):
            if type(msg) in on:
                on[type(msg)](peer, msg)
            else:
                log.warning("dropped a bad message from decode node %s: %s", peer.name, msg.error)

    @property
    def num_bad(self) -> int:
        return self.num_bad_replies + self.links.num_bad

    # ---- one request ----------------------------------------------------------

    def begin(self, job: Job) -> None:
        """A request is accepted: ask its decode node for blocks now."""
        peer = self.links.peer_for(job.decode_node, job.decode_kv_endpoint)
        h = self.by_id[job.request_id] = Handoff(job, peer)
        self.fork_of.update((f.request_id, job.request_id) for f in job.forks)
        # NOTE: a write pushed layer by layer needs its grant before the pass: no early start then
        kv_bytes = num_blocks_for(job.prompt_len, self.block_size) * self.block_bytes
        job.is_peer_granting = (
            peer.is_granting
            and peer.writer is not None
            and not writes.goes_layerwise(
                peer, self.layerwise, kv_bytes, writes.rate_to(peer, self.transfers)
            )
        )
        if peer.epoch is None:
            self.links.hello(peer)
        asks.ask(self, h)

    def _on_reserved(self, peer: DecodePeer, r: KVReserved) -> None:
        asks.on_reserved(self, peer, r)

    def _on_ack(self, peer: DecodePeer, ack: HandoffAck) -> None:
        h = self.by_id.get(ack.request_id)
        if h is None or h.peer is not peer:
            return
        if ack.is_accepted:
            self.num_handoffs += 1
            if h.peer.writer is not None:  # the rate the decode node got its KV at
                writes.observe_ack(h, self._figures(h.peer), self.clock(), h.wire_bytes)
            for rid in h.ids:
                self.handed_off.add(rid)
            self.end_handoff(h, None)
        else:
            self.end_handoff(
                h, f"decode node refused the request: {ack.reason}", is_retryable=ack.is_retryable
            )

    def push_layers(self, parts: list[tuple[Job, int | None]], num_done: int) -> None:
        """In the pass, the first num_done layers of each (prompt, the blocks its chunk
        completes; None: all, its last chunk) queued: layer-wise writes start or go on (none
        ends)."""
        for job, end_block in parts:
            h = self.by_id.get(job.request_id)
            if h is not None and (h.layers_sent >= 0 or self._can_write(h, is_partial=True)):
                self._write(h, num_done, end_block)
        self.links.flush()

    def start_writes(self, jobs: list[Job]) -> None:
        """These prompts' KV is queued on the device: start the writes that can start, or end
        those pushed layer by layer. Called inside the pass: nothing here may end a handoff."""
        for job in jobs:
            h = self.by_id.get(job.request_id)
            if h is not None:
                h.is_kv_queued = True
                if h.layers_sent >= 0 or self._can_write(h):
                    self._write(h)
        self.links.flush()  # what is ready goes now, before the first tokens are sampled

    def set_first_token(self, job: Job, first_token: int, timings: dict, logprobs=None) -> None:
        h = self.by_id.get(job.request_id)
        if h is not None:
            h.first_token = first_token
            # NOTE: the node's own stamps, which its first token's update carries too
            timings.update(h.timings)  # the write's (its wire's format), if it began
            h.timings = timings
            h.first_logprobs = logprobs
            h.lease_deadline = self.clock() + self.handoff_lease_s
            self._commit(h)

    def abort(self, request_id: str) -> None:
        """The request ends here, unless it is one of n sequences others of which go on."""
        h = self.by_id.get(self.fork_of.get(request_id, request_id))
        if h is not None and h.give_up(request_id):
            self.end_handoff(h, None, release=h.dst_block_ids is not None)

    def holds(self, request_id: str) -> bool:
        """Its handoff (or that of the request it forks) is on."""
        return request_id in self.by_id or request_id in self.fork_of

    # ---- progress ---------------------------------------------------------------

    def advance(self) -> None:
        """Start writes, send commits, ask and renew, end handoffs whose time has run out."""
        for peer in self.links.take_reconnected():
            peer_events.on_reconnect(self, peer)
        for peer in self.links.take_data_resets():
            peer_events.on_reconnect(self, peer, is_data=True)
        for peer in self.links.peers.values():
            if peer.writer is not None:
                for rid, error in peer.writer.poll():
                    self._finish_write(self.by_id.get(rid), error)
        now, lease_s = self.clock(), self.handoff_lease_s
        for h in list(self.by_id.values()):
            held = h.dst_block_ids is not None
            if h.stage in (Stage.WRITING, Stage.CANCELLING):
                # The device may still read its blocks: it ends when the writer says so (by
                # its deadline; told again here, whatever happened), or is renewed.
                if now > h.write_deadline and h.peer.writer is not None:
                    if h.stage is Stage.WRITING:
                        # NOTE: CANCELLING until the writer says it has stopped: a later pass
                        # pushes nothing more, and the blocks here are freed only then.
                        self._fail_write(
                            h, "its KV write did not complete before its reservation could end"
                        )
                    h.peer.writer.cancel(h.job.request_id)
                elif writes.renew_open(h, now):
                    asks.ask(self, h)
                continue
            if h.stage is Stage.CANCELLED:
                self.end_handoff(h, h.error, release=held)
            elif h.peer.error and h.epoch == h.peer.epoch:
                # NOTE: only what the process whose cache could not be opened answered (a
                # welcome can come from a node on its way out, its cache gone); others wait
                # for their answer, or its successor's welcome.
                self.end_handoff(h, h.peer.error, release=held)
            elif h.silent_since is not None and now - h.silent_since > lease_s:
                self.end_handoff(
                    h,
                    f"decode node {h.peer.name} did not answer for a reservation within "
                    f"{lease_s:.0f}s",
                    release=held,
                    is_retryable=True,
                )
            elif now > h.lease_deadline:
                self.end_handoff(
                    h,
                    f"decode node did not confirm the KV handoff within {lease_s:.0f}s",
                    release=held,
                    is_retryable=True,
                )
            elif h.stage in (Stage.ASKING, Stage.QUEUED):
                if now >= h.next_ask_at:
                    asks.ask(self, h)
            elif h.stage is Stage.RESERVED and now >= h.lease.end:
                log.warning(
                    "reservation of %s on %s ran out before its write: reserving again",
                    h.job.request_id,
                    h.peer.name,
                )
                # NOTE: nothing was written: released now, or the decode node would hold the
                # blocks (and refuse this request) for one more lease, as it must for a writer
                # that might still be copying.
                h.peer.link.send(KVRelease(h.job.request_id, h.reservation), block=False)
                h.drop_reservation(self.clock())
            else:
                if self._can_write(h):
                    self._write(h)
                elif h.epoch != h.peer.epoch:
                    self.links.hello(h.peer)
                if now >= h.next_ask_at and h.stage is not Stage.COMMITTED:
                    asks.ask(self, h)  # renew

    def _can_write(self, h: Handoff, is_partial: bool = False) -> bool:
        return writes.can_start(
            h,
            self.clock(),
            is_partial,
            self.layerwise,
            writes.rate_to(h.peer, self.transfers),
            self.block_bytes,
        )

    def _write(self, h: Handoff, num_done: int | None = None, end_block: int | None = None) -> None:
        try:
            if h.stage is Stage.RESERVED:
                rate, is_tail = writes.wire_rate_to(h.peer, self.transfers)
                # pushed layer by layer (num_done) by a writer that does: beside its prefill
                is_beside = num_done is not None and h.peer.writer.is_layerwise and not is_tail
                hidden_s = self.prefill_s(h.job.prompt_len) if is_beside else 0.0
                writes.choose_wire(h, self.wire_dtype, rate, self.block_bytes, hidden_s)
            writes.write(h, self.num_layers, num_done, self.checksums, self.clock, end_block)
        except TransferError as e:
            self._figures(h.peer).num_failed += 1
            h.error = f"KV transfer to {h.peer.name} failed: {e}"
            h.is_retryable = True
            if h.stage is Stage.WRITING:  # begun: it ends in poll(), then advance() fails it
                h.peer.writer.cancel(h.job.request_id)
                h.stage = Stage.CANCELLING
            else:
                h.stage = Stage.CANCELLED  # advance() releases the reservation and fails it

    def _fail_write(self, h: Handoff, error: str) -> None:
        """Its write failed (the path's fault: retryable, the first error kept): it ends
        once the writer says it has stopped."""
        self._figures(h.peer).num_failed += 1
        h.error = h.error or error
        h.is_retryable = True
        h.stage = Stage.CANCELLING

    def _finish_write(self, h: Handoff | None, error: str | None) -> None:
        if h is None or h.stage not in (Stage.WRITING, Stage.CANCELLING):
            return
        if error is not None and h.stage is Stage.WRITING:  # not a write its handoff stopped
            if self.clock() > h.write_deadline:
                error = "it did not complete before its reservation could end"
            # ends below; advance() releases the reservation and fails it
            self._fail_write(h, f"KV transfer to {h.peer.name} failed: {error}")
        elif h.stage is Stage.WRITING:
            self.bytes_written += h.wire_bytes
            is_pushed = h.layers_sent >= 0 and h.peer.writer.is_layerwise
            is_chunked = is_pushed and h.blocks_sent > 0  # begun a pass before
            self._figures(h.peer).observe(
                self.clock() - h.write_started, h.wire_bytes, is_pushed, is_chunked, h.wire
            )
        h.stage = Stage.WRITTEN if h.stage is Stage.WRITING else Stage.CANCELLED
        h.written_at = time.time()
        self.free_blocks(h.job.block_ids)  # the decode node holds them now
        h.job.block_ids = []
        self._commit(h)

    def _commit(self, h: Handoff) -> None:
        """Once the blocks are written and the first token is sampled (either order)."""
        if h.stage is Stage.WRITTEN and h.first_token is not None:
            h.timings["written"] = h.written_at
            h.stage = Stage.COMMITTED
            self.send_commit(h)

    def send_commit(self, h: Handoff) -> None:
        j = h.job
        if h.checksums is not None and not isinstance(h.checksums, list):
            h.checksums = h.checksums.tolist()
        h.peer.link.send(
            KVCommit(
                j.request_id,
                j.prompt_len,
                h.first_token,
                j.params,
                h.timings,
                h.peer.writer.name if h.peer.writer else "",
                j.token_ids,
                h.reservation,
                h.num_written,
                h.checksums,
                h.first_logprobs,
                j.forks,
            ),
            block=False,
        )

    def end_handoff(
        self, h: Handoff, error: str | None, release: bool = False, is_retryable: bool = False
    ) -> None:
        """Drop the handoff and free what it holds here (and there, if release); fail the
        request if error."""
        if h.error is None:
            h.error = error
            h.is_retryable = is_retryable
        if h.stage in (Stage.WRITING, Stage.CANCELLING):
            # NOTE: blocks under a write are freed only when it ends; one that can be
            # stopped (a network write to a silent peer) is.
            if h.stage is Stage.WRITING:
                h.peer.writer.cancel(h.job.request_id)
            h.stage = Stage.CANCELLING
            return
        self.by_id.pop(h.job.request_id, None)
        for rid in h.ids[1:]:
            self.fork_of.pop(rid, None)
        if release or h.stage is Stage.QUEUED:  # its blocks, or its place in line
            h.peer.link.send(KVRelease(h.job.request_id, h.reservation), block=False)
        self.drop_job(h.job)
        for rid in h.ids if h.error else ():
            self.fail(rid, h.error, h.is_retryable)

    # ---- figures ------------------------------------------------------------------

    @property
    def is_writing(self) -> bool:
        """A write under way that this loop drives (not one waiting on its peer)."""
        return any(
            h.stage in (Stage.WRITING, Stage.CANCELLING)
            and h.peer.writer is not None
            and not h.peer.writer.is_stalled
            for h in self.by_id.values()
        )

    @property
    def num_pending(self) -> int:  # prompts done, waiting for their handoff to be committed
        return sum(h.first_token is not None for h in self.by_id.values())

    def _figures(self, peer: DecodePeer) -> TransferFigures:
        """Its writer's backend's (it has one)."""
        return self.transfers.setdefault(peer.writer.name, TransferFigures())

    def transfer_figures(self) -> dict[str, dict]:
        """Each backend's, by name (the stats' kv_writes)."""
        return {name: f.as_dict() for name, f in self.transfers.items()}

    def close(self) -> None:
        self.links.close()
