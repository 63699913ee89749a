"""Fixtures the core table's tests share (test_cores.py, test_core_file.py,
test_core_turns.py, test_pass_time.py)."""

from __future__ import annotations

import contextlib
import os
import random

import numpy as np
import pytest

from common.engine import cores
from common.engine.cores import MAX_NODES, NUM_COLS, CorePool


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def bounded(monkeypatch):
    """A fake clock that each wait for a borrower moves on by 10 ms; a wait past 60 s of
    it fails the test instead of hanging it."""
    clock = _Clock()
    began = clock.now

    def sleep(_s):
        clock.now += 0.01
        if clock.now - began > 60:
            raise AssertionError("a wait for a borrower with no end")

    monkeypatch.setattr(cores.time, "sleep", sleep)
    return clock


@pytest.fixture
def shm_name():
    name = f"pdserve-test-cores-{random.getrandbits(32):x}"
    yield name
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{name}")


@pytest.fixture
def host():
    """Two cores, a prefill node and a decode node owed one each, both idle a while: (the
    table, its fake clock, the prefill node's pool, the decode node's)."""
    table, clock = np.zeros((MAX_NODES, NUM_COLS)), _Clock()
    prefill, decode = (
        CorePool(
            "t", 2, 1, 2, lambda n: None, clock=clock, is_alive=lambda *_: True, table=table,
            pid=pid,
        )
        for pid in (1, 2)
    )  # fmt: skip
    clock.now += 1.0
    return table, clock, prefill, decode
