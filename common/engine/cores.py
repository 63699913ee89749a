"""Cores that follow the work. The CPU nodes one launcher starts on a host share its cores
through a small table in shared memory (/dev/shm/<pool>), a row per node:

    pid     the node's process (a row whose process is gone counts for nothing)
    share   cores it is owed: the launcher's split, the most it keeps when all are busy
    held    cores its current forward pass runs on (0 between passes)
    stamp   when it last began or ended a pass (time.monotonic, the host's clock)

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
"""
from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from common.base.procs import is_alive

MAX_NODES = 64
PID, SHARE, HELD, STAMP = range(4)
LINGER_S = 0.05       # a node that ended a pass this recently is busy: its share is not lent
WAIT_S = 0.0005       # how often a node owed its share looks again while a borrower gives it back
ROW_BYTES = 4 * 8     # 4 float64


# Typical rates of one host core (fp32 matmul; memory streamed), to size a pass: it is
# worth a thread for every MIN_MS_PER_THREAD it would take on one core.
HOST_FLOPS_PER_CORE = 50e9
HOST_BYTES_PER_CORE = 10e9
MIN_MS_PER_THREAD = 20.0


def layer_params(spec) -> int:
    """Weights of one decoder layer's matmuls (2 FLOPs each a token)."""
    return spec.hidden_size * (spec.q_size + 2 * spec.kv_size) + spec.q_size * spec.hidden_size \
        + 3 * spec.hidden_size * spec.intermediate_size


def pair_cost(spec) -> float:
    """A prompt's attention per (query, key) pair (QK^T and PV: 4 FLOPs a query dimension)
    over a token's matmuls, in a layer: how to cut a prompt into parts of equal work."""
    return 4 * spec.q_size / (2 * layer_params(spec))


