"""Committed requests whose grammar (structured output) is still compiling.

A request's grammar is compiled here too (grammar.Compiles, beside the loop), for its
matcher. Its compile is asked for as its commit arrives, so it runs while the request's
KV lands and while the requests committed before it are admitted. A request whose KV
has landed but whose grammar still compiles leaves the handoff's ready line and waits
here, holding its blocks: the requests behind it, with no grammar or a compiled one, are
admitted past it (its blocks are its own either way, so nothing is taken from it), and
it is admitted, oldest first, as soon as its compile ends. A compile that fails, or that
has not ended within COMPILE_DEADLINE_S of being asked, fails its request alone.
"""
from __future__ import annotations

import time
from typing import Callable

from common.base import grammar
from common.handoff.states import Reservation

# From when a compile is asked. The frontend refuses a grammar that takes more than
# grammar.MAX_COMPILE_CPU_S to compile, and a node compiles one at a time: this leaves room
# for a line of them and for the first compile, which loads the tokenizer's vocabulary.
COMPILE_DEADLINE_S = 30.0


class GrammarWait:
    """The committed requests, out of the handoff, that wait for their grammar, oldest
    commit first; and when each committed request's compile was asked."""

    def __init__(self, compiles: grammar.Compiles, deadline_s: float = COMPILE_DEADLINE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.compiles, self.deadline_s, self.clock = compiles, deadline_s, clock
        self.waiting: dict[str, Reservation] = {}   # in commit order
        self._asked: dict[str, float] = {}          # request -> when its compile was asked
        self._ended: dict[str, tuple[object, str | None]] = {}   # waiting -> (compiled, why not)

    def ask(self, handoff) -> None:
        """Start the compile of each committed request in the handoff's ready line that has
        a grammar, as its commit arrives: not once it is at the head of the line."""
        now = self.clock()
        for rid in handoff.ready:
            if rid not in self._asked and (g := handoff.held[rid].commit.params.grammar):
                self._asked[rid] = now
                self.compiles.submit(rid, g)

    def failed(self) -> list[tuple[Reservation, str]]:
        """The waiting requests whose compile failed or ran past its deadline, each with
        why; they leave (their blocks are the caller's to free)."""
        now = self.clock()
        for rid in self.waiting:
            self._check(rid, now)
        return [(self.waiting.pop(rid), self._take(rid)[1]) for rid in list(self.waiting)
                if rid in self._ended and self._ended[rid][1] is not None]

    def next(self, handoff) -> tuple[Reservation, object, str | None] | None:
        """The oldest committed request that may start now, out of the handoff: (it, its
        grammar compiled, why it fails). Those waiting here are older than the handoff's
        ready line; one taken from that line whose grammar still compiles waits here."""
        now = self.clock()
        for rid in self.waiting:
            self._check(rid, now)
            if rid in self._ended:
                return self.waiting.pop(rid), *self._take(rid)
        while (r := handoff.next_ready()) is not None:
            if (settled := self._settle(r)) is not None:
                return r, *settled
        return None

    def has_ended(self) -> bool:
        """A waiting request's compile is over (done, or past its deadline)."""
        now = self.clock()
        return any(rid in self._ended or self.compiles.is_done(rid)
                   or now - self._asked[rid] > self.deadline_s for rid in self.waiting)

    def abort(self, request_id: str) -> Reservation | None:
        """The frontend gave request_id up: the waiting request it is (one of n of), if
        any. Once every sequence of it is given up (r.is_given_up) it leaves, its compile
        dropped, and its blocks are the caller's to free."""
        r = self.waiting.get(request_id) or \
            next((w for w in self.waiting.values() if request_id in w.fork_ids), None)
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

    def _settle(self, r: Reservation) -> tuple[object, str | None] | None:
        """r has just left the handoff, its KV landed: (its grammar compiled, why it fails)
        if it may start now, or None: it waits here until its compile ends."""
        rid = r.request_id
        if r.error is not None or not r.commit.params.grammar:
            self._forget(rid)
            return None, r.error
        if rid not in self._asked:   # committed and landed within one turn
            self._asked[rid] = self.clock()
            self.compiles.submit(rid, r.commit.params.grammar)
        self.waiting[rid] = r
        self._check(rid, self.clock())
        if rid in self._ended:
            del self.waiting[rid]
            return self._take(rid)
        return None

    def _check(self, rid: str, now: float) -> None:
        """If rid's compile is over, its outcome, taken from compiles."""
        if rid in self._ended:
            return
        if self.compiles.is_done(rid):
            try:
                self._ended[rid] = self.compiles.take(rid), None
            except ValueError as e:   # GrammarError: the request's own, said to its client
                self._ended[rid] = None, str(e)
        elif now - self._asked[rid] > self.deadline_s:
            # NOTE: a compile that hangs keeps the compile thread, and those asked after it
            # run past their deadline too: each fails alone, and the loop goes on.
            self.compiles.drop(rid)
            self._ended[rid] = None, (f"the grammar did not compile within {self.deadline_s:.0f}s "
                                      f"on this decode node")

    def _take(self, rid: str) -> tuple[object, str | None]:
        self._asked.pop(rid, None)
        return self._ended.pop(rid)

    def _forget(self, rid: str) -> None:
        self.compiles.drop(rid)
        self._asked.pop(rid, None)
        self._ended.pop(rid, None)
