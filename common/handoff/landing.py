"""The decode node's landing and commit path: KV a prefill node writes lands through the
sink into the blocks it reserved, and its commit is taken once all of that KV is here
(or refused). Functions of the Receiver's (receiver.py), which calls them with itself.

A write or a commit that names another grant than the one held is refused (stale: one
this request had before, or one of this node's earlier life), and so is a commit whose
KV did not all arrive or, with --kv-verify, that carries no block checksums: refused
means moved (retryable), never decoded. A commit repeated for the same grant (its link
was made again) is the same commit. A commit can overtake its KV on the link's data
connection: it then waits for that KV, at most a lease.
"""

from __future__ import annotations

import time

from common.handoff.lease import Lease
from common.handoff.states import Hold, Reservation
from common.transfer import TransferError
from common.wire.protocol import HandoffAck, KVCommit, KVTransfer

ADMITTED_MEMORY = 4096  # grants taken into the batch, remembered to answer a repeated commit


def on_transfer(rx, sender: bytes, m: KVTransfer) -> None:
    """KV (or a transfer's announcement) for a reservation sender holds (rx: the Receiver)."""
    r = rx.held_by(sender, m.request_id)
    if r is None or r.hold is Hold.COMMITTED:
        return  # released, expired, or not this sender's
    if m.reservation != r.name:  # meant for an earlier grant of this request: stale
        rx.noisy.info(
            "dropped a %s KV transfer for %s meant for another grant",
            m.backend[:32],
            m.request_id,
        )
        return
    note_backend(rx, sender, m.backend)
    # NOTE: taken even once the request failed or was aborted: a dist send waits for
    # its receive, and every later send from that node waits behind it.
    try:
        rx.sink.receive(sender, m, r.block_ids)
    except TransferError as e:
        rx.noisy.warning("refused a %s KV transfer for %s: %s", m.backend[:32], m.request_id, e)
        r.hold = Hold.FAILED
        r.error = r.error or str(e)
    if r.commit is not None and (
        r.hold is Hold.FAILED
        or not rx.sink.is_arriving(
            r.commit.backend, r.request_id, len(r.block_ids), r.commit.num_written
        )
    ):
        settle(rx, sender, r, r.commit)  # the commit that came first, now its KV is all here


def note_backend(rx, sender: bytes, name: str) -> None:
    """The backend sender last wrote with: whether a late write of it can reach blocks
    this node has freed (a one-sided one) decides how its lost reservations go."""
    if name != rx.peer_backends.get(sender):
        if len(rx.peer_backends) >= 4 * ADMITTED_MEMORY:
            rx.peer_backends.clear()  # a churn of peers: forgetting is the safe side
        rx.peer_backends[sender] = name[:32]


def on_commit(rx, sender: bytes, c: KVCommit) -> None:
    """A prefill node commits a handoff: taken, held for its KV, or refused."""
    c.timings["decode_recv"] = time.time()
    r = rx.held_by(sender, c.request_id)
    is_repeat = (r is not None and r.hold is Hold.COMMITTED) or (
        r is None and c.request_id in rx.admitted
    )
    if is_repeat:
        name = r.name if r is not None else rx.admitted.get(c.request_id)
        # the same commit again (its link was made again)
        if c.reservation and c.reservation == name:
            rx.send(HandoffAck(c.request_id, True), to=sender)
        else:  # a second commit: the first stands
            rx.noisy.warning("refused a second commit for %s", c.request_id)
            rx.send(HandoffAck(c.request_id, False, False, "already committed"), to=sender)
        return
    if r is None:
        if c.request_id in rx.recently_aborted:
            rx.refuse(sender, c.request_id, "the request was aborted")
        else:
            # NOTE: the path failed (its grant ran out, or this node restarted), not the request
            why = "no reservation for this request (expired or released)"
            rx.refuse(sender, c.request_id, why, is_retryable=True)
        return
    note_backend(rx, sender, c.backend)
    if r.hold is Hold.FAILED:
        why = r.error
    else:
        why = r.why_not(c, rx.vocab_size, rx.max_model_len)
    if why:
        # NOTE: a failed grant the request did not give up (its write failed, or its lease
        # ran out): the path's fault, so it may go on elsewhere; a malformed commit may not.
        is_retryable = r.hold is Hold.FAILED and c.request_id not in rx.recently_aborted
        rx.refuse(sender, c.request_id, why, is_retryable=is_retryable)
        return
    if c.reservation == r.name and rx.sink.is_arriving(
        c.backend, c.request_id, len(r.block_ids), c.num_written
    ):
        # NOTE: it overtook its KV (on the data connection): held until that lands, or its
        # lease (counted from here) ends; a reset of that connection fails it at the sender.
        r.commit = c
        r.lease = Lease(rx.clock(), rx.lease_s)
        rx.num_early_commits += 1
        return
    settle(rx, sender, r, c)


def settle(rx, sender: bytes, r: Reservation, c: KVCommit) -> None:
    """Take the commit, its KV all here, or refuse it."""
    # NOTE: the path's fault, not the request's: refused as retryable, so it moves on.
    if c.reservation != r.name:
        why = (
            "the commit names another grant of these blocks (one that ended, or of an "
            "earlier life of this node)"
        )
    elif r.hold is Hold.FAILED and r.error:
        why = r.error
    else:
        why = rx.sink.why_incomplete(c.backend, c.request_id, len(r.block_ids), c.num_written)
    if why is None and rx.is_verifying and c.checksums is None:
        why = "this decode node verifies KV (--kv-verify) and the commit has no block checksums"
    if why:
        rx.num_incomplete += 1
        rx.refuse(sender, c.request_id, why, is_retryable=True)
        return
    r.hold = Hold.COMMITTED
    r.commit = c
    rx.ready.append(r.request_id)
    rx.send(HandoffAck(c.request_id, True), to=sender)
