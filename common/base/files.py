"""Files shared between processes: whether a name still points at the file held open."""

from __future__ import annotations

import os


def is_at(path: str | os.PathLike, fd: int) -> bool:
    """Is the file open at fd still the one at path (not removed, nor replaced)?"""
    try:
        st, mine = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
