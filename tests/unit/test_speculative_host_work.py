"""Speculative decoding's host work in plain steps: suffix decoding's tokens held apart
until the rows change or are read, in an array the collector does not track, and its index
of ints, finished requests indexed leanly after drafts a few rows took by chance; the draft
chooser's bucket of a batch kept while its rows are the same, its reckonings and probes;
the block allocator the offline loop (`pdserve bench spec`) makes a call, which no
collection walks."""

import gc
import random

import torch

from common.engine.drafting.suffix import SuffixDrafter
from common.engine.h2d import HostToDevice
from common.kv.blocks import BlockAllocator
from decode_node.drafts import MAX_PROBE_GAP, PROBE_SHARE, DraftChooser


def test_suffix_decodings_plain_steps_held_apart_change_nothing(monkeypatch):
    """A plain step's tokens wait in took_one until rows change, propose or take a verify
    step's tokens, or MAX_PENDING steps are held: random joins,
    leaves, plain and verify steps give the drafts and sources of taking each at once."""
    from common.engine.drafting import suffix

    monkeypatch.setattr(suffix, "MAX_PENDING", 5)
    monkeypatch.setattr(suffix, "INDEX_BUDGET", 24)  # rows caught up over several steps
    monkeypatch.setattr(suffix, "FINISHED_BUDGET", 12)
    monkeypatch.setattr(suffix, "LEAN_BUDGET", 4)
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
        elif op < 0.7:  # a plain step
            tokens = [rng.randrange(8) for _ in range(n)]
            lazy.took_one(tokens)
            eager.took([[t] for t in tokens])
            assert lazy._num_pending < suffix.MAX_PENDING
        elif op < 0.75:  # a step's tokens taken with no propose before (no verify step)
            made = [[rng.randrange(8) for _ in range(rng.randrange(1, 3))] for _ in range(n)]
            for d in (lazy, eager):
                d.took(made)
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


def test_suffix_decodings_held_tokens_leave_nothing_for_the_collector():
    """Found measuring: held as a list a step, plain steps' tokens outlived the collector's
    young generation, and collections of the older ones ran inside timed steps (at batch 1
    on a tiny model the draft chooser then verified where it did not pay, in 8 of 9 runs).
    Held in an array, 200 plain steps leave no object the collector tracks."""
    d = SuffixDrafter(4, 4, 24, 8, HostToDevice(torch.device("cpu")))
    for row in range(4):
        d.set_row(row, [row, 1, 2])
    gc.collect()
    before = len(gc.get_objects())
    for t in range(200):
        d.took_one([t, t + 1, t + 2, t + 3])  # a new list a step, as a step's .tolist()
    assert len(gc.get_objects()) - before < 100  # lists: 200 more
    d.propose(4, torch.zeros(4, dtype=torch.int32), 4, 0)  # flushed into the sources
    assert d._sources[d._row_source[2]][3:] == [t + 2 for t in range(200)]
    d.took_one([7, 7])  # NOTE: a narrower step, then a wider one: no stale column read
    d.took_one([8, 8, 8, 8])
    d.propose(4, torch.zeros(4, dtype=torch.int32), 4, 0)
    assert d._sources[d._row_source[1]][-2:] == [7, 8]
    assert d._sources[d._row_source[2]][-2:] == [201, 8]  # its last plain token, then 8


def test_suffix_decodings_index_leaves_nothing_for_the_collector():
    """Found measuring: a probe's index held each window as a tuple (and its place as
    another), thousands a probe; the collections they set off ran inside it (at batch 32
    on a tiny model, 58 collections, 37 ms, in two probes). As ints, indexing 4 rows of 600
    tokens and a finished one leaves the collector nothing new, and drafts are as before."""
    d = SuffixDrafter(4, 4, 24, 8, HostToDevice(torch.device("cpu")))
    rng = random.Random(5)
    motif = [rng.randrange(1000) for _ in range(40)]
    for row in range(4):
        d.set_row(row, [rng.randrange(1000) for _ in range(560)] + motif)
    d.propose(4, torch.zeros(4, dtype=torch.int32), 4, 0)  # the index's first growth
    d.took([[rng.randrange(1000)] for _ in range(4)])  # a verify step's tokens, a row each
    d.remove_row(3, 3)  # finished: kept in the cache
    d.set_row(3, [rng.randrange(1000) for _ in range(600)] + motif[:10])
    gc.collect()
    before = len(gc.get_objects())
    got = d.propose(4, torch.zeros(4, dtype=torch.int32), 4, 0).tolist()
    assert len(gc.get_objects()) - before < 50  # as tuples: ~4,000 more
    assert not gc.is_tracked(d._index) and len(d._index) > 2000
    assert got[3] == motif[10:14]  # the finished row's motif, where the row's suffix is


