"""Threads that yield the CPU to a process's latency-bound work."""

from __future__ import annotations

import os
import threading
import time


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


def lower_this_process(nice: int, group_nice: int) -> None:
    """Run this process, and what it starts, at `nice`, in a session of its own ranked at
    `group_nice` against every other session's group; where that cannot be done, as far as
    it can.

    NOTE: where the kernel groups processes by session (autogroup, on by default on many
    hosts), a nice value ranks a thread only among those of its own session, and each
    session's group gets an equal share of a core: a child at nice 19 in its parent's
    session takes its time from its parent (a frontend waited 0.2-0.8 s for a core while
    its grammar checker imported torch). So the process leaves for a session of its own,
    whose group is ranked at group_nice (/proc/self/autogroup). A group ranked at 19 would
    get 1.5% of a core a busy group contends for: seconds of start-up would take minutes."""
    try:
        os.setsid()
        is_alone = True
    except (OSError, AttributeError):
        is_alone = False  # NOTE: never rank a session it shares (a group's leader, or a
        # session's: one started with start_new_session, whose children share it)
    for num_left in range(4, -1, -1) if is_alone else ():
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(group_nice))
            break
        except BlockingIOError:  # NOTE: unprivileged, one write per 100 ms on the host
            time.sleep(0.1 if num_left else 0)
        except OSError:
            break  # no autogroups here: a nice value ranks the process among all
    try:
        os.nice(max(0, nice - os.nice(0)))
    except OSError:
        pass
