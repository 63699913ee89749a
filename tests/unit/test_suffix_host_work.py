"""Suffix decoding's host work where drafts do not pay: a plain step's tokens held apart
until they are read, and the lean indexing of a probe after plain steps."""

import random

import torch

from common.engine.drafting.suffix import SuffixDrafter
from common.engine.h2d import HostToDevice


def test_suffix_decodings_plain_steps_held_apart_change_nothing(monkeypatch):
    """A plain step's tokens wait in took_one until rows change or propose: random joins,
    leaves, plain and verify steps give the drafts and sources of taking each at once."""
    from common.engine.drafting import suffix

    monkeypatch.setattr(suffix, "MAX_PENDING", 5)
    cpu = HostToDevice(torch.device("cpu"))
    lazy, eager = SuffixDrafter(6, 4, 24, 3, cpu), SuffixDrafter(6, 4, 24, 3, cpu)
    rng = random.Random(3)
    n = 0
    for _ in range(600):
        op = rng.random()
        if n < 6 and (op < 0.1 or not n):
            ids = [rng.randrange(8) for _ in range(rng.randrange(1, 12))]
            for d in (lazy, eager):
                d.set_row(n, ids)
            n += 1
        elif op < 0.18:
            row = rng.randrange(n)
            for d in (lazy, eager):
                d.remove_row(row, n - 1)
            n -= 1
        elif op < 0.75:  # a plain step
            tokens = [rng.randrange(8) for _ in range(n)]
            lazy.took_one(tokens)
            eager.took([[t] for t in tokens])
        else:  # a verify step
            k = rng.randrange(1, 5)
            seq_lens = torch.zeros(n, dtype=torch.int32)
            got = [d.propose(n, seq_lens, k, 0).tolist() for d in (lazy, eager)]
            assert got[0] == got[1]
            made = [[rng.randrange(8) for _ in range(rng.randrange(1, k + 2))] for _ in range(n)]
            for d in (lazy, eager):
                d.took(made)
        assert lazy._index == eager._index
    lazy._flush()
    assert lazy._sources == eager._sources


def test_suffix_decoding_indexes_rows_leanly_after_drafts_missed(monkeypatch):
    """Found measuring a tiny model where sampled drafts miss: a probe after many plain
    steps indexed every row's tokens since, up to INDEX_BUDGET windows (~15 ms against a
    1.6 ms plain step at batch 32). After a verify step that took no draft, the rows share
    LEAN_ROWS_BUDGET equally, as after plain steps (a probe); after one where half the rows
    took drafts, the whole budget again."""
    from common.engine.drafting import suffix

    d = SuffixDrafter(8, 4, 24, 100, HostToDevice(torch.device("cpu")))
    placed = []
    place = d._place
    monkeypatch.setattr(d, "_place", lambda sid, end: (placed.append(sid), place(sid, end)))
    rng = random.Random(4)
    for row in range(8):
        d.set_row(row, [rng.randrange(100) for _ in range(400)])
    zeros = torch.zeros(8, dtype=torch.int32)
    d.propose(8, zeros, 4, 0)
    d.took([[1]] * 8)  # a verify step that took no draft
    for _ in range(300):  # plain steps
        d.took_one([rng.randrange(100) for _ in range(8)])
    placed.clear()
    d.propose(8, zeros, 4, 0)
    share = suffix.LEAN_ROWS_BUDGET // 8
    assert [placed.count(d._row_source[row]) for row in range(8)] == [share] * 8
    d.took([[1, 2]] * 3 + [[1]] * 5)  # three rows of eight took a draft: still lean
    placed.clear()
    d.propose(8, zeros, 4, 0)
    assert len(placed) == 8 * share
    d.took([[1, 2]] * 4 + [[1]] * 4)  # half took one
    placed.clear()
    d.propose(8, zeros, 4, 0)
    assert len(placed) > suffix.LEAN_ROWS_BUDGET  # the rows catch up at the full budget
    d.took([[1, 2]] * 8)  # all took drafts, but plain steps follow: the next is a probe
    for _ in range(300):
        d.took_one([rng.randrange(100) for _ in range(8)])
    placed.clear()
    d.propose(8, zeros, 4, 0)
    assert len(placed) == 8 * share
