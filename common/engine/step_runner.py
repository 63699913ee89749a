"""Where a decode step's device part runs on the host, and how long the device spent.

On a CPU a step's ops run in its launch, on host threads: the node's own (at most the
threads a step of its rows is worth: an op split over more waits at its end for all of
them) or those a shared core table lends (cores.py), while the node keeps reading its
links. On a device with events a step's time is measured there, and so is the gap
between consecutive steps (the device's idleness).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from common.engine.ticket import DecodeTicket


class StepRunner:
    def __init__(self, platform):
        self.platform = platform
        self.device_busy_s = 0.0
        self.device_idle_s = 0.0  # gaps between consecutive steps on the device
        self._last_end = None
        self.cores = None  # CPU: the host's shared cores (cores.py), asked each step
        self.threads_worth: Callable[[int], int] = lambda num_rows: 1  # cores a step is worth
        # what a step does while it yields its cores to a prefill pass (the node reads its links)
        self.while_yielding: Callable[[float], None] | None = None
        # Host threads a step runs on where no core table is asked (the node's own cores);
        # NOTE: the loop thread runs its other ops on one (Worker.prepare), so a step sets
        # its own count and gives it back.
        self.num_threads: int | None = None

    def run(self, step: Callable, args: tuple, num_seqs: int, num_rows: int, t0: float) -> float:
        """step(*args[, between_layers]): a step's device part over num_seqs sequences and
        num_rows query rows (a verify step's k + 1 a sequence), on the threads it may use.
        t0: when the step's host time started (its launch: its masks' upload counts);
        returns it, or where the step waited for cores, when the wait ended."""
        if self.cores is None and self.num_threads is None:
            step(*args)
        elif self.cores is None:
            torch.set_num_threads(min(self.num_threads, self.threads_worth(num_rows)))
            try:
                step(*args)
            finally:
                torch.set_num_threads(1)
        else:
            reads = self.while_yielding and self._read_while_yielding
            self.cores.begin(self.threads_worth(num_rows), True, reads, num_seqs=num_seqs)
            t0 = time.perf_counter()  # NOTE: waiting for cores is not the step's time
            try:
                step(*args, self.cores.between_layers)
            finally:
                self.cores.end()
        return t0

    def _read_while_yielding(self, timeout_s: float) -> None:
        # NOTE: out of the step's inference mode: a tensor a handler makes there (a tcp
        # landing's record) is one no later turn may update in place
        with torch.inference_mode(False):
            self.while_yielding(timeout_s)

    def count_host_time(self, ticket: DecodeTicket, t0: float) -> None:
        """A step launched without device events (CPU) ran in its launch: since t0."""
        ticket.busy_s = time.perf_counter() - t0
        self.device_busy_s += ticket.busy_s

    def wait(self, ticket: DecodeTicket) -> None:
        """Until the step's tokens are on the host; its device time counted."""
        if ticket.copied is None:
            self.platform.synchronize()  # no events here: a no-op on CPU
        else:
            ticket.copied.synchronize()
            ticket.busy_s = ticket.start.elapsed_time(ticket.end) / 1e3
            self.device_busy_s += ticket.busy_s
            if self._last_end is not None:
                self.device_idle_s += max(self._last_end.elapsed_time(ticket.start), 0.0) / 1e3
            self._last_end = ticket.end

    def mark_idle(self) -> None:
        """The node has nothing to run: the gap before the next step is not device idleness."""
        self._last_end = None