def test_a_draft_a_few_rows_of_a_large_batch_take_by_chance_keeps_indexing_lean(monkeypatch):
    """Found measuring: at batch 32 on the tiny model 8, 3, 1 and 5 rows of four probes took
    a draft by chance, and each probe after one indexed FINISHED_BUDGET finished windows
    (~4 ms of a ~12 ms probe). Drafts are taken where TAKEN_SHARE of a verify step's rows
    with drafts took one (review: a row given none has none to take)."""
    from common.engine.drafting import suffix

    placed = []

    def finished_windows_after(num_taken: int, num_drafted: int) -> int:
        """Finished windows the propose after a verify step indexes, where num_taken of
        num_drafted rows of 8 took a draft (the others had none)."""
        d = SuffixDrafter(9, 4, 24, 100, HostToDevice(torch.device("cpu")))
        place = d._place
        monkeypatch.setattr(d, "_place", lambda sid, end: (placed.append(sid), place(sid, end)))
        rng = random.Random(4)
        zeros = torch.zeros(8, dtype=torch.int32)
        motifs = [[rng.randrange(1000, 2000) for _ in range(3)] for _ in range(8)]
        for row in range(8):  # a drafted row repeats itself: its suffix is found
            unique = [rng.randrange(2000, 10**6) for _ in range(6)]
            d.set_row(row, [row] + (motifs[row] * 2 if row < num_drafted else unique))
        d.propose(8, zeros, 4, 0)
        # none taken (lean); a drafted row goes on repeating, the others do not
        unique = [rng.randrange(10**6, 2 * 10**6) for _ in range(8)]
        d.took([[motifs[row][0] if row < num_drafted else unique[row]] for row in range(8)])
        for _ in range(4):  # then requests finish on row 8, 300 windows each to index
            d.set_row(8, [rng.randrange(1000) for _ in range(300)])
            d.remove_row(8, 8)
        drafts = d.propose(8, zeros, 4, 0).tolist()
        assert sum(row[0] >= 0 for row in drafts) == num_drafted
        made = [drafts[row][: 2 if row < num_taken else 1] for row in range(num_drafted)]
        d.took(made + [[7]] * (8 - num_drafted), num_drafted)
        placed.clear()
        d.propose(8, zeros, 4, 0)
        return sum(sid in d._finished for sid in placed)

    assert finished_windows_after(1, 8) == suffix.LEAN_BUDGET  # any row: FINISHED_BUDGET
    assert finished_windows_after(2, 8) > suffix.LEAN_BUDGET  # a quarter
    assert finished_windows_after(1, 2) > suffix.LEAN_BUDGET  # of 2 rows with drafts: half


def test_a_try_that_finds_no_draft_indexes_leanly_after_it(monkeypatch):
    """A verify step's rows took their drafts; then the load's drafts stop matching, and
    each try finds none and runs plain (proposed_none). The tries after it index finished
    requests as after a verify step that took none: LEAN_BUDGET windows, not FINISHED_BUDGET
    (it kept the last verify step's verdict)."""
    from common.engine.drafting import suffix

    def finished_windows_after(is_told: bool) -> int:
        d = SuffixDrafter(9, 4, 24, 100, HostToDevice(torch.device("cpu")))
        placed = []
        place = d._place
        monkeypatch.setattr(d, "_place", lambda sid, end: (placed.append(sid), place(sid, end)))
        rng = random.Random(5)
        zeros = torch.zeros(8, dtype=torch.int32)
        motifs = [[rng.randrange(1000, 2000) for _ in range(3)] for _ in range(8)]
        for row in range(8):
            d.set_row(row, [row] + motifs[row] * 2)
        drafts = d.propose(8, zeros, 4, 0).tolist()
        d.took([drafts[row][:2] for row in range(8)])  # every row took one: taken
        d.propose(8, zeros, 4, 0)  # a try (its drafts, whatever they are, not verified)
        if is_told:
            d.proposed_none()
        d.took_one([rng.randrange(10**6, 2 * 10**6) for _ in range(8)])
        for _ in range(4):  # requests finish on row 8, 300 windows each to index
            d.set_row(8, [rng.randrange(1000) for _ in range(300)])
            d.remove_row(8, 8)
        placed.clear()
        d.propose(8, zeros, 4, 0)
        return sum(sid in d._finished for sid in placed)

    assert finished_windows_after(is_told=False) > suffix.LEAN_BUDGET
    assert finished_windows_after(is_told=True) == suffix.LEAN_BUDGET


def _step(chooser: DraftChooser, keys: list[str], cost_of_one: float) -> int:
    """One decode step on a fake clock, as the node asks (drafts never matching, a verify
    step of one draft costing cost_of_one plain steps); -> its k."""
    k = 0 if chooser.is_resting(keys) else chooser.choose(keys, 4)
    chooser.observe(keys, k, 1.0 + (cost_of_one - 1.0) * k, [0] * len(keys))
    return k


def _probes(cost_of_one: float, num_steps: int, num_rows: int) -> list[int]:
    """The steps that verified, in num_steps over num_rows rows."""
    chooser, keys = DraftChooser(4), [f"r{i}" for i in range(num_rows)]
    return [step for step in range(num_steps) if _step(chooser, keys, cost_of_one)]


