"""The host's core table as a file (/dev/shm/<pool>): made or opened only where it is
safely this user's, mapped, locked for microseconds with a deadline, and removed by the
last node out (cores.py decides what the rows say; core_table.py what they mean).

It is made with O_EXCL, opened with O_NOFOLLOW, and used only while it is a plain file of
this user's that no one else may write; else the node runs on its share alone (a fixed
split, as --no-core-sharing gives)."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import time

import numpy as np

from common.base.files import is_at
from common.engine.core_table import MAX_NODES, NUM_COLS, TABLE_BYTES, WAIT_S


def open_table(path: str) -> int:
    """A descriptor of the table at path, made here or opened; OSError naming why for
    anything but a plain file of this user's that no one else may write (a link, a file
    another user planted under the name: its rows are never read)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(3):  # NOTE: the last node out may remove it between the two opens
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            break
        except FileExistsError:
            pass
        try:
            fd = os.open(path, flags)
            break
        except FileNotFoundError:
            continue
        except OSError as e:
            raise OSError(
                e.errno,
                f"{path} is a symbolic link" if e.errno == errno.ELOOP else f"{path}: {e.strerror}",
            ) from None
    else:
        raise OSError(errno.EAGAIN, f"{path} was removed and made again as it was opened")
    st = os.fstat(fd)
    why = (
        "is not a plain file"
        if not stat.S_ISREG(st.st_mode)
        else f"belongs to uid {st.st_uid}, not {os.getuid()}"
        if st.st_uid != os.getuid()
        else f"has mode {st.st_mode & 0o777:o}: others may write it"
        if st.st_mode & 0o077
        else f"has {st.st_nlink} names"
        if st.st_nlink != 1
        else f"holds {st.st_size} bytes, not a table of this version's {TABLE_BYTES}"
        if st.st_size not in (0, TABLE_BYTES)
        else ""
    )
    if why:
        os.close(fd)
        raise OSError(errno.EPERM, f"{path} {why}")
    if st.st_size < TABLE_BYTES:
        try:
            os.ftruncate(fd, TABLE_BYTES)
        except OSError:
            os.close(fd)
            raise
    return fd


class TableFile:
    """One node's descriptor and mapping of the table at path."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None
        self._map: mmap.mmap | None = None

    def open(self, deadline_s: float) -> np.ndarray:
        """The table's rows, mapped; OSError naming why it is not safely ours, or that
        another held its lock past deadline_s (a node stopped holding it)."""
        for _ in range(3):
            self.fd = open_table(self.path)
            try:
                if not self.lock(deadline_s):
                    raise OSError(errno.EAGAIN, f"its lock was held for more than {deadline_s:g}s")
                try:
                    is_ours = is_at(self.path, self.fd)  # NOTE: else the last node out removed it
                finally:
                    self.unlock()
            except BaseException:
                self._close_fd()
                raise
            if is_ours:
                break
            self._close_fd()
        else:
            raise OSError(errno.EAGAIN, f"{self.path} was removed as it was opened, 3 times")
        try:
            self._map = mmap.mmap(self.fd, TABLE_BYTES)
        except (OSError, ValueError) as e:
            self._close_fd()
            raise OSError(errno.EIO, f"{self.path} could not be mapped: {e}") from None
        return np.frombuffer(self._map, dtype=np.float64).reshape(MAX_NODES, NUM_COLS)

    def lock(self, deadline_s: float) -> bool:
        """The table to this node (False: another held it past deadline_s)."""
        give_up_at = time.monotonic() + deadline_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= give_up_at:
                    return False
                time.sleep(WAIT_S)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def remove_if_empty(self, table: np.ndarray) -> None:
        """The last node out removes the table, if the name is still this file (locked)."""
        if not table[:, 0].any() and is_at(self.path, self.fd):
            os.unlink(self.path)

    def close(self) -> None:
        """Unmapped and closed. NOTE: the caller drops its view of the rows first."""
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive: the mapping goes with the process
            pass
        self._close_fd()

    def _close_fd(self) -> None:
        os.close(self.fd)
        self.fd = None
