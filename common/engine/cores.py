"""Cores that follow the work. The CPU nodes one launcher starts on a host share its cores
through a small table in shared memory (/dev/shm/<pool>), a row per node:

    pid     the node's process (a row whose process is gone counts for nothing)
    share   cores it is owed: the launcher's split, the most it keeps when all are busy
    held    cores its current forward pass runs on (0 between passes)
    stamp   when it last began or ended a pass (time.monotonic, the host's clock)
    start   when its process started (/proc): a pid used again is another process

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

The table is this user's alone: made with O_EXCL, opened with O_NOFOLLOW, and used only
while it is a plain file of ours that no one else may write; else the node runs on its
share alone (a fixed split, as --no-core-sharing gives). A row that makes no sense (not
finite, a pid out of range, more cores than the budget) counts for nothing. A node owed
its share waits for a borrower at most deadline_s: one that has not given back by then
(stopped, hung, not a node at all) loses its row, and the waiter runs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import mmap
import os
import stat
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from common.base.files import is_at
from common.base.log import get_logger
from common.base.procs import is_alive as is_running

MAX_NODES = 64
PID, SHARE, HELD, STAMP, START = range(5)
NUM_COLS = 5
LINGER_S = 0.05  # a node that ended a pass this recently is busy: its share is not lent
WAIT_S = 0.0005  # how often a node owed its share looks again while a borrower gives it back
DEADLINE_S = 2.0  # the longest a node owed its share waits for a borrower to give it back
ROW_BYTES = NUM_COLS * 8  # float64 each
TABLE_BYTES = MAX_NODES * ROW_BYTES
SHM_DIR = "/dev/shm"
PID_MAX = 1 << 22  # the kernel's largest pid (pid_max's ceiling)
CLOCK_SLACK_S = 1.0  # a stamp this far past now is another node's read racing ours; more is junk
START_TTL_S = 1.0  # how long a process's start time, read from /proc, is taken as known

log = get_logger("cores")
IsAlive = Callable[[int, int], bool]  # (pid, start) -> does that process still run


# ---- who a row is ---------------------------------------------------------------


def process_start(pid: int) -> int | None:
    """pid's start time (clock ticks after boot), from /proc; -1 for a process gone (or a
    zombie, which runs nothing); None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()  # NOTE: the name may hold ')'
    except FileNotFoundError:
        return -1 if os.path.isdir("/proc/self") else None
    except OSError:
        return None
    if len(fields) < 20 or not fields[19].isdigit():
        return None
    return -1 if fields[0] in (b"Z", b"X") else int(fields[19])


_starts: dict[int, tuple[int | None, float]] = {}  # pid -> (its start, when read)


def is_same_process(pid: int, start: int) -> bool:
    """Does the process that wrote a row (pid, start) still run? A pid used again by
    another process does not count. The start is read once a START_TTL_S a pid: the
    common case costs a kill(pid, 0)."""
    if not is_running(pid):
        return False
    now = time.monotonic()
    known = _starts.get(pid)
    if known is None or now - known[1] > START_TTL_S:
        if len(_starts) > 4 * MAX_NODES:
            _starts.clear()
        known = _starts[pid] = (process_start(pid), now)
    return known[0] is None or known[0] == start


def is_sane(row: tuple[float, ...], budget: int, now: float) -> bool:
    """Does a row make sense: finite, a pid in range, whole cores within the budget, a
    stamp not in the future? Any other counts for nothing and may be claimed."""
    pid, share, held, stamp, start = row
    return (
        all(map(math.isfinite, row))
        and 1 <= pid <= PID_MAX
        and pid.is_integer()
        and 1 <= share <= budget
        and share.is_integer()
        and 0 <= held <= budget
        and held.is_integer()
        and stamp <= now + CLOCK_SLACK_S
        and start >= 0
    )


def others(table: np.ndarray, budget: int, me: int, now: float) -> list[tuple[int, tuple]]:
    """(row, its values) of the other nodes' rows that make sense."""
    # NOTE: plain floats: a few rows are read faster than numpy reads them
    return [
        (r, v)
        for r in np.flatnonzero(table[:, PID]).tolist()
        if r != me and is_sane(v := tuple(table[r].tolist()), budget, now)
    ]