def test_dear_probes_wait_for_their_share_and_cheap_ones_stop_doubling_at_the_cap():
    """A probe at batch 32 on the tiny model cost 13-20x a plain step (indexing the rows'
    tokens since the last one): its gap keeps it within PROBE_SHARE past 1,024 steps, the
    cap once. Found in review: the higher cap let cheap probes' gaps double to 4,096 too,
    and drafts that began to match waited up to ~4,000 steps for one."""
    dear = _probes(20.0, 12_000, 1)
    assert all(b - a > 19.0 / PROBE_SHARE for a, b in zip(dear[2:], dear[3:]))
    assert len(dear) >= 4 and 19.0 * len(dear[2:]) / (12_000 - dear[1]) <= 0.012
    cheap = _probes(1.1, 12_000, 4)
    gaps = [b - a for a, b in zip(cheap, cheap[1:])]
    assert gaps[-3:] == [MAX_PROBE_GAP + 1] * 3  # doubled to the cap, no further


def test_a_dear_sizes_long_probe_gap_is_not_a_cheap_sizes_of_the_same_kind():
    """Found in review: a failed probe stored its size's floor as the kind's next gap, so a
    cheap size of the same kind (a batch of 4, verify steps 1.1x) waited a dear one's
    ~1,900 steps (a batch of 32, 20x) for its next probe. Each size's own floor applies."""
    chooser = DraftChooser(4)
    four, many = [f"r{i}" for i in range(4)], [f"r{i}" for i in range(32)]

    # its gaps at the cap, then a probe
    while not _step(chooser, four, 1.1) or chooser.num_probes < 9:
        pass
    for _ in range(5000):  # the dear size's turn: probes ~1,900 steps apart
        _step(chooser, many, 20.0)
    waited = next(i for i in range(1, 5000) if _step(chooser, four, 1.1))
    assert waited <= MAX_PROBE_GAP + 1


def test_the_chooser_keeps_a_batchs_bucket_until_a_row_joins_or_leaves():
    """The bucket (batch size and kind) is kept for the same keys; a row that joins or
    leaves clears it, each on its own (a kept bucket would time a sampled batch's steps
    with greedy ones')."""
    chooser = DraftChooser(4)
    keys = ["a", "b", "c"]
    for key in keys:
        chooser.join(key, is_sampled=False)
    assert chooser._bucket(keys) == (4, (False, False))
    chooser._sampled.add("a")  # behind its back: the kept bucket answers
    assert chooser._bucket(list(keys)) == (4, (False, False))
    chooser._sampled.discard("a")
    chooser.join("b", is_sampled=True)  # a join alone
    assert chooser._bucket(keys) == (4, (True, False))
    chooser.forget("b")  # a leave alone
    assert chooser._bucket(keys) == (4, (False, False))
    chooser.join("c", is_sampled=False, is_costly=True)
    assert chooser._bucket(keys) == (4, (False, True))
    keys.pop()  # NOTE: the caller's list changed in place: not the kept copy
    keys.pop()
    assert chooser._bucket(keys) == (1, (False, False))


def test_a_resting_batch_is_reckoned_once_in_32_plain_steps(monkeypatch):
    """Timed in `pdserve bench spec`'s loop at batch 32 on the tiny model: a reckoning
    (choose, and the rows' room asked first) cost ~75 us, cold after a forward; one every 8
    plain steps was ~0.7% of the steps' time. While plain steps win and no row joins or
    leaves, one in 32 (and each probe's)."""
    from decode_node import drafts

    chooser, keys = DraftChooser(4), [f"r{i}" for i in range(32)]
    reckoned = []
    real = drafts._expected_tokens
    monkeypatch.setattr(
        drafts, "_expected_tokens", lambda ps, ks: reckoned.append(1) or real(ps, ks)
    )
    asked = 0
    for _ in range(2000):  # drafts that never match, a verify step 3x a plain one
        k = 0
        if not chooser.is_resting(keys):
            asked += 1
            k = chooser.choose(keys, 4)
        chooser.observe(keys, k, 1.0 + 2.0 * k, [0] * len(keys))
    assert chooser.num_probes >= 2 and len(reckoned) <= asked
    assert asked <= 2000 / 32 + 2 * chooser.num_probes + 4  # at 8: ~250


def test_a_block_allocator_made_after_the_start_gives_the_collector_nothing_to_walk():
    """Found measuring: `pdserve bench spec` makes an allocator a run (the offline loop);
    its free list of 262,144 ids (a 2 GiB cache of the tiny model) was a list each young
    collection walked whole, ~5 ms inside whichever side's step set it off. As arrays,
    nothing to walk; blocks are handed out and counted as before."""
    alloc = BlockAllocator(1 << 18)
    # what a collection visits through each (as lists: 262,144 items each)
    assert len(gc.get_referents(alloc._free)) + len(gc.get_referents(alloc._refs)) < 4
    ids = alloc.allocate(3)
    assert ids == [1, 2, 3] and all(type(b) is int for b in ids)  # low ids first, as before
    alloc.share(ids[:1])
    alloc.free(ids)
    assert alloc.num_holders(1) == 1 and alloc.num_free == (1 << 18) - 2
    alloc.free([1])
    assert alloc.num_free == (1 << 18) - 1 and alloc.allocate(1) == [1]
