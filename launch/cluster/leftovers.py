"""What launchers killed before they could clean up leave in this machine's temp
directory and /dev/shm: swept by the next launcher (launch/start_cluster.py) or Ray member
(launch/ray/members.py) that starts here; and a launcher's own core tables, removed as it
exits."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from common.base.procs import is_alive
from launch.cluster.plan import CORE_TABLE_PREFIX, Plan


def remove_leftovers() -> None:
    """Temporary keys, ready files and core tables of launchers killed before they could
    remove them (their pid, in the name, is gone)."""
    for d in Path(tempfile.gettempdir()).glob("pdserve-*-*-*"):
        kind, _, rest = d.name.removeprefix("pdserve-").partition("-")
        pid = rest.partition("-")[0]
        if (
            kind in ("keys", "ready")
            and pid.isdigit()
            and d.is_dir()
            and d.stat().st_uid == os.getuid()
            and not is_alive(int(pid))
        ):
            shutil.rmtree(d, ignore_errors=True)
    for f in Path("/dev/shm").glob(f"{CORE_TABLE_PREFIX}*-*"):
        pid = f.name.removeprefix(CORE_TABLE_PREFIX).partition("-")[0]
        if pid.isdigit() and f.stat().st_uid == os.getuid() and not is_alive(int(pid)):
            f.unlink(missing_ok=True)


def remove_core_tables(plan: Plan) -> None:
    """Ours, once every node is gone (a node killed leaves its row, and the table)."""
    for pool in set(plan.core_pools.values()):
        Path("/dev/shm", pool.partition(":")[0]).unlink(missing_ok=True)
