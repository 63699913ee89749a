"""A process's life tied to its launcher's, set first thing, before anything slow is
imported: a node's imports (torch) take seconds, and a launcher killed meanwhile would
otherwise leave the node to load, bind its ports and serve with no one to stop it."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from common.base.env import PARENT_PID_ENV

PR_SET_PDEATHSIG = 1


def set_death_signal(sig: int) -> bool:
    """Linux: get sig when the thread that started this process ends (its launcher's, for
    a process started from a launcher's main thread), however it ends. False where it
    cannot be set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) == 0
    except (OSError, AttributeError):  # NOTE: a libc without prctl: the process goes on
        return False


def die_with_parent(prog: str) -> None:
    """SIGINT when the launching process dies, however it dies; and if it died already
    (between the spawn and this call: PARENT_PID_ENV is no longer the parent), end now,
    exit status 1. The variable is taken out of the environment, so this process's own
    children do not read it as theirs.
    NOTE: not SIGTERM, which a node takes as a drain: with its launcher gone there is
    nothing to wait for. (Launchers start each process in its own session, so no
    terminal's Ctrl-C reaches it this way.)"""
    launcher = os.environ.pop(PARENT_PID_ENV, "")
    set_death_signal(signal.SIGINT)
    if launcher.isdigit() and os.getppid() != int(launcher):
        print(
            f"{prog}: its launcher (pid {launcher}) ended before it started: not starting",
            file=sys.stderr,
        )
        sys.stderr.flush()
        os._exit(1)
