"""A node's periodic log line: what it did since the last one and what it holds now.
The node says it while it works and once as it goes idle (common/base/log.py:
IdleQuiet), so an idle node's log stays still."""

from __future__ import annotations

import logging
import time
from typing import Callable

from common.base.log import IdleQuiet


def decode(s: dict, num_tokens: int, num_steps: int, elapsed_s: float) -> tuple[bool, str]:
    """(whether the node is busy, its line); s: the node's stats."""
    is_busy = bool(num_tokens or s["num_running"] or s["num_queued"] or s["num_preempted"])
    preempted = (
        ""
        if not s["num_preemptions"]
        else f" | preempted {s['num_preempted']} now, {s['num_preemptions']} in all "
        f"({s['num_swapped']} swapped, {s['num_recomputed']} recomputed)"
    )
    rate = num_tokens / elapsed_s if elapsed_s else 0.0
    return is_busy, (
        f"{rate:.0f} tok/s, {num_tokens / max(num_steps, 1):.1f} avg batch | running "
        f"{s['num_running']}, queued {s['num_queued']} | free blocks "
        f"{s['num_free_blocks']}/{s['num_usable_blocks']} ({s['num_reserved_blocks']} "
        f"reserved){preempted}{'' if is_busy else ' | idle now'}"
    )


def prefill(s: dict, num_tokens: int, elapsed_s: float) -> tuple[bool, str]:
    """(whether the node is busy, its line); s: the node's stats."""
    is_busy = bool(
        num_tokens or s["num_waiting"] or s["num_prefilling"] or s["num_pending_handoffs"]
    )
    rate = num_tokens / elapsed_s if elapsed_s else 0.0
    return is_busy, (
        f"{rate:.0f} prompt tok/s | waiting {s['num_waiting']} "
        f"({s['num_unreserved']} for a decode reservation), prefilling "
        f"{s['num_prefilling']}, pending handoffs "
        f"{s['num_pending_handoffs']} | free blocks {s['num_free_blocks']}/"
        f"{s['num_usable_blocks']}{'' if is_busy else ' | idle now'}"
    )


class PeriodicLine:
    """When a node's periodic line is due (every interval_s, asked each turn) and whether it
    is said (IdleQuiet: while busy, and once as the node goes idle)."""

    def __init__(
        self, log: logging.Logger, interval_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self._log, self.interval_s, self._clock = log, interval_s, clock
        self._last: float | None = None  # when the last line was due
        self._quiet = IdleQuiet()

    def due_s(self) -> float | None:
        """None before the interval has passed; else the seconds since the last line was due
        (0.0 for the first), and the interval starts again."""
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            return None
        elapsed, self._last = (0.0 if self._last is None else now - self._last), now
        return elapsed

    def say(self, is_busy: bool, line: str) -> None:
        if self._quiet.says(is_busy):
            self._log.info("%s", line)
