"""A model directory copied to a machine that lacks it (pdserve serve --ray
--ray-ship-model): the files the driver's machine holds, read in parts by whoever
asks (a Ray member, through the controller), written under this machine's cache and
renamed into place once whole. No Ray here: launch/ray_members.py passes the reader.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable

PART_BYTES = 64 << 20   # NOTE: one part is one message on Ray's channel: bounded memory per call


def manifest(model_dir: str | Path) -> list[tuple[str, int]]:
    """(relative path, size) of every file under the directory, sorted."""
    root = Path(model_dir)
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file())


def read_part(model_dir: str | Path, rel: str, offset: int, length: int) -> bytes:
    """length bytes (at most PART_BYTES) of one listed file; ValueError for a path
    outside the directory."""
    root = Path(model_dir).resolve()
    path = (root / rel).resolve()
    if root not in path.parents or not path.is_file():
        raise ValueError(f"{rel!r} is not a file of {model_dir}")
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(min(length, PART_BYTES))


def local_copy(model_dir: str, files: list[tuple[str, int]], read: Callable[[str, int, int], bytes],
               cache: Path) -> tuple[Path, int]:
    """-> (this machine's copy, bytes fetched: 0 when a whole copy was here already).
    The copy's name holds a digest of the listing, so a changed model is fetched again."""
    digest = hashlib.sha256(repr(files).encode()).hexdigest()[:16]
    dest = cache / f"{Path(model_dir).name}-{digest}"
    if (dest / ".complete").is_file():
        return dest, 0
    part = cache / f".{dest.name}.{os.getpid()}"
    shutil.rmtree(part, ignore_errors=True)
    fetched = 0
    for rel, size in files:
        target = part / rel
        if target.resolve().parent != part.resolve() and part.resolve() not in target.resolve().parents:
            raise ValueError(f"{rel!r} leaves the copy's directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:
            while f.tell() < size:
                data = read(rel, f.tell(), PART_BYTES)
                if not data:
                    raise OSError(f"{rel} ended at {f.tell()} of {size} bytes")
                f.write(data)
                fetched += len(data)
    (part / ".complete").touch()
    try:
        part.rename(dest)
    except OSError:   # another member on this machine finished first
        shutil.rmtree(part, ignore_errors=True)
    return dest, fetched
