"""Handoffs from this prefill node to decode nodes: reserve -> write -> commit.

A request's reservation is asked for when it arrives; its prompt is prefilled
once the blocks are reserved (or, at light load, while the answer is on its
way: prefill_node/scheduler.py), and the transfer
backend writes them right behind the forward pass. When the write has
completed the local blocks are freed, and the commit goes out once the first
token is sampled too. A handoff not committed and acknowledged within the
lease after its prefill ended, or whose decode node leaves a reservation
request unanswered that long, is failed and everything it holds, here and on
the decode node, is released.

A reservation has a lease on the decode node too, counted from when our
KVReserve reached it; until the commit, the same KVReserve is sent again every
third of it to renew it. Our view of its end is counted from when we sent the
request answered (so it is never later than the decode node's), and no write
starts in the last third of it.
NOTE: ipc writes straight into the decode node's memory: a write into blocks
whose reservation has ended could land in another request's KV.
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from common import transfer
from common.wire.channel import Channel, Poller
from common.base.config import PrefillConfig
from common.kv.blocks import (BlockAllocator, block_bytes, cache_block_size, is_cache_shape,
                              num_blocks_for, num_cache_blocks)
from common.base.log import get_logger
from common.wire.protocol import (DECODE_TO_PREFILL, HandoffAck, KVCommit, KVHello, KVRelease,
                             KVReserve, KVReserved, KVWelcome)
from prefill_node.scheduler import PrefillJob, PrefillScheduler

log = get_logger("prefill")
RETRY_S = 0.05      # a retryable refusal (decode node and its line full) is asked again after
MAX_RETRY_S = 0.8   # this, doubling up to this: a long backlog must not flood the decode node
HELLO_EVERY_S = 1.0


@dataclass
class DecodePeer:
    name: str
    endpoint: str
    channel: Channel
    epoch: str | None = None              # of the welcome the writer was opened from
    writer: transfer.KVWriter | None = None
    error: str | None = None              # why this decode node cannot be written to
    hello_at: float = 0.0
    num_blocks: int = 0                   # in its cache, from its welcome
    is_granting: bool = False             # its last answer granted blocks at once


@dataclass
class Handoff:
    job: PrefillJob
    peer: DecodePeer
    dst_block_ids: list[int] | None = None
    epoch: str | None = None              # the decode node's, when it reserved
    next_reserve_at: float = 0.0          # 0: a reservation request is out
    reserve_sent: deque = field(default_factory=deque)   # monotonic send times of unanswered KVReserves
    silent_since: float | None = None     # asked the decode node, no answer yet (monotonic)
    is_queued: bool = False               # waiting its turn there: the blocks come unasked
    queued_at: float = float("-inf")      # when the request it queued was sent (monotonic)
    reserved_until: float = float("inf")  # our view of the reservation's end (monotonic)
    renew_at: float = float("inf")
    lease_s: float = 0.0                  # the decode node's; 0: held until released
    num_refusals: int = 0                 # retryable ones in a row
    first_token: int | None = None        # set when the prompt is done
    timings: dict = field(default_factory=dict)
    lease_deadline: float = float("inf")
    is_computed: bool = False             # every layer's KV is queued on the device
    is_writing: bool = False
    is_written: bool = False              # local blocks freed
    written_at: float = 0.0
    is_commit_sent: bool = False
    is_aborted: bool = False
    error: str | None = None              # why it ends, once its write has finished


class Handoffs:
    def __init__(self, ctx, cfg: PrefillConfig, cache, prefix_cache: BlockAllocator,
                 scheduler: PrefillScheduler, poller: Poller, fail: Callable[[str, str], None]):
        self.ctx, self.cfg, self.cache = ctx, cfg, cache
        self.prefix_cache, self.scheduler, self.poller = prefix_cache, scheduler, poller
        self.fail = fail
        self.peers: dict[str, DecodePeer] = {}      # by KV endpoint
        self.by_id: dict[str, Handoff] = {}
        self.num_handoffs = 0
        self.bytes_written = 0
        self.num_bad_replies = 0

    # ---- peers --------------------------------------------------------------

    def peer_for(self, name: str, endpoint: str) -> DecodePeer:
        peer = self.peers.get(endpoint)
        if peer is None:
            # With keys, the decode node must prove the key of the name the frontend chose.
            ch = Channel(self.ctx, False, endpoint, identity=f"{self.cfg.name}/{os.getpid()}", is_immediate=True,
                         max_message_bytes=self.cfg.links.max_message_bytes, server=name)
            peer = self.peers[endpoint] = DecodePeer(name, endpoint, ch)
            self.poller.add(ch)
        peer.name = name
        return peer

    def _hello(self, peer: DecodePeer) -> None:
        now = time.monotonic()
        if now - peer.hello_at >= HELLO_EVERY_S and peer.channel.send(KVHello(self.cfg.name), block=False):
            peer.hello_at = now

    def _on_welcome(self, peer: DecodePeer, w: KVWelcome) -> None:
        if w.epoch == peer.epoch:
            return
        if peer.writer is not None:
            peer.writer.close()   # waits for its copies: their blocks may be freed now
            for h in self.by_id.values():
                if h.peer is peer and h.is_writing:
                    h.is_writing, h.is_aborted = False, True
                    h.error = f"decode node {peer.name} restarted during the KV write"
        peer.writer, peer.epoch, peer.error = None, w.epoch, None
        peer.num_blocks = num_cache_blocks(w.cache_shape) if is_cache_shape(w.cache_shape) else 0
        try:
            peer.writer = transfer.open_writer(self.cfg.kv_transfer, w, self.cache,
                                               lambda m: peer.channel.send(m, block=False))
            log.info("KV link to %s (%s): %s transfer", peer.name, peer.endpoint, peer.writer.name)
        except transfer.TransferError as e:
            peer.error = f"cannot hand KV to decode node {peer.name}: {e}"
            log.error("%s", peer.error)
        for h in self.by_id.values():   # reservations from an earlier life of that node are void
            if h.peer is peer and h.epoch not in (None, w.epoch) and not h.is_writing:
                self._drop_reservation(h)

    def receive(self, ch: Channel) -> None:
        peer = next(p for p in self.peers.values() if p.channel is ch)
        while ch.has_message():
            _, msg = ch.recv(DECODE_TO_PREFILL)
            if isinstance(msg, KVWelcome):
                self._on_welcome(peer, msg)
            elif isinstance(msg, KVReserved):
                self._on_reserved(peer, msg)
            elif isinstance(msg, HandoffAck):
                self._on_ack(peer, msg)
            else:
                log.warning("dropped a bad message from decode node %s: %s", peer.name, msg.error)

    @property
    def num_bad(self) -> int:
        return self.num_bad_replies + sum(p.channel.num_bad for p in self.peers.values())

    # ---- one request ----------------------------------------------------------

    def begin(self, job: PrefillJob) -> None:
        """A request is accepted: ask its decode node for blocks now."""
        peer = self.peer_for(job.decode_node, job.decode_kv_endpoint)
        h = self.by_id[job.request_id] = Handoff(job, peer, next_reserve_at=time.monotonic())
        job.is_peer_granting = peer.is_granting and peer.writer is not None
        if peer.epoch is None:
            self._hello(peer)
        self._reserve(h)

    def _reserve(self, h: Handoff) -> None:
        """Ask for the blocks, or renew them once reserved."""
        msg = KVReserve(h.job.request_id, h.job.prompt_len, h.job.params.max_tokens)
        now = time.monotonic()
        if h.silent_since is None:
            h.silent_since = now
        if h.peer.channel.send(msg, block=False):
            h.reserve_sent.append(now)
            h.next_reserve_at = 0.0
            h.renew_at = float("inf")
        elif h.dst_block_ids is None:
            h.next_reserve_at = now + RETRY_S   # not connected yet
        else:
            h.renew_at = now + RETRY_S

    def _drop_reservation(self, h: Handoff) -> None:
        """Its blocks there are not ours to write any more: ask again."""
        # NOTE: reserve_sent is kept: answers still on the way pair with its times.
        h.dst_block_ids, h.epoch, h.next_reserve_at = None, None, time.monotonic()
        h.reserved_until = h.renew_at = float("inf")
        h.job.is_reserved = h.is_queued = False

    def _on_reserved(self, peer: DecodePeer, r: KVReserved) -> None:
        h = self.by_id.get(r.request_id)
        if h is None or h.peer is not peer:
            if r.block_ids is not None:
                peer.channel.send(KVRelease(r.request_id), block=False)  # nobody wants it now
            return
        h.silent_since = None
        # NOTE: answers come in the order asked; an answer to a request sent before a
        # restart of the decode node pairs with an older time, which only shortens the lease,
        # and an answer nobody asked for grants none (it is asked again). Blocks granted
        # from the waiting line answer no request: they were granted after the request
        # that queued reached the decode node.
        if r.is_queued and r.block_ids is not None:
            sent_at = h.queued_at if h.is_queued else float("-inf")
        else:
            sent_at = h.reserve_sent.popleft() if h.reserve_sent else float("-inf")
        if h.dst_block_ids is not None:
            if r.block_ids == h.dst_block_ids and r.epoch == h.epoch:
                self._lease(h, sent_at, r.lease_s)   # renewed
                return
            if h.is_writing or h.is_written:
                return   # the commit's answer says whether the blocks were still ours
            # Our reservation ended there (new blocks, or a refusal): start from this answer.
            # NOTE: after a refusal, release what was ours: an aborted request's blocks stay
            # reserved there until released (a write may be landing in them).
            if r.block_ids is None:
                h.peer.channel.send(KVRelease(r.request_id), block=False)
            self._drop_reservation(h)
        peer.is_granting = r.block_ids is not None and not r.is_queued
        if r.block_ids is None:
            if r.is_queued:
                h.is_queued, h.queued_at, h.epoch, h.num_refusals = True, sent_at, r.epoch, 0
                h.next_reserve_at = time.monotonic() + r.lease_s / 3 if r.lease_s else 0.0  # keeps its place
            elif r.is_retryable:   # its line is full too: ask again soon
                h.is_queued = False
                h.next_reserve_at = time.monotonic() + min(RETRY_S * 2 ** h.num_refusals, MAX_RETRY_S)
                h.num_refusals += 1
                if h.first_token is not None:
                    # The decode node answers, and is full: waiting on it is backpressure, not
                    # a lost handoff (the request's own deadline still bounds the wait).
                    h.lease_deadline = time.monotonic() + self.cfg.handoff_lease_s
            else:
                h.is_queued = False
                self._end(h, f"decode node refused the request: {r.reason}")
            return
        if h.is_aborted:
            peer.channel.send(KVRelease(r.request_id), block=False)
            self._end(h, None)
            return
        num_needed = num_blocks_for(h.job.prompt_len, cache_block_size(self.cache.shape))
        if len(r.block_ids) != num_needed or len(set(r.block_ids)) != num_needed:
            self.num_bad_replies += 1
            peer.channel.send(KVRelease(r.request_id), block=False)
            self._end(h, f"decode node {peer.name} reserved {len(r.block_ids)} blocks, not one "
                         f"distinct block per prompt block")
            return
        h.dst_block_ids, h.epoch = list(r.block_ids), r.epoch
        h.job.is_reserved, h.is_queued, h.num_refusals = True, False, 0   # its prefill may start now
        self._lease(h, sent_at, r.lease_s)
        if r.epoch != peer.epoch:
            self._hello(peer)   # a decode node we have not mapped (or that restarted)

    @staticmethod
    def _lease(h: Handoff, sent_at: float, lease_s: float) -> None:
        h.lease_s = lease_s
        if lease_s > 0:
            h.reserved_until = sent_at + lease_s
            h.renew_at = time.monotonic() + lease_s / 3
        else:   # held until released
            h.reserved_until = h.renew_at = float("inf")

    def _on_ack(self, peer: DecodePeer, ack: HandoffAck) -> None:
        h = self.by_id.get(ack.request_id)
        if h is None or h.peer is not peer:
            return
        if ack.is_accepted:
            self.num_handoffs += 1
            self._end(h, None)
        else:
            self._end(h, f"decode node refused the request: {ack.reason}")

    def computed(self, jobs: list[PrefillJob]) -> None:
        """These prompts' KV is queued on the device: start the writes that can start.
        Called inside the forward pass, so nothing here may end a handoff."""
        for job in jobs:
            h = self.by_id.get(job.request_id)
            if h is not None:
                h.is_computed = True
                if self._can_write(h):
                    self._write(h)

    def prefilled(self, job: PrefillJob, first_token: int, timings: dict) -> None:
        h = self.by_id.get(job.request_id)
        if h is None:
            return
        h.first_token, h.timings = first_token, timings
        h.lease_deadline = time.monotonic() + self.cfg.handoff_lease_s
        self._commit(h)

    def abort(self, request_id: str) -> None:
        h = self.by_id.get(request_id)
        if h is not None:
            h.is_aborted = True
            self.advance()

    # ---- progress ---------------------------------------------------------------

    def advance(self) -> None:
        """Start writes whose blocks are reserved, send commits for finished writes,
        retry reservations, and end handoffs whose lease has run out."""
        now = time.monotonic()
        for peer in self.peers.values():
            if peer.writer is not None:
                for rid in peer.writer.poll():
                    self._written(self.by_id.get(rid))
        for h in list(self.by_id.values()):
            if h.is_writing:
                continue   # the device still reads its blocks: wait for the write
            if h.is_aborted:
                if h.dst_block_ids is not None:
                    h.peer.channel.send(KVRelease(h.job.request_id), block=False)
                self._end(h, h.error)
            elif h.peer.error:
                self._end(h, h.peer.error)
            elif h.silent_since is not None and now - h.silent_since > self.cfg.handoff_lease_s:
                if h.dst_block_ids is not None:
                    h.peer.channel.send(KVRelease(h.job.request_id), block=False)
                self._end(h, f"decode node {h.peer.name} did not answer for a reservation within "
                             f"{self.cfg.handoff_lease_s:.0f}s")
            elif now > h.lease_deadline:
                if h.dst_block_ids is not None:
                    h.peer.channel.send(KVRelease(h.job.request_id), block=False)
                self._end(h, f"decode node did not confirm the KV handoff within "
                             f"{self.cfg.handoff_lease_s:.0f}s")
            elif h.dst_block_ids is None:
                if h.next_reserve_at and now >= h.next_reserve_at:
                    self._reserve(h)
            elif now >= h.reserved_until and not h.is_written:
                log.warning("reservation of %s on %s ran out before its write: reserving again",
                            h.job.request_id, h.peer.name)
                self._drop_reservation(h)
            else:
                if self._can_write(h):
                    self._write(h)
                elif h.epoch != h.peer.epoch:
                    self._hello(h.peer)
                if now >= h.renew_at and not h.is_commit_sent:
                    self._reserve(h)

    @staticmethod
    def _can_write(h: Handoff) -> bool:
        return (h.is_computed and h.dst_block_ids is not None and not h.is_written
                and not h.is_writing and not h.is_aborted and h.peer.writer is not None
                and h.epoch == h.peer.epoch and time.monotonic() < h.reserved_until - h.lease_s / 3)

    def _write(self, h: Handoff) -> None:
        try:
            # NOTE: an id past the peer's cache would index out of bounds on the device.
            if not all(0 <= b < h.peer.num_blocks for b in h.dst_block_ids):
                raise transfer.TransferError(f"reserved block ids do not fit the decode node's "
                                             f"{h.peer.num_blocks}-block cache")
            h.peer.writer.write(h.job.request_id, h.job.block_ids, h.dst_block_ids)
        except transfer.TransferError as e:
            h.is_aborted = True   # advance() releases the reservation and fails it
            h.error = f"KV transfer to {h.peer.name} failed: {e}"
            return
        h.is_writing = True
        self.bytes_written += len(h.job.block_ids) * block_bytes(self.cache)

    def _written(self, h: Handoff | None) -> None:
        if h is None or not h.is_writing:
            return
        h.is_writing, h.is_written, h.written_at = False, True, time.time()
        self.prefix_cache.free(h.job.block_ids)   # the decode node holds them now
        h.job.block_ids = []
        self._commit(h)

    def _commit(self, h: Handoff) -> None:
        """Once the blocks are written and the first token is sampled (either order)."""
        if not h.is_written or h.first_token is None or h.is_commit_sent or h.is_aborted:
            return
        j = h.job
        h.timings["written"] = h.written_at
        h.is_commit_sent = True
        h.peer.channel.send(KVCommit(j.request_id, j.prompt_len, h.first_token, j.params,
                                     h.timings, h.peer.writer.name, j.token_ids), block=False)

    def _end(self, h: Handoff, error: str | None) -> None:
        """Drop the handoff and free what it holds here; fail the request if error."""
        if h.is_writing:   # NOTE: blocks under a device copy are freed only when it ends
            h.is_aborted, h.error = True, h.error or error
            return
        self.by_id.pop(h.job.request_id, None)
        if h.is_queued:   # its place in the decode node's waiting line
            h.peer.channel.send(KVRelease(h.job.request_id), block=False)
        # Waiting or part-way: the scheduler drops it (and frees its blocks).
        if self.scheduler.abort(h.job.request_id) is None and h.job.block_ids:
            self.prefix_cache.free(h.job.block_ids)
        h.job.block_ids = []
        if error:
            self.fail(h.job.request_id, error)

    # ---- figures ------------------------------------------------------------------

    @property
    def is_writing(self) -> bool:
        return any(h.is_writing for h in self.by_id.values())

    @property
    def num_pending(self) -> int:
        """Prompts done, waiting for their handoff to be committed."""
        return sum(h.first_token is not None for h in self.by_id.values())

    def close(self) -> None:
        for peer in self.peers.values():
            if peer.writer is not None:
                peer.writer.close()
            peer.channel.close()
        self.peers.clear()
