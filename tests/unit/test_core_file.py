"""The core table's file (common/engine/core_file.py): made only where it is safely this
user's, refused where it is planted, linked or of another layout, removed by the last node
out, and its lock never held past a node's deadline."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from common.engine.cores import MAX_NODES, NUM_COLS, CorePool


def _alone(pool: CorePool, planted: Path, before: bytes) -> None:
    assert pool.budget == pool.share == 1 and pool.begin(4) == 1  # on its share alone
    pool.end()
    pool.close()
    assert planted.read_bytes() == before  # never written


@pytest.mark.parametrize("kind", ["another user's", "open to others"])
def test_a_table_planted_under_the_name_is_not_used(shm_name, bounded, kind):
    """A file another local user planted under the table's predictable name (or one of
    ours that others may write) made begin() raise or spin on its rows: it is refused,
    never read or written, and the node runs on its share alone."""
    path = Path("/dev/shm", shm_name)
    path.write_bytes(np.full((MAX_NODES, NUM_COLS), np.nan).tobytes())  # rows that raise
    if kind == "another user's":
        if os.getuid() != 0:
            pytest.skip("planting another user's file needs root")
        os.chown(path, 65534, 65534)
        os.chmod(path, 0o600)
    else:
        os.chmod(path, 0o644)
    before = path.read_bytes()
    pool = CorePool(shm_name, 4, 1, 4, lambda n: None, clock=bounded)
    _alone(pool, path, before)
    assert path.exists()  # not ours to remove


def test_a_table_of_another_layout_is_not_used(shm_name, bounded):
    """A table an older version made (a column fewer) was grown and read at the new
    stride: a live old node's row read as junk, its cores taken as free. A file of any
    size but none or this version's is refused, and the node runs on its share alone."""
    path = Path("/dev/shm", shm_name)
    path.write_bytes(np.zeros((MAX_NODES, NUM_COLS - 1)).tobytes())
    os.chmod(path, 0o600)
    pool = CorePool(shm_name, 4, 1, 4, lambda n: None, clock=bounded)
    _alone(pool, path, path.read_bytes())


def test_a_symlink_planted_under_the_name_is_not_followed(shm_name, bounded, tmp_path):
    """A symbolic link planted under the table's name was followed: the file it names
    was cut to the table's size and written. It is refused; that file is untouched."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"not a core table")
    os.symlink(victim, f"/dev/shm/{shm_name}")
    pool = CorePool(shm_name, 4, 1, 4, lambda n: None, clock=bounded)
    _alone(pool, victim, b"not a core table")


def test_the_table_made_is_ours_alone_and_removed_by_the_last_node_out(shm_name):
    pool = CorePool(shm_name, 2, 1, 2, lambda n: None)
    st = os.stat(f"/dev/shm/{shm_name}", follow_symlinks=False)
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o600 and pool.budget == 2
    pool.close()
    assert not os.path.exists(f"/dev/shm/{shm_name}")


def test_a_node_starting_while_another_holds_the_tables_lock_waits_its_deadline(shm_name):
    """Opening the table took its lock with no deadline: a node stopped holding it stopped
    every node starting on the host. It waits deadline_s, then runs on its share alone."""
    import fcntl
    import time

    first = CorePool(shm_name, 4, 1, 4, lambda n: None)
    stopped = os.open(f"/dev/shm/{shm_name}", os.O_RDWR)
    fcntl.flock(stopped, fcntl.LOCK_EX)  # held, and never given back
    try:
        t0 = time.monotonic()
        second = CorePool(shm_name, 4, 2, 4, lambda n: None, deadline_s=0.3)
        assert time.monotonic() - t0 < 2 and second.budget == second.share == 2
        assert second.begin(4) == 2
        second.end()
        second.close()
    finally:
        os.close(stopped)
        first.close()


def test_a_node_stopped_while_holding_the_tables_lock_stops_no_other(shm_name):
    """Defect: the table's lock was taken with no deadline: a node stopped (SIGSTOP, a
    debugger) inside its microsecond hold of it stopped every node on the host in begin(),
    between_layers() and end(). Past deadline_s the node leaves the table, on its share alone."""
    import fcntl
    import time

    first = CorePool(shm_name, 4, 1, 4, lambda n: None)
    stopped = os.open(f"/dev/shm/{shm_name}", os.O_RDWR)
    fcntl.flock(stopped, fcntl.LOCK_EX)  # held, and never given back
    try:
        t0 = time.monotonic()
        assert first.begin(4) == 1  # its share alone, once the wait ended
        assert time.monotonic() - t0 < 5 and first.budget == 1
        first.between_layers()
        first.end()
        first.close()  # none of it waits on the lock again
        assert time.monotonic() - t0 < 5
    finally:
        os.close(stopped)
