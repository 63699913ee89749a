"""Whether a process of this pid namespace still runs."""

from __future__ import annotations

import os


def is_alive(pid: int) -> bool:
    """True while pid runs (also one of another user's, which we may not signal)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
