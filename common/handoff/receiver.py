"""The decode node's half of a handoff: reservations, the waiting line, commits. The
answer to an ask is reservations.py's; KV landing and commits are landing.py's.

A prefill node reserves first: the prompt's blocks are taken and their ids go
back to it, and it writes into them through its transfer writer (what the backend
sends on the KV link lands through the sink). A request that does not fit now
waits its turn in line (first come, first served) and is granted its blocks as
they free up, unasked. A reservation neither renewed nor committed within its
lease is freed (its prefill node is gone); a committed one waits for a batch
row (the decode loop takes it with next_ready()). Only the prefill node that
made a reservation may write, commit or release it: a prefill node is its tag
(NAME/EPOCH, common/wire/peers.py), the same across a reset of its link.

Each grant has a name of its own, which its writes and its commit must name (landing.py).
A commit whose KV did not all arrive (the backend counts the units of a whole write) or,
with --kv-verify, whose blocks do not hold what the prefill node wrote, is refused:
refused means moved (retryable), never decoded.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from common.base.log import Throttle, get_logger
from common.base.recent import Recent
from common.handoff import landing, reservations
from common.handoff.landing import ADMITTED_MEMORY
from common.handoff.lease import Lease
from common.handoff.line import Line
from common.handoff.states import DATA, Hold, Pool, Reservation
from common.transfer import KVSink
from common.wire.channel import BadMessage
from common.wire.protocol import (
    HandoffAck,
    KVCommit,
    KVHello,
    KVRelease,
    KVReserve,
    KVReserved,
    KVTransfer,
)

log = get_logger("decode")
ABORT_MEMORY_S = 60.0  # a handoff arriving this long after its abort is still dropped
DATA_SUFFIX = f"/{DATA}".encode()  # a prefill node's data connection: its tag and this


class Receiver:
    """Every reservation on one decode node. send(msg, to) answers a prefill node."""

    def __init__(
        self,
        *,
        epoch: str,
        lease_s: float,
        max_queue: int,
        pool: Pool,
        sink: KVSink,
        send: Callable[..., bool],
        vocab_size: int,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        is_verifying: bool = False,
    ):
        """is_verifying (--kv-verify): refuse commits without block checksums."""
        self.epoch = epoch
        self.lease_s = lease_s
        self.max_queue = max_queue
        self.is_verifying = is_verifying
        self.pool = pool
        self.sink = sink
        self.send = send
        self.clock = clock
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # NOTE: one budget of log lines about what peers send, whichever part writes them
        self.noisy = Throttle(log)
        self.held: dict[str, Reservation] = {}  # RESERVED, FAILED or COMMITTED
        self.waiting = Line(max_queue)  # WAITING, oldest first
        self.ready: deque[str] = deque()  # COMMITTED, in commit order
        self.recently_aborted: dict[str, float] = {}
        self.num_expired = 0  # not renewed or committed within the lease
        self.num_granted = 0  # granted from the waiting line
        # commits refused: their KV did not all arrive, or named another grant
        self.num_incomplete = 0
        # commits that came before the last of their KV (and waited for it)
        self.num_early_commits = 0
        # committed KV that did not match its checksums (--kv-verify)
        self.num_verify_failures = 0
        # reservations freed because the frontend said their prefill node is lost
        self.num_peer_drops = 0
        self.admitted = Recent(ADMITTED_MEMORY)  # request -> its grant, taken into the batch
        # the backend each prefill node last wrote with (landing.py)
        self.peer_backends: dict[bytes, str] = {}

    # ---- messages ---------------------------------------------------------------

    def receive(self, sender: bytes, msg) -> None:
        """One message from a prefill node's KV link: from its data connection ("NAME/EPOCH/kv",
        common/handoff/links.py) only KV, as from the node itself."""
        if sender.endswith(DATA_SUFFIX):
            sender = sender[: -len(DATA_SUFFIX)]
            if not isinstance(msg, (KVTransfer, BadMessage)):
                self.noisy.warning("dropped a %s sent on a KV data connection", type(msg).__name__)
                return
        if isinstance(msg, BadMessage):
            self.noisy.warning("dropped a malformed message: %s", msg.error)
            if msg.request_id:
                self.refuse(sender, msg.request_id, msg.error)
        elif isinstance(msg, KVHello):
            self.noisy.info("prefill node %s connected to the KV link", msg.prefill_node)
            self.send(self.sink.welcome(self.epoch), to=sender)
        elif isinstance(msg, KVReserve):
            reservations.on_reserve(self, sender, msg)
        elif isinstance(msg, KVTransfer):
            landing.on_transfer(self, sender, msg)
        elif isinstance(msg, KVCommit):
            landing.on_commit(self, sender, msg)
        elif isinstance(msg, KVRelease):
            r = self.held_by(sender, msg.request_id)
            if r is None:
                self.waiting.drop(msg.request_id, sender)
            elif msg.reservation and msg.reservation == r.name:
                self._release(msg.request_id)
            else:  # NOTE: a late release of an earlier grant must not free this one
                self.noisy.info("ignored a release of %s naming another grant", msg.request_id)

    def held_by(self, sender: bytes, request_id: str) -> Reservation | None:
        r = self.held.get(request_id)
        return r if r is not None and r.sender == sender else None

    def refusal(
        self,
        request_id: str,
        prompt_len: int,
        max_tokens: int,
        fork_ids: list[str] = (),
        own: Reservation | None = None,
    ) -> tuple[str, bool] | None:
        """(reason, is_retryable) if this request (and its forks) cannot be reserved now.
        own: the line's entry of this request, weighed on its turn (its forks are its own)."""
        ids = [request_id, *fork_ids]
        taken = [f for f in ids if self._is_taken(f, own)]
        if taken:
            r = self.held.get(taken[0]) or self._forked_into(taken[0], own)
            if r is not None and r.hold is Hold.FAILED:  # a grant on its way out (its writer stops)
                return f"request {taken[0]!r} has a grant here that is being released", True
            return f"request {taken[0]!r} is already on this decode node", False
        why = self.pool.refusal_for_good(ids, prompt_len, max_tokens)
        if why:
            return why, False
        if len(self.held) + self.pool.num_aside() >= self.max_queue:  # aside: committed
            return f"decode queue is full ({self.max_queue})", True
        why = self.pool.refusal_for_now(prompt_len, max_tokens, len(ids))
        return (why, True) if why else None

    def held_ids(self) -> set[str]:
        """Every request held or in line here, forks included."""
        return {
            f for r in (*self.held.values(), *self.waiting) for f in (r.request_id, *r.fork_ids)
        }

    def _is_taken(self, request_id: str, own: Reservation | None) -> bool:
        """Whether request_id is another request's here: held, in line, or a fork of one
        held or in line (own, the line's entry weighed on its turn, aside). NOTE: a fork id
        naming a request in line is taken too: a peer may not claim another's id as a fork."""
        w = self.waiting.find(request_id)
        return (
            request_id in self.held
            or (w is not None and w is not own)
            or self._forked_into(request_id, own) is not None
        )

    def _forked_into(self, request_id: str, other_than=None) -> Reservation | None:
        """The reservation, held or in line (other_than aside), that request_id is a fork of."""
        return next(
            (
                r
                for r in (*self.held.values(), *self.waiting)
                if r is not other_than and request_id in r.fork_ids
            ),
            None,
        )

    def refuse(
        self, sender: bytes, request_id: str, reason: str, is_retryable: bool = False
    ) -> None:
        """Refuse a handoff; its reservation, if the sender holds one, is freed. is_retryable:
        the request may go on elsewhere (its KV went wrong on the way, not the request)."""
        if self.held_by(sender, request_id):
            self._release(request_id)
        self.noisy.warning("refused handoff %s: %s", request_id, reason)
        self.send(HandoffAck(request_id, False, is_retryable, reason), to=sender)

    def _release(self, request_id: str) -> None:
        """Give a reservation's blocks back (aborted, expired or refused)."""
        self.sink.forget(request_id)  # waits for frames still landing in its blocks
        r = self.held.pop(request_id, None)
        if r is None:
            return
        if r.hold is Hold.COMMITTED:
            self.ready.remove(request_id)
        self.pool.give_back(r.block_ids, r.num_reserved)
        r.block_ids = []
        r.num_reserved = 0

    # ---- each turn ------------------------------------------------------------------

    def turn(self) -> None:
        """Expire what its prefill node stopped renewing, then grant the line, oldest
        first, while requests fit."""
        now = self.clock()
        for w in self.waiting.drop_expired(now):
            self.noisy.warning(
                "reservation request %s was not asked again within %.0fs: dropped",
                w.request_id,
                self.lease_s,
            )
        self._expire(now)
        self._grant_line(now)

    def _expire(self, now: float) -> None:
        """Reservations neither renewed nor committed within their lease: freed, or held
        aside while a one-sided writer may still copy into them."""
        for r in [
            r for r in self.held.values() if r.hold is not Hold.COMMITTED and r.lease.is_over(now)
        ]:
            self.num_expired += not r.is_quarantined
            if r.commit is not None:  # committed before its KV, which did not all come
                self.refuse(
                    r.sender,
                    r.request_id,
                    f"its KV did not all arrive within {self.lease_s:.0f}s of its commit",
                    is_retryable=True,
                )
                continue
            if not r.is_quarantined and self.sink.is_one_sided(
                self.peer_backends.get(r.sender, "")
            ):
                # NOTE: its writer may copy into these blocks without this node taking part,
                # and a pass (or a paused process) can outlast the lease: they are given to no
                # one until it says it stopped (its release or commit) or exited, or one more
                # lease passes, far past the deadline at which it stops itself (lease.py).
                r.hold = Hold.FAILED
                r.is_quarantined = True
                r.lease = Lease(now, self.lease_s)
                r.error = r.error or f"its reservation ran out ({self.lease_s:.0f}s)"
                self.noisy.warning(
                    "reservation %s was neither renewed nor committed within %.0fs: its blocks "
                    "are held until its writer stops",
                    r.request_id,
                    self.lease_s,
                )
                continue
            self.noisy.warning(
                "reservation %s was neither renewed nor committed within %.0fs: freed",
                r.request_id,
                self.lease_s,
            )
            self._release(r.request_id)

    def _grant_line(self, now: float) -> None:
        """The line's head is granted unasked while it fits; one that never can is told."""
        while (w := self.waiting.head()) is not None:
            # NOTE: its own entry is still in the line: its forks are not another's
            refusal = self.refusal(w.request_id, w.prompt_len, w.max_tokens, w.fork_ids, own=w)
            if refusal is not None and refusal[1]:
                return
            self.waiting.pop_head()
            if refusal is not None:
                self.send(
                    KVReserved(w.request_id, self.epoch, None, False, refusal[0]), to=w.sender
                )
                continue
            w.lease = Lease(now, self.lease_s)
            reservations.reserve(self, w)
            self.num_granted += 1
            self.send(reservations.granted(self, w, is_from_line=True), to=w.sender)

    def abort(self, request_id: str) -> None:
        """The frontend gave the request up: whatever of it is held here goes. One of
        n sequences (a request with forks) goes alone: the rest run, and it ends as it
        is admitted (aborted_ids); with the last of them, all of it goes."""
        now = self.clock()
        self.recently_aborted = {
            r: t for r, t in self.recently_aborted.items() if now - t < ABORT_MEMORY_S
        }
        self.recently_aborted[request_id] = now  # a late reserve or commit is refused
        group = (
            self._forked_into(request_id)
            or self.held.get(request_id)
            or self.waiting.find(request_id)
        )
        if group is not None and group.fork_ids:
            if not group.give_up(request_id):
                return
            request_id = group.request_id
        r = self.held.get(request_id)
        if r is None:
            self.waiting.drop(request_id)
        elif r.hold is Hold.COMMITTED:
            self._release(request_id)
        else:
            # NOTE: its prefill node may be writing into these blocks right now (ipc
            # copies, a dist send waiting for its receive): they are freed when that node
            # releases them or commits (refused), or when the lease ends, never under a write.
            r.hold = Hold.FAILED
            r.error = r.error or "the request was aborted"
            if r.commit is not None:  # committed, its KV on the way: refused now, not at its end
                self.refuse(r.sender, request_id, r.error)

    # ---- admission -------------------------------------------------------------------

    def progress(self) -> bool:
        """Drive the transfers this node must drive; True while one is under way."""
        return self.sink.progress()

    def has_ready(self) -> bool:
        """The oldest committed request's KV has landed (FIFO: nothing overtakes it)."""
        return bool(self.ready) and self.sink.is_landed(self.ready[0])

    def next_ready(self) -> Reservation | None:
        """The oldest committed reservation, once its KV has landed; it leaves the
        handoff (its blocks are the caller's now). r.error: why its KV is unusable."""
        if not self.has_ready():
            return None
        r = self.held.pop(self.ready.popleft())
        r.error = self.sink.landing_error(r.request_id)
        if r.error is None and r.commit.checksums is not None:
            r.error = self.sink.why_unverified(r.block_ids, r.commit.checksums)
            if r.error:
                self.num_verify_failures += 1
                log.error("request %s: %s", r.request_id, r.error)
        r.is_lossy = self.sink.is_lossy(r.request_id)
        self.sink.forget(r.request_id)
        self.admitted.add(r.request_id, r.name)
        return r

    def drop_peer(self, tag: bytes, is_exited: bool) -> int:
        """The frontend says prefill node `tag` is lost: its uncommitted reservations and
        places in line go now, not at their lease's end. Unless its process surely exited
        (is_exited), only those a late write of it cannot reach: its backend must be one
        whose writes this node lands itself (not one-sided). Returns how many were freed."""
        n = 0
        for rid, r in list(self.held.items()):
            if (
                r.sender == tag
                and r.hold is not Hold.COMMITTED
                and (is_exited or not self.sink.is_one_sided(self.peer_backends.get(tag, "")))
            ):
                self._release(rid)
                n += 1
        self.waiting.drop_sender(tag)
        self.num_peer_drops += n
        if n:
            log.info(
                "freed %d reservations of lost prefill node %s",
                n,
                tag.decode(errors="replace")[:128],
            )
        return n

    def close(self) -> None:
        self.sink.close()
