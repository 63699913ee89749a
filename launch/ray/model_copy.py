"""A model directory copied to a machine that lacks it (pdserve serve --ray
--ray-ship-model): the files the driver's machine holds, read in parts by whoever
asks (a Ray member, through the controller), written under this machine's cache and
renamed into place once whole. No Ray here: launch/ray/members.py passes the reader.

A copy is named by what its files hold (a SHA-256 of each file's bytes), not by their
paths and sizes: a checkpoint rewritten in place, sizes unchanged, is fetched again, so
every machine serves the same weights. The driver hashes a file once per version of it
(its size, mtime, ctime and inode); a member checks each file it fetches against its
hash. Dot-files (.git, a download cache's state) are not part of a model and are not
shipped. A member holds the copy it uses (a shared lock on its .complete); older copies
of the same model that no member holds are removed once a newer one is whole.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from common.base.files import is_at
from common.base.procs import is_alive

PART_BYTES = 64 << 20  # NOTE: one part is one message on Ray's channel: bounded memory per call
HASH_READ_BYTES = 8 << 20
MAX_COPY_TRIES = 3  # a model that changes each time it is copied fails the member's start
HOLD_WAIT_S = 30.0  # the longest a member waits for a pruner's exclusive lock (a rename)
COMPLETE = ".complete"
HASH_RE = re.compile(r"[0-9a-f]{64}")

_hashes: dict[str, tuple[tuple, str]] = {}  # path -> (its version, the SHA-256 of its bytes)
_hash_lock = threading.Lock()  # NOTE: the controller answers members in threads


def is_hidden(rel: str | Path) -> bool:
    return any(part.startswith(".") for part in Path(rel).parts)


def _version(st: os.stat_result) -> tuple:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev


def file_hash(path: Path) -> str:
    """The SHA-256 of a file's bytes, read once per version of the file; OSError for one
    written to while it is read, three times over."""
    with _hash_lock:
        for _ in range(3):
            with open(path, "rb") as f:
                version = _version(os.fstat(f.fileno()))
                known = _hashes.get(str(path))
                if known and known[0] == version:
                    return known[1]
                h = hashlib.sha256()
                while chunk := f.read(HASH_READ_BYTES):
                    h.update(chunk)
                if _version(os.fstat(f.fileno())) == version:
                    _hashes[str(path)] = (version, h.hexdigest())
                    return h.hexdigest()
        raise OSError(errno.EAGAIN, f"{path} changes while it is read: is it still being written?")


def manifest(model_dir: str | Path) -> list[tuple[str, int, str]]:
    """(relative path, size, SHA-256) of every file under the directory but dot-files,
    sorted."""
    root = Path(model_dir)
    files = (p for p in root.rglob("*") if p.is_file() and not is_hidden(p.relative_to(root)))
    return sorted((str(p.relative_to(root)), p.stat().st_size, file_hash(p)) for p in files)


def read_part(model_dir: str | Path, rel: str, offset: int, length: int) -> bytes:
    """length bytes (at most PART_BYTES) of one listed file; ValueError for a path
    outside the directory, or a dot-file."""
    root = Path(model_dir).resolve()
    path = (root / rel).resolve()
    if root not in path.parents or not path.is_file() or is_hidden(path.relative_to(root)):
        raise ValueError(f"{rel!r} is not a file of {model_dir}")
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(min(length, PART_BYTES))


def _listing(files: list) -> list[tuple[str, int, str]]:
    """The controller's manifest, checked: (path, size, SHA-256) each."""
    out = []
    for entry in files:
        rel, size, digest = entry
        if (
            not isinstance(rel, str)
            or not isinstance(size, int)
            or size < 0
            or not isinstance(digest, str)
            or not HASH_RE.fullmatch(digest)
        ):
            raise ValueError(f"a model file listed as {entry!r}: not (path, size, sha256)")
        out.append((rel, size, digest))
    return sorted(out)


class ModelChanged(OSError):
    """Bytes fetched are not those listed: the model changed as it was copied."""


_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


@dataclass
class Copy:
    path: Path  # this machine's copy
    num_fetched: int  # bytes fetched: 0 when a whole copy was here already
    num_pruned: int  # older copies of the model removed
    hold_fd: int  # a shared lock on the copy: keep it open while the copy is in use


def copy_name(model_dir: str) -> str:
    """What a model's copies are named by, before each version's digest. NOTE: the source
    path counts: two models whose directories share a name are not versions of one another."""
    return f"{Path(model_dir).name}-{hashlib.sha256(model_dir.encode()).hexdigest()[:8]}"


