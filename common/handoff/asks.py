"""The prefill node's asks for a reservation, and what each answer does to its handoff:
functions of the Sender's (sender.py), which calls them with itself.

An ask (KVReserve) asks for the prompt's blocks, or renews them once reserved; asks are
numbered and an answer (KVReserved) echoes the number, so its lease counts from when that
ask was sent. An answer grants blocks (the handoff is RESERVED and its prefill may start),
renews the grant held, keeps a place in the decode node's line (QUEUED: the blocks come
unasked), or refuses: retryable (asked again, backing off) or for good (the handoff ends).
A grant is named; one the handoff does not take is released at once.
"""

from __future__ import annotations

from common.handoff.lease import INF, Lease
from common.handoff.states import DecodePeer, Handoff, Stage
from common.kv.blocks import num_blocks_for
from common.wire.limits import I32_MAX
from common.wire.protocol import KVRelease, KVReserve, KVReserved

RETRY_S = 0.05  # a retryable refusal (decode node and its line full) is asked again after
MAX_RETRY_S = 0.8  # this, doubling up to this: a long backlog must not flood the decode node
MAX_ASKS_OUT = 8  # unanswered asks remembered per handoff


def ask(tx, h: Handoff) -> None:
    """Ask for the blocks, or renew them once reserved (tx: the Sender)."""
    now = tx.clock()
    if h.silent_since is None:
        h.silent_since = now
    tx.num_asks = tx.num_asks % I32_MAX + 1
    msg = KVReserve(
        h.job.request_id,
        h.job.prompt_len,
        h.job.params.max_tokens,
        tx.num_asks,
        [f.request_id for f in h.job.forks],
    )
    if not h.peer.link.send(msg, block=False):
        h.next_ask_at = now + RETRY_S  # not connected yet
        return
    h.asks[tx.num_asks] = now
    # NOTE: an answer to an ask forgotten here grants a lease already over (asked again).
    while len(h.asks) > MAX_ASKS_OUT:
        h.asks.pop(next(iter(h.asks)))
    h.next_ask_at = INF  # until the answer


def on_reserved(tx, peer: DecodePeer, r: KVReserved) -> None:
    """peer's answer r to an ask (or a grant from its line) (tx: the Sender)."""
    h = tx.by_id.get(r.request_id)
    if h is None or h.peer is not peer:
        if r.block_ids is not None:  # nobody wants it
            peer.link.send(KVRelease(r.request_id, r.reservation), block=False)
        return
    h.silent_since = None
    sent_at = _sent_at(h, r)
    if h.stage in (Stage.CANCELLING, Stage.CANCELLED):
        release_other(peer, h, r)
        return  # its end releases the grant it holds there
    now = tx.clock()
    if h.dst_block_ids is not None and _is_settled_while_held(tx, peer, h, r, sent_at):
        return
    peer.is_granting = r.block_ids is not None and not r.is_queued
    if r.block_ids is None:
        _on_refusal(tx, h, r, sent_at, now)
    else:
        _take_grant(tx, peer, h, r, sent_at)


def _sent_at(h: Handoff, r: KVReserved) -> float:
    """When the ask r answers was sent: its lease counts from then.
    NOTE: an answer names its ask; one to an ask forgotten (or never made) grants a lease
    already over (asked again). Blocks granted from the line answer no ask: granted after
    the ask that queued it arrived."""
    if r.is_queued and r.block_ids is not None:
        return h.queued_at if h.stage is Stage.QUEUED else -INF
    return h.asks.pop(r.ask, -INF)


def _is_settled_while_held(tx, peer: DecodePeer, h: Handoff, r: KVReserved, sent_at: float) -> bool:
    """An answer to a handoff that holds blocks there: True when it renews them, or is a
    grant the handoff does not take; False when they are no longer its (new blocks, or a
    refusal), its reservation dropped: the handoff goes on from this answer."""
    if (r.block_ids, r.epoch, r.reservation) == (h.dst_block_ids, h.epoch, h.reservation):
        if sent_at > h.lease.start:
            h.lease = Lease(sent_at, r.lease_s)  # renewed
        h.next_ask_at = h.lease.renew_at
        return True
    if h.stage is Stage.WRITING and not h.is_kv_queued:  # pushed across passes (writes.py)
        why = f"its reservation on {peer.name} ended during its prefill"
        tx.end_handoff(h, why, is_retryable=True)
    if h.stage is not Stage.RESERVED:  # else the commit's answer says if the blocks were ours
        release_other(peer, h, r)
        return True
    # NOTE: after a refusal, release what was ours: an aborted request's blocks stay
    # reserved there until released (a write may be landing in them).
    if r.block_ids is None:
        peer.link.send(KVRelease(r.request_id, h.reservation), block=False)
    h.drop_reservation(tx.clock())
    return False


def _on_refusal(tx, h: Handoff, r: KVReserved, sent_at: float, now: float) -> None:
    """No blocks: a place in line, a refusal to ask again soon, or one for good."""
    if r.is_queued:  # keeps its place by asking again every third of the lease
        h.stage = Stage.QUEUED
        h.queued_at = sent_at
        h.epoch = r.epoch
        h.num_refusals = 0
        h.next_ask_at = Lease(now, r.lease_s).renew_at
    elif r.is_retryable:  # its line is full too: ask again soon
        h.stage = Stage.ASKING
        h.next_ask_at = now + min(RETRY_S * 2**h.num_refusals, MAX_RETRY_S)
        h.num_refusals += 1
        if h.first_token is not None:
            # The decode node answers, and is full: waiting on it is backpressure, not
            # a lost handoff (the request's own deadline still bounds the wait).
            h.lease_deadline = now + tx.handoff_lease_s
    else:
        h.stage = Stage.ASKING
        tx.end_handoff(h, f"decode node refused the request: {r.reason}")


def _take_grant(tx, peer: DecodePeer, h: Handoff, r: KVReserved, sent_at: float) -> None:
    """Blocks granted: one distinct block per prompt block, or the answer is bad."""
    num_needed = num_blocks_for(h.job.prompt_len, tx.block_size)
    if len(r.block_ids) != num_needed or len(set(r.block_ids)) != num_needed:
        tx.num_bad_replies += 1
        tx.end_handoff(
            h,
            f"decode node {peer.name} reserved {len(r.block_ids)} blocks, not one "
            f"distinct block per prompt block",
            release=True,
        )
        return
    h.stage = Stage.RESERVED
    h.dst_block_ids = list(r.block_ids)
    h.epoch = r.epoch
    h.num_refusals = 0
    h.reservation = r.reservation
    h.job.is_reserved = True  # its prefill may start now
    h.lease = Lease(sent_at, r.lease_s)
    h.next_ask_at = h.lease.renew_at
    if r.epoch != peer.epoch:
        tx.links.hello(peer)  # a decode node we have not mapped (or that restarted)


def release_other(peer: DecodePeer, h: Handoff, r: KVReserved) -> None:
    """A grant this handoff does not take (not the one it holds): released now, or the
    decode node would hold its blocks until its lease ends. NOTE: a release names its
    grant, so this one cannot free the handoff's own, nor its own this one."""
    if r.block_ids is not None and r.reservation != h.reservation:
        peer.link.send(KVRelease(r.request_id, r.reservation), block=False)
