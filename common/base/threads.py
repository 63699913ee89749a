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


def lower_this_process(nice: int) -> None:
    """Run this process, and what it starts, at `nice` against every other process on the
    host; where that cannot be done, as far as it can.

    NOTE: where the kernel groups processes by session (autogroup, on by default on many
    hosts), a nice value ranks a thread only among those of its own session, and each
    session's group gets an equal share of a core: a child at nice 19 in its parent's
    session takes its time from its parent (a frontend waited 0.2-0.8 s for a core while
    its grammar checker imported torch). So the process leaves for a session of its own,
    whose group is ranked at `nice` (/proc/self/autogroup), and takes `nice` itself too."""
    try:
        os.setsid()
    except (OSError, AttributeError):
        pass  # a process group's leader already: its session stays
    try:
        if os.getsid(0) == os.getpid():  # NOTE: never rank a session it shares with others
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
    except OSError:
        pass  # no autogroups here: a nice value ranks the process among all
    try:
        os.nice(max(0, nice - os.nice(0)))
    except OSError:
        pass
