"""The decode node's answer to a KVReserve: functions of the Receiver's (receiver.py),
which calls them with itself.

An ask is answered with its reservation (new, or renewed when its holder asks again), its
place in the waiting line (new, or kept), or a refusal: retryable when the line is full
too, final when the request can never be held here. Each grant gets a name of its own,
which the writes and the commit must name.
"""

from __future__ import annotations

import secrets
import time

from common.handoff.lease import Lease
from common.handoff.states import Hold, Reservation, why_malformed
from common.wire.protocol import KVReserve, KVReserved


def on_reserve(rx, sender: bytes, m: KVReserve) -> None:
    """Answer a prefill node's ask, echoing its number (rx: the Receiver)."""
    answer = _answer(rx, sender, m)
    answer.ask = m.ask
    rx.send(answer, to=sender)


def _answer(rx, sender: bytes, m: KVReserve) -> KVReserved:
    """Its reservation, its place in line, or a refusal (see the module)."""
    rid = m.request_id
    lease = Lease(rx.clock(), rx.lease_s)
    fork_ids = list(m.fork_ids)
    if all(f in rx.recently_aborted for f in [rid, *fork_ids]):
        return refused(rx, rid, "the request was aborted")
    if why := why_malformed(m, rx.max_model_len):
        return refused(rx, rid, why)
    r = rx.held.get(rid)
    if r is not None and r.sender == sender and r.hold is Hold.FAILED:
        # NOTE: not renewed: its writer stops at the refusal (a write pushed across passes
        # would go on into blocks no commit may use), and they are freed when it releases
        # them, commits (refused) or the lease ends.
        return refused(rx, rid, r.error or "its reservation failed", is_retryable=True)
    if (
        r is not None
        and r.sender == sender
        and r.hold is Hold.RESERVED
        and (r.prompt_len, r.max_tokens, r.fork_ids) == (m.prompt_len, m.max_tokens, fork_ids)
    ):  # its holder asks again: renewed
        r.lease = lease
        return granted(rx, r)
    w = rx.waiting.find(rid)
    if w is not None:
        if (w.sender, w.prompt_len, w.max_tokens, w.fork_ids) != (
            sender,
            m.prompt_len,
            m.max_tokens,
            fork_ids,
        ):
            return refused(rx, rid, f"request {rid!r} is already on this decode node")
        w.lease = lease
        w.reason = "waiting for blocks"
        return _queued(rx, w)
    r = Reservation(
        rid,
        sender,
        m.prompt_len,
        m.max_tokens,
        lease,
        fork_ids=fork_ids,
        aborted_ids={f for f in [rid, *fork_ids] if f in rx.recently_aborted},
    )
    why_not = rx.refusal(rid, m.prompt_len, m.max_tokens, fork_ids)
    if why_not is None and rx.waiting:
        why_not = f"{len(rx.waiting)} requests wait for blocks first", True
    if why_not is None:
        reserve(rx, r)
        return granted(rx, r)
    # NOTE: first come, first served: a request in line is granted unasked (Receiver.turn).
    r.reason, is_retryable = why_not
    if is_retryable and not rx.waiting.is_full:
        rx.waiting.add(r)
        return _queued(rx, r)
    return refused(rx, rid, r.reason, is_retryable)


def reserve(rx, r: Reservation) -> None:
    """Take its blocks from the pool, and give the grant a name of its own."""
    r.block_ids, r.num_reserved = rx.pool.take_blocks(r.prompt_len, r.max_tokens, r.num_seqs)
    r.hold = Hold.RESERVED
    r.reserved_at = time.time()
    r.name = secrets.token_hex(6)
    rx.held[r.request_id] = r


def granted(rx, r: Reservation, is_from_line: bool = False) -> KVReserved:
    return KVReserved(
        r.request_id,
        rx.epoch,
        list(r.block_ids),
        lease_s=rx.lease_s,
        is_queued=is_from_line,
        reservation=r.name,
    )


def _queued(rx, w: Reservation) -> KVReserved:
    return KVReserved(w.request_id, rx.epoch, None, True, w.reason, rx.lease_s, is_queued=True)


def refused(rx, request_id: str, reason: str, is_retryable: bool = False) -> KVReserved:
    if not is_retryable:
        rx.noisy.warning("refused reservation %s: %s", request_id, reason)
    return KVReserved(request_id, rx.epoch, None, is_retryable, reason)
