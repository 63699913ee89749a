"""Threads that yield the CPU to a process's latency-bound work."""

from __future__ import annotations

import os
import threading


def lower_this_thread(by: int) -> None:
    """Raise this thread's nice value by `by` (Linux applies a thread id's priority to
    that thread alone); where that cannot be done, nothing happens."""
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:
            os.setpriority(
                os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + by
            )
        except OSError:
            pass
