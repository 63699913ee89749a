"""Committed requests whose grammar (structured output) is still compiling.

A request's grammar is compiled here too (grammar.Compiles, beside the loop), for its
matcher. Its compile is asked for as its commit arrives, so it runs while the request's
KV lands and while the requests committed before it are admitted. A request whose KV
has landed but whose grammar still compiles leaves the handoff's ready line and waits
here, holding its blocks: the requests behind it, with no grammar or a compiled one, are
admitted past it (its blocks are its own either way, so nothing is taken from it), and
it is admitted, oldest first, as soon as its compile ends. A compile that fails, or that
has run COMPILE_DEADLINE_S without ending, fails its request; one queued behind others is
timed from its own start. A compile that hangs holds the one compile thread (it cannot be
stopped): while it does, the requests queued behind it, and those that come, fail at once
(retryable: another decode node compiles them), and LINE_DEADLINE_S from its commit ends
any wait. Only a grammar that does not compile fails for good.
"""

from __future__ import annotations

from common.base import grammar
from common.handoff.states import Reservation

# From when a compile starts (not when it is asked: one queued behind another client's is
# not its own). The frontend refuses a grammar that takes more than MAX_COMPILE_CPU_S to
# compile: this leaves room for the first compile, which loads the tokenizer's vocabulary.
COMPILE_DEADLINE_S = 30.0
# From when a compile is asked: the line ahead of it is bounded by --max-queue (it counts
# the requests waiting here), each at most ~MAX_COMPILE_CPU_S, so only a hung compile
# ahead, which holds the one compile thread, makes a request wait this long.
LINE_DEADLINE_S = 10 * COMPILE_DEADLINE_S


class GrammarWait:
    """The committed requests, out of the handoff, that wait for their grammar, oldest
    commit first; and when each committed request's compile was asked."""

    def __init__(self, compiles: grammar.Compiles, deadline_s: float = COMPILE_DEADLINE_S):
        self.compiles, self.deadline_s = compiles, deadline_s  # the deadline on compiles' clock
        # in commit order. NOTE: the scheduler's aside (DecodeNode.__init__ shares it): a request
        # here must stay a taken id (and count in the queue) for reservations.
        self.waiting: dict[str, Reservation] = {}
        self._asked: dict[str, float] = {}  # request -> when its compile was asked
        # waiting -> (compiled, why not, is_retryable)
        self._ended: dict[str, tuple[object, str | None, bool]] = {}

    def ask(self, handoff) -> None:
        """Start the compile of each committed request in the handoff's ready line that has
        a grammar, as its commit arrives: not once it is at the head of the line; and
        forget those of requests that left the handoff otherwise (released, aborted)."""
        for rid in handoff.ready:
            if rid not in self._asked and (g := handoff.held[rid].commit.params.grammar):
                self._asked[rid] = self.compiles.clock()
                self.compiles.submit(rid, g)
        self.prune(handoff.held)

    def failed(self) -> list[tuple[Reservation, str, bool]]:
        """The waiting requests whose compile failed or ran past its deadline, each with
        why and whether another node may serve it; they leave (their blocks are the
        caller's to free)."""
        for rid in self.waiting:
            self._check(rid)
        return [
            (self.waiting.pop(rid), *self._take(rid)[1:])
            for rid in list(self.waiting)
            if rid in self._ended and self._ended[rid][1] is not None
        ]

    def next(self, handoff) -> tuple[Reservation, object, str | None, bool] | None:
        """The oldest committed request that may start now, out of the handoff: (it, its
        grammar compiled, why it fails, whether another node may serve it). Those waiting
        here are older than the handoff's ready line; one taken from that line whose grammar
        still compiles waits here."""
        for rid in self.waiting:
            self._check(rid)
            if rid in self._ended:
                return self.waiting.pop(rid), *self._take(rid)
        while (r := handoff.next_ready()) is not None:
            if (settled := self._settle(r)) is not None:
                return r, *settled
        return None

    def has_ended(self) -> bool:
        """A waiting request's compile is over (done, or past its deadline)."""
        return any(
            rid in self._ended or self.compiles.is_done(rid) or self._is_late(rid)
            for rid in self.waiting
        )

    def _is_late(self, rid: str) -> str | None:
        """Why rid's compile is past its deadline (its own, the stuck line's, or the
        line's), if it is."""
        ran = self.compiles.running_s(rid)
        if ran is not None and ran > self.deadline_s:
            return f"the grammar did not compile within {self.deadline_s:.0f}s on this decode node"
        if ran is None and self.compiles.is_stuck(self.deadline_s):
            return (
                "this decode node's grammar compiles are held by one that has run past "
                f"{self.deadline_s:.0f}s"
            )
        now = self.compiles.clock()
        if now - self._asked.setdefault(rid, now) > LINE_DEADLINE_S:
            return (
                f"the grammar was not compiled within {LINE_DEADLINE_S:.0f}s of its commit on "
                f"this decode node (the compiles ahead of it did not end)"
            )
        return None

    def abort(self, request_id: str) -> Reservation | None:
        """The frontend gave request_id up: the waiting request it is (one of n of), if
        any. Once every sequence of it is given up (r.is_given_up) it leaves, its compile
        dropped, and its blocks are the caller's to free."""
        r = self.waiting.get(request_id) or next(
            (w for w in self.waiting.values() if request_id in w.fork_ids), None
        )
        if r is not None and r.give_up(request_id):
            del self.waiting[r.request_id]
            self._forget(r.request_id)
        return r

    def prune(self, held) -> None:
        """Forget the compiles of requests that left the handoff (aborted) but not by
        next(): held, the handoff's reservations."""
        for rid in {*self.compiles.keys(), *self._asked}:
            if rid not in held and rid not in self.waiting:
                self._forget(rid)

    def ids(self) -> set[str]:
        """Every request waiting here, forks included."""
        return {i for r in self.waiting.values() for i in (r.request_id, *r.fork_ids)}

    def _settle(self, r: Reservation) -> tuple[object, str | None, bool] | None:
        """r has just left the handoff, its KV landed: (its grammar compiled, why it fails,
        is_retryable) if it may start now, or None: it waits here until its compile ends.
        r.error: its KV did not land whole: the path failed, not the request."""
        rid = r.request_id
        if r.error is not None or not r.commit.params.grammar:
            self._forget(rid)
            return None, r.error, True
        if rid not in self._asked:  # committed and landed within one turn
            self._asked[rid] = self.compiles.clock()
            self.compiles.submit(rid, r.commit.params.grammar)
        self.waiting[rid] = r
        self._check(rid)
        if rid in self._ended:
            del self.waiting[rid]
            return self._take(rid)
        return None

    def _check(self, rid: str) -> None:
        """If rid's compile is over, its outcome, taken from compiles."""
        if rid in self._ended:
            return
        if self.compiles.is_done(rid):
            try:
                self._ended[rid] = self.compiles.take(rid), None, False
            except ValueError as e:  # GrammarError: the request's own (or, retryable, ours)
                self._ended[rid] = None, str(e), getattr(e, "is_retryable", False)
        elif (why := self._is_late(rid)) is not None:  # this node's fault: retryable
            self.compiles.drop(rid)
            self._ended[rid] = None, why, True

    def _take(self, rid: str) -> tuple[object, str | None, bool]:
        self._asked.pop(rid, None)
        return self._ended.pop(rid)

    def _forget(self, rid: str) -> None:
        self.compiles.drop(rid)
        self._asked.pop(rid, None)
        self._ended.pop(rid, None)