def local_copy(
    model_dir: str, files: list, read: Callable[[str, int, int], bytes], cache: Path
) -> Copy:
    """This machine's copy of the model the controller listed (files: manifest()), fetched
    where none is whole here, held, and the older ones no one holds removed."""
    files = _listing(files)
    digest = hashlib.sha256(repr(files).encode()).hexdigest()[:16]
    name = copy_name(model_dir)
    dest = cache / f"{name}-{digest}"
    fetched = 0
    for _ in range(3):  # NOTE: a pruner elsewhere may remove a copy between a look and a hold
        if not (dest / COMPLETE).is_file():
            fetched += _fetch(files, read, dest)
        fd = hold(dest)
        if fd is not None:
            return Copy(dest, fetched, prune(cache, name, dest), fd)
    raise OSError(errno.EAGAIN, f"{dest} was removed as it was taken, 3 times")


def copy_model(
    model_dir: str,
    list_files: Callable[[], list],
    read: Callable[[str, int, int], bytes],
    cache: Path,
    say: Callable[[str], None],
) -> Copy:
    """local_copy of what list_files() lists; listed and copied again where the model
    changed as it was copied (ModelChanged after MAX_COPY_TRIES)."""
    for _ in range(MAX_COPY_TRIES - 1):
        try:
            return local_copy(model_dir, list_files(), read, cache)
        except ModelChanged as e:
            say(f"{e}; listing it and copying it again")
    return local_copy(model_dir, list_files(), read, cache)


def _fetch(
    files: list[tuple[str, int, str]], read: Callable[[str, int, int], bytes], dest: Path
) -> int:
    """Every file into a directory of this process's, each checked against its hash,
    renamed to dest once whole. -> bytes fetched."""
    part = dest.parent / f".{dest.name}.{_HOST}.{os.getpid()}"
    shutil.rmtree(part, ignore_errors=True)
    fetched = 0
    for rel, size, digest in files:
        target = part / rel
        if part.resolve() not in target.resolve().parents or is_hidden(rel):
            raise ValueError(f"{rel!r} leaves the copy's directory, or is a dot-file")
        target.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        with open(target, "wb") as f:
            while f.tell() < size:
                data = read(rel, f.tell(), PART_BYTES)
                if not data:
                    raise OSError(f"{rel} ended at {f.tell()} of {size} bytes")
                data = data[: size - f.tell()]
                h.update(data)
                f.write(data)
                fetched += len(data)
        if h.hexdigest() != digest:
            shutil.rmtree(part, ignore_errors=True)
            raise ModelChanged(
                f"{rel}: the bytes fetched are not those listed (sha256 "
                f"{h.hexdigest()[:16]}, not {digest[:16]}): the model changed "
                f"as it was copied"
            )
    (part / COMPLETE).touch()
    try:
        part.rename(dest)
    except OSError:  # another member on this machine finished first
        shutil.rmtree(part, ignore_errors=True)
    return fetched


def hold(copy: Path) -> int | None:
    """A shared lock on a whole copy (its .complete), or None where there is none (a
    pruner removed it first)."""
    try:
        fd = os.open(copy / COMPLETE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    deadline = time.monotonic() + HOLD_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            break
        except BlockingIOError:  # a pruner is renaming it away
            if time.monotonic() > deadline:
                os.close(fd)
                raise OSError(errno.EAGAIN, f"{copy} stayed locked {HOLD_WAIT_S:.0f}s") from None
            time.sleep(0.05)
    if not is_at(copy / COMPLETE, fd):
        os.close(fd)
        return None
    return fd


def prune(cache: Path, name: str, keep: Path) -> int:
    """Remove the copies of model `name` other than keep that no member holds, and the
    half-fetched ones of members gone. -> copies removed."""
    num_pruned = 0
    whole = re.compile(re.escape(name) + r"-[0-9a-f]{16}")
    # NOTE: a half-fetched copy is judged by its process only on its own host (a cache on a
    # file system several hosts share holds others' too)
    half = re.compile(
        r"\." + re.escape(name) + r"-[0-9a-f]{16}\.(?:pruned\.)?" + re.escape(_HOST) + r"\.(\d+)"
    )
    for d in sorted(cache.iterdir()) if cache.is_dir() else []:
        if d.is_symlink() or not d.is_dir() or d == keep:
            continue
        m = half.fullmatch(d.name)
        if m and not is_alive(int(m[1])):
            shutil.rmtree(d, ignore_errors=True)
        elif whole.fullmatch(d.name):
            num_pruned += _remove_unheld(d)
    return num_pruned


def _remove_unheld(copy: Path) -> int:
    try:
        fd = os.open(copy / COMPLETE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0  # not whole: being renamed into place, or not ours to judge
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0  # a member uses it
        trash = copy.parent / f".{copy.name}.pruned.{_HOST}.{os.getpid()}"
        try:
            copy.rename(trash)  # NOTE: under the lock: a member that holds it next sees it gone
        except OSError:
            return 0
    finally:
        os.close(fd)
    shutil.rmtree(trash, ignore_errors=True)
    return 1
