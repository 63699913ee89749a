"""Speculative decoding's host work in plain steps: suffix decoding's tokens held apart
until the rows change or are read; the draft chooser's bucket of a batch kept while its
rows are the same."""

import random

import torch

from common.engine.drafting.suffix import SuffixDrafter
from common.engine.h2d import HostToDevice
from decode_node.drafts import DraftChooser


def test_suffix_decodings_plain_steps_held_apart_change_nothing(monkeypatch):
    """A plain step's tokens wait in took_one until rows change or propose: random joins,
    leaves, plain and verify steps give the drafts and sources of taking each at once."""
    from common.engine.drafting import suffix

    monkeypatch.setattr(suffix, "MAX_PENDING", 5)
    monkeypatch.setattr(suffix, "INDEX_BUDGET", 24)  # rows caught up over several steps
    cpu = HostToDevice(torch.device("cpu"))
    lazy, eager = SuffixDrafter(6, 4, 24, 3, cpu), SuffixDrafter(6, 4, 24, 3, cpu)
    rng = random.Random(3)
    n = 0
    for _ in range(600):
        op = rng.random()
        if n < 6 and (op < 0.1 or not n):
            ids = [rng.randrange(8) for _ in range(rng.randrange(1, 60))]
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


def test_the_chooser_keeps_a_batchs_bucket_until_a_row_joins_or_leaves():
    """The bucket (batch size and kind) is kept for the same keys; a row that leaves and
    joins again as a sampled one changes the kind (a kept bucket would time its steps
    with the greedy ones')."""
    chooser = DraftChooser(4)
    keys = ["a", "b", "c"]
    for key in keys:
        chooser.join(key, is_sampled=False)
    assert chooser._bucket(keys) == (4, (False, False))
    assert chooser._bucket(list(keys)) == (4, (False, False))  # an equal list: kept
    chooser.forget("b")
    chooser.join("b", is_sampled=True)
    assert chooser._bucket(keys) == (4, (True, False))
    chooser.forget("c")
    chooser.join("c", is_sampled=False, is_costly=True)
    assert chooser._bucket(keys) == (4, (True, True))
    keys.append("d")  # NOTE: the caller's list changed in place: not the kept copy
    assert chooser._bucket(keys) == (4, (True, True)) and chooser._last[0] == keys
    assert chooser._bucket(keys[:1]) == (1, (False, False))
