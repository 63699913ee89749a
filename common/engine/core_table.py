"""The host's core table: a row per CPU node in shared memory (/dev/shm/<pool>), what a
row must hold to count, and the decision each node reads from it alone (cores.py holds a
node's own row and the rules for using it).

    pid     the node's process (a row whose process is gone counts for nothing)
    share   cores it is owed: the launcher's split, the most it keeps when all are busy
    held    cores its current forward pass runs on (0 between passes)
    stamp   when it last began or ended a pass (time.monotonic, the host's clock)
    start   when its process started (/proc): a pid used again is another process
    want    cores its current pass asked for (it grows into free ones up to this)
    end     when its current pass is expected to end (0: not known)
    seqs    the prompts its current pass serves (a prefill pass; 0 otherwise)
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable

import numpy as np

from common.base.procs import is_alive as is_running

MAX_NODES = 64
PID, SHARE, HELD, STAMP, START, WANT, END, SEQS = range(8)
NUM_COLS = 8
LINGER_S = 0.05  # a node that ended a pass this recently is busy: its share is not lent
WAIT_S = 0.0005  # how often a node owed its share looks again while a borrower gives it back
DEADLINE_S = 2.0  # the longest a node owed its share waits for a borrower to give it back
# A step waits out a pass that serves more sequences than its own batch (their first tokens
# against its sequences' next), or that is expected to end within YIELD_AHEAD_S (or not
# known); beside a longer one (a long prompt's) it runs on its share at once, else its
# sequences' next token would wait the whole pass. It waits YIELD_S at most.
YIELD_AHEAD_S = 0.25
YIELD_S = 0.5
# how often a yielder looks again: it waits out whole passes, and each look wakes a thread
# that preempts the pass's own (they run at a lower priority)
YIELD_POLL_S = 0.002
ROW_BYTES = NUM_COLS * 8  # float64 each
TABLE_BYTES = MAX_NODES * ROW_BYTES
SHM_DIR = "/dev/shm"
PID_MAX = 1 << 22  # the kernel's largest pid (pid_max's ceiling)
CLOCK_SLACK_S = 1.0  # a stamp this far past now is another node's read racing ours; more is junk
START_TTL_S = 1.0  # how long a process's start time, read from /proc, is taken as known

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
    pid, share, held, stamp, start, want, _end, _seqs = row  # NOTE: hints, read as given
    return (
        all(map(math.isfinite, row[:END]))
        and 1 <= pid <= PID_MAX
        and pid.is_integer()
        and 1 <= share <= budget
        and share.is_integer()
        and 0 <= held <= budget
        and held.is_integer()
        and 0 <= want <= budget
        and want.is_integer()
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
    for _, (pid, share, held, stamp, start, *_) in others(table, budget, me, now):
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


Pass = tuple[int, float, float]  # a pass in flight: (its row, its node's pid, its stamp)


def passes_in_flight(
    table: np.ndarray, budget: int, me: int, now: float, is_alive: IsAlive
) -> dict[Pass, tuple]:
    """The other nodes' passes that hold cores -> their rows' values. A row's stamp is set
    as its pass begins and not moved until it ends: (row, pid, stamp) names one pass."""
    return {
        (r, v[PID], v[STAMP]): v
        for r, v in others(table, budget, me, now)
        if v[HELD] > 0 and is_alive(int(v[PID]), int(v[START]))
    }


def decide_yielding(
    table: np.ndarray,
    budget: int,
    me: int,
    want: int,
    now: float,
    is_alive: IsAlive,
    passes: dict[Pass, tuple],
    waited_for: set[Pass],
    num_seqs: int = 0,
) -> int:
    """Cores for a pass that yields to the passes in flight it first saw (waited_for, of
    passes: passes_in_flight's, read in the same look); 0: wait on; -1: yield no more (the
    passes it waited for ended and others began, or one it waited for is not worth it:
    is_not_worth_waiting; it takes its share back as a pass that does not yield would, so a
    step waits out one pass at most). num_seqs: the yielder's batch. It runs at once where
    what it wants is free, or on what is free where every pass in flight has what it asked;
    with no pass in flight it takes what it wants, lingering shares included (a node between
    passes that begins again is given its share back at the yielder's next layer)."""
    free = free_cores(table, budget, me, now, is_alive)
    if free >= want:
        return want
    if any(is_not_worth_waiting(v, now, num_seqs) for k, v in passes.items() if k in waited_for):
        return -1
    if not passes:
        return min(want, budget)
    if free >= 1 and all(v[HELD] >= v[WANT] for v in passes.values()):
        return free
    return 0 if waited_for & passes.keys() else -1


def is_not_worth_waiting(v: tuple, now: float, num_seqs: int) -> bool:
    """Does a pass in flight (its row's values) run on past YIELD_AHEAD_S, serving no more
    sequences than a step of num_seqs would keep waiting? Then the step runs beside it.
    NOTE: junk (NaN, negative) reads as not known: waited for, YIELD_S at most."""
    ends, seqs = v[END], v[SEQS]
    return ends > now + YIELD_AHEAD_S and 0 < seqs <= num_seqs


def fresh_row(pid: int, share: int, start: int, now: float) -> tuple:
    """A node's row between passes (idle: its share lent)."""
    return (pid, share, 0, now - LINGER_S, start) + (0,) * (NUM_COLS - START - 1)


def claim_row(table: np.ndarray, budget: int, row: tuple, now: float, is_alive: IsAlive) -> int:
    """The index of a row given to `row`'s values: a free one, one that makes no sense, or
    one whose process is gone (the table locked); RuntimeError where none is."""
    for r in range(MAX_NODES):
        v = tuple(table[r].tolist())
        if not is_sane(v, budget, now) or not is_alive(int(v[PID]), int(v[START])):
            table[r] = row
            return r
    raise RuntimeError(f"more than {MAX_NODES} nodes")
