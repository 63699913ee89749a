"""A model shipped to the machines of a Ray cluster (launch/ray/model_copy.py): copies named
by what their files hold, checked as fetched, dot-files left out, older copies pruned
unless a member holds them. No Ray: the reader is a function here."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from launch.ray import model_copy


def _model(root: Path, weights: bytes = b"w" * 10000, name: str = "tiny") -> Path:
    d = root / name
    (d / "sub").mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")
    (d / "sub" / "model.safetensors").write_bytes(weights)
    return d


def _reader(model_dir: Path, calls: list | None = None):
    def read(rel, at, n):
        if calls is not None:
            calls.append(rel)
        return model_copy.read_part(model_dir, rel, at, n)

    return read


def _copy(model_dir: Path, cache: Path, calls: list | None = None) -> model_copy.Copy:
    files = model_copy.manifest(model_dir)
    return model_copy.local_copy(str(model_dir), files, _reader(model_dir, calls), cache)


def _close(*copies: model_copy.Copy) -> None:
    for c in copies:
        os.close(c.hold_fd)


def test_a_model_copied_in_parts_is_the_same_and_fetched_once(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(model_copy, "PART_BYTES", 4096)  # several parts per weight file
    files = model_copy.manifest(tiny_model)
    calls = []
    first = _copy(tiny_model, tmp_path, calls)
    assert first.num_fetched == sum(size for _, size, _ in files) and len(calls) > len(files)
    for rel, _, digest in files:
        data = (first.path / rel).read_bytes()
        assert data == (tiny_model / rel).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest
    again = _copy(tiny_model, tmp_path, calls)
    assert (again.path, again.num_fetched, again.num_pruned) == (first.path, 0, 0)
    _close(first, again)
    with pytest.raises(ValueError, match="is not a file"):
        model_copy.read_part(tiny_model, "../../etc/passwd", 0, 10)
    read = _reader(tiny_model)
    with pytest.raises(ValueError, match="leaves"):
        model_copy.local_copy("m", [("../x", 1, "0" * 64)], read, tmp_path / "other")
    with pytest.raises(ValueError, match="not \\(path, size, sha256\\)"):
        model_copy.local_copy("m", [("x", 1, "not a hash")], read, tmp_path / "other")


def test_a_checkpoint_rewritten_in_place_with_the_same_sizes_is_fetched_again(tmp_path):
    """A copy was keyed by (path, size): a checkpoint rewritten in place, sizes unchanged,
    was never fetched again, and machines served different weights. The key is what the
    files hold, even where the rewrite put the old mtime back."""
    src = _model(tmp_path / "src")
    first = _copy(src, tmp_path / "cache")
    weights = src / "sub" / "model.safetensors"
    st = weights.stat()
    weights.write_bytes(b"v" * st.st_size)  # new weights, same size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime
    second = _copy(src, tmp_path / "cache")
    assert second.path != first.path and second.num_fetched == st.st_size + 2
    assert (second.path / "sub" / "model.safetensors").read_bytes() == b"v" * st.st_size
    _close(first, second)


def test_a_file_is_hashed_once_per_version(tmp_path, monkeypatch):
    src = _model(tmp_path / "src")
    hashed = []
    real = hashlib.sha256

    def counting(*a):
        hashed.append(1)
        return real(*a)

    monkeypatch.setattr(model_copy.hashlib, "sha256", counting)
    first = model_copy.manifest(src)
    assert model_copy.manifest(src) == first and len(hashed) == 2  # two files, once each
    (src / "config.json").write_text("{ }")
    assert model_copy.manifest(src) != first and len(hashed) == 3  # the changed one again


def test_bytes_that_are_not_those_listed_are_refused(tmp_path):
    """The listing is the key a member compares: bytes fetched that do not hash to it (the
    model changed as it was copied) make no copy."""
    src = _model(tmp_path / "src")
    files = model_copy.manifest(src)
    (src / "sub" / "model.safetensors").write_bytes(b"x" * 10000)
    with pytest.raises(OSError, match="not those listed"):
        model_copy.local_copy(str(src), files, _reader(src), tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())


def test_dot_files_are_not_shipped(tmp_path):
    """Hidden files (a .git directory, a download cache's state) were shipped with the
    model. They are not listed, not read, and not written."""
    src = _model(tmp_path / "src")
    (src / ".git").mkdir()
    (src / ".git" / "config").write_text("[core]")
    (src / "sub" / ".cache").write_text("state")
    (src / ".DS_Store").write_bytes(b"\0")
    listed = [rel for rel, _, _ in model_copy.manifest(src)]
    assert listed == ["config.json", "sub/model.safetensors"]
    with pytest.raises(ValueError, match="is not a file"):
        model_copy.read_part(src, ".git/config", 0, 10)
    with pytest.raises(ValueError, match="dot-file"):
        model_copy.local_copy(
            str(src), [(".git/config", 6, "0" * 64)], _reader(src), tmp_path / "c"
        )


def test_older_copies_are_pruned_unless_a_member_holds_them(tmp_path):
    """Shipped copies were never removed: each version of a model stayed on every machine.
    Once a newer copy is whole, the older ones no member holds go, and half-fetched ones
    of members gone; a copy a running member holds, and other models' copies, stay."""
    cache = tmp_path / "cache"
    src = _model(tmp_path / "src", b"1" * 100)
    in_use = _copy(src, cache)  # a member still serving version 1
    other = _copy(_model(tmp_path / "other-src", b"o" * 10, "tiny2"), cache / "x")
    (src / "sub" / "model.safetensors").write_bytes(b"2" * 100)
    old = _copy(src, cache)
    _close(old)  # version 2: its member is gone
    gone = 2**22 + 1  # past the kernel's largest pid
    name, host = model_copy.copy_name(str(src)), model_copy._HOST
    half_dead = cache / f".{name}-{'a' * 16}.{host}.{gone}"
    half_live = cache / f".{name}-{'b' * 16}.{host}.{os.getpid()}"
    half_elsewhere = cache / f".{name}-{'c' * 16}.another-host.{gone}"  # a shared file system
    namesake = cache / f"tiny-{'0' * 8}-{'d' * 16}"  # another directory named tiny: not a version
    for d in (half_dead, half_live, half_elsewhere, namesake):
        d.mkdir()
    (namesake / model_copy.COMPLETE).write_text("")
    shutil.copytree(other.path, cache / other.path.name)
    (src / "sub" / "model.safetensors").write_bytes(b"3" * 100)
    new = _copy(src, cache)
    assert new.num_pruned == 1 and not old.path.exists() and in_use.path.is_dir()
    assert not half_dead.exists() and half_live.exists() and (cache / other.path.name).exists()
    assert half_elsewhere.exists() and namesake.exists()
    _close(in_use)
    newest = _copy(src, cache)  # another member, the same version
    assert newest.path == new.path and newest.num_pruned == 1 and not in_use.path.exists()
    _close(new, newest, other)


def test_a_model_rewritten_as_it_is_copied_is_listed_and_copied_again(tmp_path):
    src = _model(tmp_path / "src")
    weights = src / "sub" / "model.safetensors"
    lines, versions = [], iter([b"2", b"3", b"4", b"5"])

    def rewriting_read(rel, at, n):  # the first part of each copy: the checkpoint rewritten
        if rel == "sub/model.safetensors" and at == 0 and rewrites:
            rewrites.pop()
            weights.write_bytes(next(versions) * 10000)
        return model_copy.read_part(src, rel, at, n)

    rewrites = [1]
    copy = model_copy.copy_model(
        str(src), lambda: model_copy.manifest(src), rewriting_read, tmp_path / "cache", lines.append
    )
    assert (copy.path / "sub" / "model.safetensors").read_bytes() == b"2" * 10000
    assert len(lines) == 1 and "not those listed" in lines[0] and "copying it again" in lines[0]
    os.close(copy.hold_fd)
    weights.write_bytes(b"9" * 10000)  # a version not copied yet,
    rewrites[:] = [1] * model_copy.MAX_COPY_TRIES  # rewritten during every copy
    with pytest.raises(model_copy.ModelChanged, match="not those listed"):
        model_copy.copy_model(
            str(src),
            lambda: model_copy.manifest(src),
            rewriting_read,
            tmp_path / "cache",
            lines.append,
        )