def threads_worth(spec, dtype, num_tokens: int, num_rows: int) -> int:
    """Cores a pass over num_tokens (num_rows of them sampled) is worth: its time on one
    core, the matmuls' FLOPs or the weights it streams, over MIN_MS_PER_THREAD. A tiny
    model's pass is worth one: an op split over threads then waits at its end for all."""
    layer = layer_params(spec)
    head = spec.vocab_size * spec.hidden_size
    flops = 2 * (spec.num_layers * layer * max(num_tokens, num_rows) + head * num_rows)
    stream = (spec.num_layers * layer + head) * dtype.itemsize
    one_core_ms = max(flops / HOST_FLOPS_PER_CORE, stream / HOST_BYTES_PER_CORE) * 1e3
    return max(1, int(one_core_ms // MIN_MS_PER_THREAD))


def free_cores(table: np.ndarray, budget: int, me: int, now: float, is_alive: Callable[[int], bool]) -> int:
    """Cores the others neither hold nor are owed (table [MAX_NODES, 4]; me: my row)."""
    pid, share, held, stamp = table.T
    rows = np.flatnonzero(pid != 0)
    rows = rows[rows != me]
    is_busy = (held[rows] > 0) | (now - stamp[rows] < LINGER_S)
    taken = np.maximum(held[rows], np.where(is_busy, share[rows], 0))
    # NOTE: only a row that takes something is asked whether its process lives (a syscall)
    return budget - int(sum(t for r, t in zip(rows, taken) if t and is_alive(int(pid[r]))))


def is_lent(table: np.ndarray, me: int) -> bool:
    """Does another node hold more than it is owed (a borrower that will give back)?"""
    return any(table[r, HELD] > table[r, SHARE] for r in range(table.shape[0])
               if r != me and table[r, PID] != 0)


def decide(table: np.ndarray, budget: int, me: int, want: int, now: float,
           is_alive: Callable[[int], bool]) -> int:
    """Cores for my next pass (0: wait, a borrower is giving mine back)."""
    free = free_cores(table, budget, me, now, is_alive)
    if free >= 1:
        return min(want, free)
    return 0 if is_lent(table, me) else 1


@dataclass
class CoreFigures:
    num_passes: int = 0
    num_lent_passes: int = 0      # passes that ran on more cores than this node's share
    num_waits: int = 0            # passes that waited for a borrower to give cores back
    wait_s: float = 0.0
    num_shrinks: int = 0          # layers at which this node gave cores back


class CorePool:
    """This process's row in the host's table. set_threads(n) is called whenever the
    grant changes (the worker sets torch's threads); clock and is_alive are the test's."""

    def __init__(self, name: str, budget: int, share: int, cap: int, set_threads: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic, is_alive: Callable[[int], bool] = is_alive,
                 table: np.ndarray | None = None, pid: int | None = None):
        if budget < 1 or share < 1 or cap < 1:
            raise ValueError(f"core pool {name}: budget, share and cap must be >= 1 "
                             f"(got {budget}, {share}, {cap})")
        self.name, self.budget, self.share, self.cap = name, budget, share, cap
        self.set_threads, self.clock, self.is_alive = set_threads, clock, is_alive
        self.figures = CoreFigures()
        self.held = self.threads = self._want = 0
        self._file = None
        if table is None:
            table = self._open(name)
        self.table = table
        self.row = self._claim(pid or os.getpid())

    def _open(self, name: str) -> np.ndarray:
        path = f"/dev/shm/{name}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(fd).st_size < MAX_NODES * ROW_BYTES:
            os.ftruncate(fd, MAX_NODES * ROW_BYTES)
        self._file = fd
        self._map = mmap.mmap(fd, MAX_NODES * ROW_BYTES)
        return np.frombuffer(self._map, dtype=np.float64).reshape(MAX_NODES, 4)

    @contextlib.contextmanager
    def _locked(self):
        """The table to ourselves (a test's in-memory table needs no lock)."""
        if self._file is None:
            yield
            return
        fcntl.flock(self._file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)

    def _claim(self, pid: int) -> int:
        with self._locked():
            for row in range(MAX_NODES):
                if self.table[row, PID] == 0 or not self.is_alive(int(self.table[row, PID])):
                    self.table[row] = (pid, self.share, 0, self.clock() - LINGER_S)
                    return row
        raise RuntimeError(f"core pool {self.name}: more than {MAX_NODES} nodes")

    def begin(self, want: int) -> int:
        """Cores for the next pass, at most min(want, cap); waits while a borrower gives
        this node's share back (at most one of its layers)."""
        want = self._want = max(1, min(want, self.cap))
        waited_from = None
        while True:
            with self._locked():
                now = self.clock()
                grant = decide(self.table, self.budget, self.row, want, now, self.is_alive)
                if grant:
                    self.table[self.row, HELD], self.table[self.row, STAMP] = grant, now
                    break
                self.table[self.row, STAMP] = now   # busy: the borrower sees my share owed
            waited_from = now if waited_from is None else waited_from
            time.sleep(WAIT_S)
        f = self.figures
        f.num_passes += 1
        f.num_lent_passes += grant > self.share
        if waited_from is not None:
            f.num_waits += 1
            f.wait_s += now - waited_from
        self.set_threads(grant)   # NOTE: always: the pass before may have left others set
        self.held = self.threads = grant
        return grant

    def between_layers(self, num_done: int = 0) -> None:
        """A borrower gives back what another node is now owed (never below one core);
        a node that started short takes what has come free, up to what its pass wants.
        (num_done: the forward's count of layers done, not needed here.)"""
        free = free_cores(self.table, self.budget, self.row, self.clock(), self.is_alive)
        if max(1, min(self._want, free)) == self.held:
            return   # NOTE: the common case reads the table without its lock
        with self._locked():
            now = self.clock()
            grant = max(1, min(self._want, free_cores(self.table, self.budget, self.row, now, self.is_alive)))
            self.table[self.row, HELD], self.table[self.row, STAMP] = grant, now
        self.figures.num_shrinks += grant < self.held
        self._apply(grant)

    def end(self) -> None:
        with self._locked():
            self.table[self.row, HELD], self.table[self.row, STAMP] = 0, self.clock()
        self.held = 0

    def _apply(self, grant: int) -> None:
        if grant != self.threads:
            self.set_threads(grant)
        self.held = self.threads = grant

    def stats(self) -> dict:
        f = self.figures
        return {"core_budget": self.budget, "core_share": self.share, "cores_held": self.held,
                "num_core_passes": f.num_passes, "num_lent_passes": f.num_lent_passes,
                "num_core_waits": f.num_waits, "core_wait_s": round(f.wait_s, 6),
                "num_core_shrinks": f.num_shrinks}

    def close(self) -> None:
        with self._locked():
            self.table[self.row] = 0
            if self._file is not None and not self.table[:, PID].any():
                try:   # the last node out removes the table
                    os.unlink(f"/dev/shm/{self.name}")
                except FileNotFoundError:
                    pass
        if self._file is not None:
            self.table = np.zeros_like(self.table)   # NOTE: drop the view before the map closes
            self._map.close()
            os.close(self._file)
            self._file = None
