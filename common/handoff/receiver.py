"""The decode node's half of a handoff: reservations, the waiting line, commits.

A prefill node reserves first: the prompt's blocks are taken and their ids go
back to it, and it writes into them through its transfer writer (what the backend
sends on the KV link lands through the sink). A request that does not fit now
waits its turn in line (first come, first served) and is granted its blocks as
they free up, unasked. A reservation neither renewed nor committed within its
lease is freed (its prefill node is gone); a committed one waits for a batch
row (the decode loop takes it with next_ready()). Only the prefill node that
made a reservation may write, commit or release it: a prefill node is its tag
(NAME/EPOCH, common/wire/peers.py), the same across a reset of its link.

Each grant has a name of its own. A write or a commit that names another grant
(one this request had before, or one of this node's earlier life) is refused,
and so is a commit whose KV did not all arrive (the backend counts the units
of a whole write) or, with --kv-verify, whose blocks do not hold what the
prefill node wrote: refused means moved (retryable), never decoded. A commit
repeated for the same grant (the link was made again) is the same commit. KV
sent on the link's data connection can come after its commit, which then waits
for it (at most a lease).
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from typing import Callable

from common.base.log import Throttle, get_logger
from common.base.recent import Recent
from common.handoff.lease import Lease
from common.handoff.line import Line
from common.handoff.states import DATA, Hold, Pool, Reservation, why_malformed
from common.transfer import KVSink, TransferError
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
noisy = Throttle(log)  # lines about what peers send
ABORT_MEMORY_S = 60.0  # a handoff arriving this long after its abort is still dropped
ADMITTED_MEMORY = 4096  # grants taken into the batch, remembered to answer a repeated commit
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
        self.epoch, self.lease_s, self.max_queue = epoch, lease_s, max_queue
        self.is_verifying = is_verifying
        self.pool, self.sink, self.send, self.clock = pool, sink, send, clock
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.held: dict[str, Reservation] = {}  # RESERVED, FAILED or COMMITTED
        self.waiting = Line(max_queue)  # WAITING, oldest first
        self.ready: deque[str] = deque()  # COMMITTED, in commit order
        self.recently_aborted: dict[str, float] = {}
        self.num_expired = 0  # not renewed or committed within the lease
        self.num_granted = 0  # granted from the waiting line
        self.num_incomplete = (
            0  # commits refused: their KV did not all arrive, or named another grant
        )
        self.num_early_commits = (
            0  # commits that came before the last of their KV (and waited for it)
        )
        self.num_verify_failures = 0  # committed KV that did not match its checksums (--kv-verify)
        self.num_peer_drops = (
            0  # reservations freed because the frontend said their prefill node is lost
        )
        self.admitted = Recent(ADMITTED_MEMORY)  # request -> its grant, taken into the batch
        self.peer_backends: dict[bytes, str] = {}  # the backend each prefill node last wrote with

    # ---- messages ---------------------------------------------------------------

    def receive(self, sender: bytes, msg) -> None:
        """One message from a prefill node's KV link: from its data connection ("NAME/EPOCH/kv",
        common/handoff/links.py) only KV, as from the node itself."""
        if sender.endswith(DATA_SUFFIX):
            sender = sender[: -len(DATA_SUFFIX)]
            if not isinstance(msg, (KVTransfer, BadMessage)):
                noisy.warning("dropped a %s sent on a KV data connection", type(msg).__name__)
                return
        if isinstance(msg, BadMessage):
            noisy.warning("dropped a malformed message: %s", msg.error)
            if msg.request_id:
                self._refuse(sender, msg.request_id, msg.error)
        elif isinstance(msg, KVHello):
            noisy.info("prefill node %s connected to the KV link", msg.prefill_node)
            self.send(self.sink.welcome(self.epoch), to=sender)
        elif isinstance(msg, KVReserve):
            self._on_reserve(sender, msg)
        elif isinstance(msg, KVTransfer):
            self._on_transfer(sender, msg)
        elif isinstance(msg, KVCommit):
            self._on_commit(sender, msg)
        elif isinstance(msg, KVRelease):
            r = self._held_by(sender, msg.request_id)
            if r is None:
                self.waiting.drop(msg.request_id, sender)
            elif msg.reservation and msg.reservation == r.name:
                self._release(msg.request_id)
            else:  # NOTE: a late release of an earlier grant must not free this one
                noisy.info("ignored a release of %s naming another grant", msg.request_id)

    def _held_by(self, sender: bytes, request_id: str) -> Reservation | None:
        r = self.held.get(request_id)
        return r if r is not None and r.sender == sender else None

    def _on_reserve(self, sender: bytes, m: KVReserve) -> None:
        answer = self._answer(sender, m)
        answer.ask = m.ask
        self.send(answer, to=sender)

    def _answer(self, sender: bytes, m: KVReserve) -> KVReserved:
        """Its reservation (new, or renewed when its holder asks again), its place in
        line (new, or kept), or a refusal: retryable when the line is full, final when
        the request can never be held."""
        rid, lease = m.request_id, Lease(self.clock(), self.lease_s)
        fork_ids = list(m.fork_ids)
        if all(f in self.recently_aborted for f in [rid, *fork_ids]):
            return self._refusal(rid, "the request was aborted")
        if why := why_malformed(m, self.max_model_len):
            return self._refusal(rid, why)
        r = self.held.get(rid)
        if r is not None and r.sender == sender and r.hold is Hold.FAILED:
            # NOTE: not renewed: its writer stops at the refusal (a write pushed across passes
            # would go on into blocks no commit may use), and they are freed when it releases
            # them, commits (refused) or the lease ends.
            return self._refusal(rid, r.error or "its reservation failed", is_retryable=True)
        if (
            r is not None
            and r.sender == sender
            and r.hold is Hold.RESERVED
            and (r.prompt_len, r.max_tokens, r.fork_ids) == (m.prompt_len, m.max_tokens, fork_ids)
        ):
            r.lease = lease
            return self._granted(r)
        w = self.waiting.find(rid)
        if w is not None:
            if (w.sender, w.prompt_len, w.max_tokens, w.fork_ids) != (
                sender,
                m.prompt_len,
                m.max_tokens,
                fork_ids,
            ):
                return self._refusal(rid, f"request {rid!r} is already on this decode node")
            w.lease, w.reason = lease, "waiting for blocks"
            return self._queued(w)
        r = Reservation(
            rid,
            sender,
            m.prompt_len,
            m.max_tokens,
            lease,
            fork_ids=fork_ids,
            aborted_ids={f for f in [rid, *fork_ids] if f in self.recently_aborted},
        )
        refusal = self.refusal(rid, m.prompt_len, m.max_tokens, fork_ids)
        if refusal is None and self.waiting:
            refusal = f"{len(self.waiting)} requests wait for blocks first", True
        if refusal is None:
            self._reserve(r)
            return self._granted(r)
        # NOTE: first come, first served: a request in line is granted unasked (turn()).
        r.reason, is_retryable = refusal
        if is_retryable and not self.waiting.is_full:
            self.waiting.add(r)
            return self._queued(r)
        return self._refusal(rid, r.reason, is_retryable)

    def _granted(self, r: Reservation, is_from_line: bool = False) -> KVReserved:
        return KVReserved(
            r.request_id,
            self.epoch,
            list(r.block_ids),
            lease_s=self.lease_s,
            is_queued=is_from_line,
            reservation=r.name,
        )

    def _queued(self, w: Reservation) -> KVReserved:
        return KVReserved(
            w.request_id, self.epoch, None, True, w.reason, self.lease_s, is_queued=True
        )

    def _refusal(self, request_id: str, reason: str, is_retryable: bool = False) -> KVReserved:
        if not is_retryable:
            noisy.warning("refused reservation %s: %s", request_id, reason)
        return KVReserved(request_id, self.epoch, None, is_retryable, reason)

    def refusal(
        self, request_id: str, prompt_len: int, max_tokens: int, fork_ids: list[str] = ()
    ) -> tuple[str, bool] | None:
        """(reason, is_retryable) if this request (and its forks) cannot be reserved now."""
        ids = [request_id, *fork_ids]
        taken = [f for f in ids if f in self.held or self.holds_fork(f)]
        if taken:
            r = self.held.get(taken[0]) or self._forked_into(taken[0])
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

    def holds_fork(self, request_id: str) -> bool:
        """A fork of a request held or in line here (it runs once that request is admitted)."""
        return self._forked_into(request_id) is not None

    def _forked_into(self, request_id: str) -> Reservation | None:
        """The reservation, held or in line, that request_id is a fork of."""
        return next(
            (r for r in (*self.held.values(), *self.waiting) if request_id in r.fork_ids), None
        )

    def _reserve(self, r: Reservation) -> None:
        r.block_ids, r.num_reserved = self.pool.take_blocks(r.prompt_len, r.max_tokens, r.num_seqs)
        r.hold, r.reserved_at, r.name = Hold.RESERVED, time.time(), secrets.token_hex(6)
        self.held[r.request_id] = r

    def _on_transfer(self, sender: bytes, m: KVTransfer) -> None:
        r = self._held_by(sender, m.request_id)
        if r is None or r.hold is Hold.COMMITTED:
            return  # released, expired, or not this sender's
        if m.reservation != r.name:  # meant for an earlier grant of this request: stale
            noisy.info(
                "dropped a %s KV transfer for %s meant for another grant",
                m.backend[:32],
                m.request_id,
            )
            return
        self._note_backend(sender, m.backend)
        # NOTE: taken even once the request failed or was aborted: a dist send waits for
        # its receive, and every later send from that node waits behind it.
        try:
            self.sink.receive(sender, m, r.block_ids)
        except TransferError as e:
            noisy.warning("refused a %s KV transfer for %s: %s", m.backend[:32], m.request_id, e)
            r.hold, r.error = Hold.FAILED, r.error or str(e)
        if r.commit is not None and (
            r.hold is Hold.FAILED
            or not self.sink.is_arriving(
                r.commit.backend, r.request_id, len(r.block_ids), r.commit.num_written
            )
        ):
            self._settle(sender, r, r.commit)  # the commit that came first, now its KV is all here

    def _note_backend(self, sender: bytes, name: str) -> None:
        if name != self.peer_backends.get(sender):
            if len(self.peer_backends) >= 4 * ADMITTED_MEMORY:
                self.peer_backends.clear()  # a churn of peers: forgetting is the safe side
            self.peer_backends[sender] = name[:32]

    def _on_commit(self, sender: bytes, c: KVCommit) -> None:
        c.timings["decode_recv"] = time.time()
        r = self._held_by(sender, c.request_id)
        if (
            r is not None
            and r.hold is Hold.COMMITTED
            or r is None
            and c.request_id in self.admitted
        ):
            name = r.name if r is not None else self.admitted.get(c.request_id)
            if (
                c.reservation and c.reservation == name
            ):  # the same commit again (its link was made again)
                self.send(HandoffAck(c.request_id, True), to=sender)
            else:  # a second commit: the first stands
                noisy.warning("refused a second commit for %s", c.request_id)
                self.send(HandoffAck(c.request_id, False, False, "already committed"), to=sender)
            return
        if r is None:
            if c.request_id in self.recently_aborted:
                self._refuse(sender, c.request_id, "the request was aborted")
            else:  # NOTE: the path failed (its grant ran out, or this node restarted), not the request
                self._refuse(
                    sender,
                    c.request_id,
                    "no reservation for this request (expired or released)",
                    is_retryable=True,
                )
            return
        self._note_backend(sender, c.backend)
        why = (
            r.error if r.hold is Hold.FAILED else r.why_not(c, self.vocab_size, self.max_model_len)
        )
        if why:
            # NOTE: a failed grant the request did not give up (its write failed, or its lease
            # ran out): the path's fault, so it may go on elsewhere; a malformed commit may not.
            is_retryable = r.hold is Hold.FAILED and c.request_id not in self.recently_aborted
            self._refuse(sender, c.request_id, why, is_retryable=is_retryable)
            return
        if c.reservation == r.name and self.sink.is_arriving(
            c.backend, c.request_id, len(r.block_ids), c.num_written
        ):
            # NOTE: it overtook its KV (on the data connection): held until that lands, or its
            # lease (counted from here) ends; a reset of that connection fails it at the sender.
            r.commit, r.lease = c, Lease(self.clock(), self.lease_s)
            self.num_early_commits += 1
            return
        self._settle(sender, r, c)

    def _settle(self, sender: bytes, r: Reservation, c: KVCommit) -> None:
        """Take the commit, its KV all here, or refuse it."""
        # NOTE: the path's fault, not the request's: refused as retryable, so it moves on.
        why = (
            None
            if c.reservation == r.name
            else "the commit names another grant of these blocks (one that ended, or of an earlier life of this node)"
        )
        why = (
            why
            or (r.error if r.hold is Hold.FAILED else None)
            or self.sink.why_incomplete(c.backend, c.request_id, len(r.block_ids), c.num_written)
        )
        if why is None and self.is_verifying and c.checksums is None:
            why = "this decode node verifies KV (--kv-verify) and the commit has no block checksums"
        if why:
            self.num_incomplete += 1
            self._refuse(sender, c.request_id, why, is_retryable=True)
            return
        r.hold, r.commit = Hold.COMMITTED, c
        self.ready.append(r.request_id)
        self.send(HandoffAck(c.request_id, True), to=sender)

    def _refuse(
        self, sender: bytes, request_id: str, reason: str, is_retryable: bool = False
    ) -> None:
        """Refuse a handoff; its reservation, if the sender holds one, is freed. is_retryable:
        the request may go on elsewhere (its KV went wrong on the way, not the request)."""
        if self._held_by(sender, request_id):
            self._release(request_id)
        noisy.warning("refused handoff %s: %s", request_id, reason)
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
        r.block_ids, r.num_reserved = [], 0

    # ---- each turn ------------------------------------------------------------------

    def turn(self) -> None:
        """Expire what its prefill node stopped renewing, then grant the line, oldest
        first, while requests fit."""
        now = self.clock()
        for w in self.waiting.drop_expired(now):
            noisy.warning(
                "reservation request %s was not asked again within %.0fs: dropped",
                w.request_id,
                self.lease_s,
            )
        for r in [
            r for r in self.held.values() if r.hold is not Hold.COMMITTED and r.lease.is_over(now)
        ]:
            self.num_expired += not r.is_quarantined
            if r.commit is not None:  # committed before its KV, which did not all come
                self._refuse(
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
                r.hold, r.is_quarantined, r.lease = Hold.FAILED, True, Lease(now, self.lease_s)
                r.error = r.error or f"its reservation ran out ({self.lease_s:.0f}s)"
                noisy.warning(
                    "reservation %s was neither renewed nor committed within %.0fs: its blocks "
                    "are held until its writer stops",
                    r.request_id,
                    self.lease_s,
                )
                continue
            noisy.warning(
                "reservation %s was neither renewed nor committed within %.0fs: freed",
                r.request_id,
                self.lease_s,
            )
            self._release(r.request_id)
        while (w := self.waiting.head()) is not None:
            refusal = self.refusal(w.request_id, w.prompt_len, w.max_tokens, w.fork_ids)
            if refusal is not None and refusal[1]:
                return
            self.waiting.pop_head()
            if refusal is not None:
                self.send(
                    KVReserved(w.request_id, self.epoch, None, False, refusal[0]), to=w.sender
                )
                continue
            w.lease = Lease(now, self.lease_s)
            self._reserve(w)
            self.num_granted += 1
            self.send(self._granted(w, is_from_line=True), to=w.sender)

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
            r.hold, r.error = Hold.FAILED, r.error or "the request was aborted"
            if (
                r.commit is not None
            ):  # committed, its KV on the way: refused now, not at its lease's end
                self._refuse(r.sender, request_id, r.error)

    # ---- admission -------------------------------------------------------------------

    def progress(self) -> bool:
        """Drive the transfers this node must drive; True while one is under way."""
        return self.sink.progress()

    def has_ready(self) -> bool:
        """The oldest committed request's KV has landed (FIFO: nothing overtakes it)."""
        return bool(self.ready) and self.sink.is_landed(self.ready[0])

    def peek_ready(self) -> Reservation | None:
        """The oldest committed reservation, once its KV has landed (still held here)."""
        return self.held[self.ready[0]] if self.has_ready() else None

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