# ---- the decision -----------------------------------------------------------------


def free_cores(table: np.ndarray, budget: int, me: int, now: float, is_alive: IsAlive) -> int:
    """Cores the others neither hold nor are owed (table [MAX_NODES, NUM_COLS]; me: my row)."""
    taken = 0
    for _, (pid, share, held, stamp, start) in others(table, budget, me, now):
        is_busy = held > 0 or now - stamp < LINGER_S
        t = max(held, share if is_busy else 0)
        # NOTE: only a row that takes something is asked whether its process lives (a syscall)
        if t and is_alive(int(pid), int(start)):
            taken += int(t)
    return budget - taken


def lent_rows(table: np.ndarray, budget: int, me: int, now: float, is_alive: IsAlive) -> list[int]:
    """Other nodes' rows that hold more than they are owed (borrowers that will give back)."""
    return [
        r
        for r, v in others(table, budget, me, now)
        if v[HELD] > v[SHARE] and is_alive(int(v[PID]), int(v[START]))
    ]


def decide(
    table: np.ndarray, budget: int, me: int, want: int, now: float, is_alive: IsAlive
) -> int:
    """Cores for my next pass (0: wait, a borrower is giving mine back)."""
    free = free_cores(table, budget, me, now, is_alive)
    if free >= 1:
        return min(want, free)
    return 0 if lent_rows(table, budget, me, now, is_alive) else 1


# ---- the table's file ---------------------------------------------------------------


