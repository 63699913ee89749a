"""Cores that follow the work. The CPU nodes one launcher starts on a host share its cores
through a small table in shared memory (/dev/shm/<pool>), a row per node (core_table.py
says what a row holds and decides from the table).

A node with work asks before each forward pass (`begin`) and again between layers
(`between_layers`), and may run on what the others neither hold nor are owed:

    free = budget - sum(max(held, share if busy else 0) over the others)

where a node is busy while it holds cores or ended a pass less than LINGER_S ago (a
decode node between steps keeps its share). So an idle node's share is lent, and taken
back at the borrower's next layer: a node owed its share waits for that, never runs
beside it, and the threads of all nodes stay within the budget. Only where a launcher
put more nodes than cores (shares of one each above the budget) does a node run on one
core unasked, as it would with no table. The decision reads the table alone: no
message to anyone, a few microseconds a pass.

Decode steps and prefill passes take turns (begin(yields=True)): a step that wants more
than its share waits out the passes in flight, each then running on every core rather than
both on half, unless one runs on past YIELD_AHEAD_S for no more sequences than the step's.

The table's file is this user's alone (core_file.py), else a node runs on its share alone.
A row that makes no sense counts for nothing. A node owed its share waits for a borrower at
most deadline_s: one that has not given back by then loses its row, and the waiter runs.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from common.base.log import get_logger
from common.engine.core_file import TableFile
from common.engine.core_table import (
    DEADLINE_S,
    END,
    HELD,
    LINGER_S,
    MAX_NODES,
    NUM_COLS,
    PID,
    SEQS,
    SHARE,
    SHM_DIR,
    STAMP,
    START,
    WAIT_S,
    WANT,
    YIELD_POLL_S,
    YIELD_S,
    IsAlive,
    claim_row,
    decide,
    decide_yielding,
    free_cores,
    fresh_row,
    is_same_process,
    lent_rows,
    passes_in_flight,
    process_start,
)
from common.engine.pass_time import PassTime

log = get_logger("cores")


@dataclass
class CoreFigures:
    num_passes: int = 0
    num_lent_passes: int = 0  # passes that ran on more cores than this node's share
    num_waits: int = 0  # passes that waited for a borrower to give cores back
    wait_s: float = 0.0
    num_yields: int = 0  # passes that waited for others' passes to end (decode steps)
    yield_s: float = 0.0
    num_shrinks: int = 0  # layers at which this node gave cores back
    num_reclaims: int = 0  # borrowers' rows taken back at the deadline


class CorePool:
    """This process's row in the host's table. set_threads(n) is called whenever the
    grant changes (the worker sets torch's threads); clock and is_alive are the test's."""

    def __init__(
        self,
        name: str,
        budget: int,
        share: int,
        cap: int,
        set_threads: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
        is_alive: IsAlive = is_same_process,
        table: np.ndarray | None = None,
        pid: int | None = None,
        deadline_s: float = DEADLINE_S,
    ):
        if budget < 1 or share < 1 or cap < 1:
            raise ValueError(
                f"core pool {name}: budget, share and cap must be >= 1 "
                f"(got {budget}, {share}, {cap})"
            )
        self.name, self.budget, self.share, self.cap = name, budget, share, cap
        self.set_threads, self.clock, self.is_alive = set_threads, clock, is_alive
        self.deadline_s = deadline_s
        self.figures = CoreFigures()
        self.held = self.threads = self._want = 0
        self.pass_time = PassTime()  # a prefill pass's predicted end, for yielders
        self._seqs = 0  # the prompts of the prefill pass under way
        self._layer_at = 0.0  # when its prefill pass began or last looked between layers
        self._stuck: set = set()  # passes a step waited for that outlived YIELD_S
        self.pid = pid or os.getpid()
        self.start = max(process_start(self.pid) or 0, 0)
        self.path = os.path.join(SHM_DIR, name)
        self._file = None
        if table is None:
            table = self._open()
        self.table = table
        with self._locked():
            self.row = self._claim()

    def _open(self) -> np.ndarray:
        """The host's table; where it is not safely ours, one of this node's own, on its
        share alone (no lending either way: the others' rows are never read)."""
        file = TableFile(self.path)
        try:
            table = file.open(self.deadline_s)
        except OSError as e:
            log.warning(
                "core pool %s: not shared: %s; this node runs on its share of %d core(s) alone",
                self.name,
                e.strerror or e,
                self.share,
            )
            self.budget = self.share
            return np.zeros((MAX_NODES, NUM_COLS))
        self._file = file
        return table

    @contextlib.contextmanager
    def _locked(self):
        """The table to ourselves (a test's in-memory table needs no lock). NOTE: a node held
        for microseconds; one stopped while holding it (SIGSTOP, a debugger) must not stop
        every node on the host: past deadline_s this node leaves the table and runs on its
        share alone."""
        if self._file is None:
            yield
        elif not self._file.lock(self.deadline_s):
            self._leave(f"its lock was held for more than {self.deadline_s:g}s")
            yield
        else:
            try:
                yield
            finally:
                self._file.unlock()

    def _leave(self, why: str) -> None:
        """Off the host's table, for good: this node's own, on its share alone."""
        log.warning(
            "core pool %s: the host's table is not usable (%s); this node runs on its "
            "share of %d core(s) alone from now on",
            self.name,
            why,
            self.share,
        )
        self.table = np.zeros((MAX_NODES, NUM_COLS))
        self.budget, self.row = self.share, 0
        self.table[0] = fresh_row(self.pid, self.share, self.start, self.clock())
        self._file.close()
        self._file = None

    def _claim(self) -> int:
        """A row for this process (the table locked)."""
        now = self.clock()
        me = fresh_row(self.pid, self.share, self.start, now)
        try:
            return claim_row(self.table, self.budget, me, now, self.is_alive)
        except RuntimeError as e:
            raise RuntimeError(f"core pool {self.name}: {e}") from None

    def _is_mine(self) -> bool:
        return self.table[self.row, PID] == self.pid and self.table[self.row, START] == self.start

    def _keep_row(self, rewrite: bool = True) -> None:
        """A row again (the table locked) where another node took this one back: this node
        was stopped, or slow, past another's deadline. A pass under way writes again what
        yielders read of it (its HELD is its caller's to write)."""
        if not self._is_mine():
            self.row = self._claim()
            if self.held and rewrite:
                t, now = self.pass_time, self.clock()
                # NOTE: taken back past a deadline while it looks between layers: it was
                # stopped, and ran nothing from its last look to now (a lanes pass, which
                # never looks, is taken back running: end() counts it, and rewrites nothing)
                ends = t.resume(self._layer_at, self.held, now) if t.is_running else 0.0
                want = min(self._want, self.budget)
                self.table[self.row, [WANT, END, SEQS]] = want, ends, self._seqs

    def begin(
        self,
        want: int,
        yields: bool = False,
        while_waiting: Callable[[float], None] | None = None,
        num_tokens: int = 0,
        num_seqs: int = 0,
    ) -> int:
        """Cores for the next pass, at most min(want, cap); waits while a borrower gives
        this node's share back (at most one of its layers), and no longer than deadline_s:
        a borrower that has not given back by then loses its row.

        A pass that yields (a decode step) and wants more than its share takes turns with the
        passes in flight (_yield) rather than run beside them on less. NOTE: on a host of few
        cores, running beside a prefill pass halves both; turns run each on all of them.
        while_waiting(timeout_s), given, is called between its looks instead of a sleep: the
        decode node reads its links there. num_tokens: a prefill pass's prompt tokens, from
        which its end is predicted (this node's rate so far) for yielders to read; num_seqs:
        the sequences the pass serves (a prefill pass's prompts, a step's batch)."""
        want = self._want = max(1, min(want, self.cap))
        grant = self._yield(want, while_waiting, num_seqs) if yields and want > self.share else 0
        if not grant:
            grant = self._wait_for_share(want)
        self.figures.num_passes += 1
        self.figures.num_lent_passes += grant > self.share
        self.set_threads(grant)  # NOTE: always: the pass before may have left others set
        self.held = self.threads = grant
        if num_tokens > 0:
            with self._locked():  # NOTE: a yielder that looks before this reads 0: not known
                if self._is_mine():
                    now = self.clock()
                    ends, self._layer_at = self.pass_time.begin(num_tokens, grant, now), now
                    self.table[self.row, [END, SEQS]] = ends, num_seqs
            self._seqs = num_seqs
        return grant

    def _yield(
        self, want: int, while_waiting: Callable[[float], None] | None, num_seqs: int
    ) -> int:
        """Cores once the passes in flight at the first look have ended (0: not waited for:
        one is not worth it, outlived YIELD_S, or a new pass began meanwhile; it asks as a pass
        that does not yield). Its row looks idle meanwhile: its share is theirs. NOTE: a step
        waits out one pass at most (its tokens' latency), and never again one that outlived
        YIELD_S (its node stopped or hung)."""
        waited_for: set | None = None
        started = now = self.clock()
        has_waited = False
        while True:
            with self._locked():
                self._keep_row()
                now = self.clock()
                passes = passes_in_flight(self.table, self.budget, self.row, now, self.is_alive)
                if waited_for is None:
                    waited_for = set(passes) - self._stuck
                seen = (self.table, self.budget, self.row, want, now, self.is_alive)
                grant = decide_yielding(*seen, passes, waited_for, num_seqs)
                if grant > 0:
                    self.table[self.row, [HELD, STAMP, WANT]] = grant, now, min(want, self.budget)
                    break
                if grant < 0 or now >= started + YIELD_S:
                    if grant == 0:  # the passes it waited for did not end: kept while in flight
                        self._stuck = (self._stuck | waited_for) & passes.keys()
                    grant = 0
                    break
                self.table[self.row, STAMP] = now - LINGER_S  # NOTE: idle: its share is lent
            if not has_waited:
                has_waited = True
                self.set_threads(1)  # NOTE: what the loop does meanwhile runs on no lent core
            if while_waiting is not None:
                while_waiting(YIELD_POLL_S)
            else:
                time.sleep(YIELD_POLL_S)
        if has_waited:
            self.figures.num_yields += 1
            self.figures.yield_s += now - started
        return grant

    def _wait_for_share(self, want: int) -> int:
        """Cores for a pass that does not yield: what is free, else its share once a
        borrower gives it back (at its next layer; its row is taken back at the deadline)."""
        waited_from = deadline = None
        while True:
            with self._locked():
                self._keep_row()
                now = self.clock()
                seen = (self.table, self.budget, self.row, want, now, self.is_alive)
                grant = decide(*seen)
                if not grant and deadline is not None and now >= deadline:
                    self._reclaim(now)
                    grant = decide(*seen)
                if grant:
                    self.table[self.row, [HELD, STAMP, WANT]] = grant, now, min(want, self.budget)
                    break
                self.table[self.row, STAMP] = now  # busy: the borrower sees my share owed
            if waited_from is None:
                waited_from, deadline = now, now + self.deadline_s
            time.sleep(WAIT_S)
        if waited_from is not None:
            self.figures.num_waits += 1
            self.figures.wait_s += now - waited_from
        return grant

    def _reclaim(self, now: float) -> None:
        """Rows of borrowers that did not give back by the deadline (the table locked):
        stopped, hung, or a pid that is no node. One that runs again claims a new row."""
        for row in lent_rows(self.table, self.budget, self.row, now, self.is_alive):
            pid, held, share = (int(self.table[row, c]) for c in (PID, HELD, SHARE))
            log.warning(
                "core pool %s: pid %d held %d core(s), %d past its share, for %.1fs "
                "while this node was owed its own: its row is taken back",
                self.name,
                pid,
                held,
                held - share,
                self.deadline_s,
            )
            self.table[row] = 0
            self.figures.num_reclaims += 1

    def between_layers(self, num_done: int = 0) -> None:
        """A borrower gives back what another node is now owed (never below one core);
        a node that started short takes what has come free, up to what its pass wants.
        (num_done: the forward's count of layers done, not needed here.)"""
        t, looked = self.pass_time, self.clock()
        free = free_cores(self.table, self.budget, self.row, looked, self.is_alive)
        if max(1, min(self._want, free)) == self.held and self._is_mine():
            self._layer_at = looked
            return  # NOTE: the common case reads the table without its lock
        with self._locked():
            self._keep_row()  # NOTE: before _layer_at moves: a stop since the last is not run
            now = self._layer_at = self.clock()
            free = free_cores(self.table, self.budget, self.row, now, self.is_alive)
            grant = max(1, min(self._want, free))
            self.table[self.row, HELD] = grant  # NOTE: the stamp stays: it names the pass
            if t.is_running and grant != self.held:
                self.table[self.row, END] = t.resize(grant, now)
        self.figures.num_shrinks += grant < self.held
        self._apply(grant)

    def end(self) -> None:
        with self._locked():
            self._keep_row(rewrite=False)  # NOTE: its row's pass columns are zeroed below
            now = self.clock()
            self.table[self.row, [HELD, STAMP, WANT, END, SEQS]] = 0, now, 0, 0, 0
        self.held = self._seqs = 0
        if self.pass_time.is_running:
            self.pass_time.end(now)

    def _apply(self, grant: int) -> None:
        if grant != self.threads:
            self.set_threads(grant)
        self.held = self.threads = grant

    def stats(self) -> dict:
        f = self.figures
        return {
            "core_budget": self.budget,
            "core_share": self.share,
            "cores_held": self.held,
            "num_core_passes": f.num_passes,
            "num_lent_passes": f.num_lent_passes,
            "num_core_waits": f.num_waits,
            "core_wait_s": round(f.wait_s, 6),
            "num_core_yields": f.num_yields,
            "core_yield_s": round(f.yield_s, 6),
            "num_core_shrinks": f.num_shrinks,
            "num_core_reclaims": f.num_reclaims,
        }

    def close(self) -> None:
        with self._locked():
            if self._is_mine():
                self.table[self.row] = 0
            if self._file is not None:
                self._file.remove_if_empty(self.table)
        if self._file is not None:
            self.table = np.zeros_like(self.table)  # NOTE: drop the view before the map closes
            self._file.close()
            self._file = None