def open_table(path: str) -> int:
    """A descriptor of the table at path, made here or opened; OSError naming why for
    anything but a plain file of this user's that no one else may write (a link, a file
    another user planted under the name: its rows are never read)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(3):  # NOTE: the last node out may remove it between the two opens
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            break
        except FileExistsError:
            pass
        try:
            fd = os.open(path, flags)
            break
        except FileNotFoundError:
            continue
        except OSError as e:
            raise OSError(
                e.errno,
                f"{path} is a symbolic link" if e.errno == errno.ELOOP else f"{path}: {e.strerror}",
            ) from None
    else:
        raise OSError(errno.EAGAIN, f"{path} was removed and made again as it was opened")
    st = os.fstat(fd)
    why = (
        "is not a plain file"
        if not stat.S_ISREG(st.st_mode)
        else f"belongs to uid {st.st_uid}, not {os.getuid()}"
        if st.st_uid != os.getuid()
        else f"has mode {st.st_mode & 0o777:o}: others may write it"
        if st.st_mode & 0o077
        else f"has {st.st_nlink} names"
        if st.st_nlink != 1
        else ""
    )
    if why:
        os.close(fd)
        raise OSError(errno.EPERM, f"{path} {why}")
    if st.st_size < TABLE_BYTES:
        os.ftruncate(fd, TABLE_BYTES)
    return fd


@dataclass
class CoreFigures:
    num_passes: int = 0
    num_lent_passes: int = 0  # passes that ran on more cores than this node's share
    num_waits: int = 0  # passes that waited for a borrower to give cores back
    wait_s: float = 0.0
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
        try:
            for _ in range(3):
                fd = open_table(self.path)
                fcntl.flock(fd, fcntl.LOCK_EX)
                if is_at(self.path, fd):  # NOTE: else the last node out removed it: again
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    break
                os.close(fd)
            else:
                raise OSError(errno.EAGAIN, f"{self.path} was removed as it was opened, 3 times")
        except OSError as e:
            log.warning(
                "core pool %s: not shared: %s; this node runs on its share of %d core(s) alone",
                self.name,
                e.strerror or e,
                self.share,
            )
            self.budget = self.share
            return np.zeros((MAX_NODES, NUM_COLS))
        self._file = fd
        self._map = mmap.mmap(fd, TABLE_BYTES)
        return np.frombuffer(self._map, dtype=np.float64).reshape(MAX_NODES, NUM_COLS)

    @contextlib.contextmanager
    def _locked(self):
        """The table to ourselves (a test's in-memory table needs no lock). NOTE: a node held
        for microseconds; one stopped while holding it (SIGSTOP, a debugger) must not stop
        every node on the host: past deadline_s this node leaves the table and runs on its
        share alone."""
        if self._file is None:
            yield
            return
        give_up_at = time.monotonic() + self.deadline_s
        while True:
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= give_up_at:
                    self._leave(f"its lock was held for more than {self.deadline_s:g}s")
                    yield
                    return
                time.sleep(WAIT_S)
        try:
            yield
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)

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
        self.table[0] = (self.pid, self.share, 0, self.clock() - LINGER_S, self.start)
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive: the mapping goes with the process
            pass
        os.close(self._file)
        self._file = None

    def _claim(self) -> int:
        """A row for this process (the table locked): a free one, one that makes no sense,
        or one whose process is gone."""
        now = self.clock()
        for row in range(MAX_NODES):
            v = tuple(self.table[row].tolist())
            if not is_sane(v, self.budget, now) or not self.is_alive(int(v[PID]), int(v[START])):
                self.table[row] = (self.pid, self.share, 0, now - LINGER_S, self.start)
                return row
        raise RuntimeError(f"core pool {self.name}: more than {MAX_NODES} nodes")

    def _is_mine(self) -> bool:
        return self.table[self.row, PID] == self.pid and self.table[self.row, START] == self.start

    def _keep_row(self) -> None:
        """A row again (the table locked) where another node took this one back: this node
        was stopped, or slow, past another's deadline."""
        if not self._is_mine():
            self.row = self._claim()

    def begin(self, want: int) -> int:
        """Cores for the next pass, at most min(want, cap); waits while a borrower gives
        this node's share back (at most one of its layers), and no longer than deadline_s:
        a borrower that has not given back by then loses its row."""
        want = self._want = max(1, min(want, self.cap))
        waited_from = deadline = None
        while True:
            with self._locked():
                self._keep_row()
                now = self.clock()
                grant = decide(self.table, self.budget, self.row, want, now, self.is_alive)
                if not grant and deadline is not None and now >= deadline:
                    self._reclaim(now)
                    grant = decide(self.table, self.budget, self.row, want, now, self.is_alive)
                if grant:
                    self.table[self.row, HELD], self.table[self.row, STAMP] = grant, now
                    break
                self.table[self.row, STAMP] = now  # busy: the borrower sees my share owed
            if waited_from is None:
                waited_from, deadline = now, now + self.deadline_s
            time.sleep(WAIT_S)
        f = self.figures
        f.num_passes += 1
        f.num_lent_passes += grant > self.share
        if waited_from is not None:
            f.num_waits += 1
            f.wait_s += now - waited_from
        self.set_threads(grant)  # NOTE: always: the pass before may have left others set
        self.held = self.threads = grant
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
        free = free_cores(self.table, self.budget, self.row, self.clock(), self.is_alive)
        if max(1, min(self._want, free)) == self.held and self._is_mine():
            return  # NOTE: the common case reads the table without its lock
        with self._locked():
            self._keep_row()
            now = self.clock()
            free = free_cores(self.table, self.budget, self.row, now, self.is_alive)
            grant = max(1, min(self._want, free))
            self.table[self.row, HELD], self.table[self.row, STAMP] = grant, now
        self.figures.num_shrinks += grant < self.held
        self._apply(grant)

    def end(self) -> None:
        with self._locked():
            self._keep_row()
            self.table[self.row, HELD], self.table[self.row, STAMP] = 0, self.clock()
        self.held = 0

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
            "num_core_shrinks": f.num_shrinks,
            "num_core_reclaims": f.num_reclaims,
        }

    def close(self) -> None:
        with self._locked():
            if self._is_mine():
                self.table[self.row] = 0
            # NOTE: the last node out removes the table, if the name is still this file
            if (
                self._file is not None
                and not self.table[:, PID].any()
                and is_at(self.path, self._file)
            ):
                os.unlink(self.path)
        if self._file is not None:
            self.table = np.zeros_like(self.table)  # NOTE: drop the view before the map closes
            self._map.close()
            os.close(self._file)
            self._file = None
