"""Speculative decoding in the decode batch: the config, prompt lookup's drafts, and verify
steps whose tokens are those of plain decoding, token for token."""

import importlib
import json
import os
import random
import shutil

import pytest
import torch

from common.base.config import WorkerConfig
from common.base.request import SamplingParams
from common.base.speculative import SpeculativeConfig, parse_speculative
from common.engine.drafting.ngram import NgramDrafter
from common.engine.drafting.suffix import SuffixDrafter
from common.engine.h2d import HostToDevice
from common.engine.platform_cpu import CpuPlatform
from common.engine.worker import DeviceWorker, PrefillChunk
from kernels import portable
from launch.tools.offline import generate
from tests.conftest import hf_greedy

NGRAM = SpeculativeConfig("ngram", 4)


def _worker(model, spec=NGRAM, **kw):
    return DeviceWorker(
        WorkerConfig(model=str(model), kv_cache_memory=8 * 2**20, speculative=spec, **kw)
    )


def test_the_config_takes_vllms_spelling_and_names_what_is_wrong():
    assert parse_speculative("off") == SpeculativeConfig("off")
    assert not parse_speculative("off").is_on
    got = parse_speculative('{"method": "ngram", "num_speculative_tokens": 5}')
    assert got == SpeculativeConfig("ngram", 5) and got.is_on
    got = parse_speculative(
        '{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 32}'
    )
    assert got == SpeculativeConfig("suffix", 8, suffix_decoding_max_tree_depth=32)
    for text, match in [
        ("{", "neither 'off' nor JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle'"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', r"in \[1, 16\]"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', r"in \[1, 16\]"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "wrong type"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unknown fields"),
        (
            '{"method": "suffix", "num_speculative_tokens": 2, '
            '"suffix_decoding_max_tree_depth": 1}',
            "max_tree_depth",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min <= prompt_lookup_max",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_speculative(text)


def test_auto_is_prompt_lookup_on_a_cpu_decode_node_and_off_elsewhere():
    auto = SpeculativeConfig()
    assert auto == parse_speculative("auto") and auto.method == "auto"
    assert not auto.is_on  # a worker given auto drafts nothing: a decode node decides
    assert auto.for_decode_node(is_host=True) == SpeculativeConfig("ngram", 4)
    assert auto.for_decode_node(is_host=False) == SpeculativeConfig("off")
    # where a matmul's row may round apart alone and among others, a verify step's tokens
    # could differ from plain decoding's
    assert auto.for_decode_node(is_host=True, is_row_exact=False) == SpeculativeConfig("off")
    ngram = SpeculativeConfig("ngram", 4)
    assert ngram.for_decode_node(is_host=True, is_row_exact=False) is ngram  # asked: it runs
    # bench spec in bf16 on a CPU, with bf16 units and without, saw tokens differ
    assert CpuPlatform.is_row_exact(torch.float32)
    assert not CpuPlatform.is_row_exact(torch.bfloat16)
    suffix = SpeculativeConfig("suffix", 2)
    assert suffix.for_decode_node(is_host=False) is suffix  # asked for: kept everywhere
    off = parse_speculative("off")
    assert off.for_decode_node(is_host=True) == off and not off.is_on
    assert parse_speculative("") == auto  # the launcher's value where the flag is not given
    for method in ("auto", "off"):  # a field beside either would be dropped: refused
        with pytest.raises(ValueError, match="num_speculative_tokens: needs a method"):
            SpeculativeConfig(method, 3)
        with pytest.raises(ValueError, match="prompt_lookup_min: needs a method"):
            parse_speculative(f'{{"method": "{method}", "prompt_lookup_min": 0}}')


def _lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by hand: the longest suffix (max_n down to min_n) found earlier, ending
    before the last token; its latest place; the k tokens after it, those to the row's end
    repeated past it."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if length < n + 1:
            continue
        suffix = tokens[length - n :]
        starts = [p for p in range(length - n) if tokens[p : p + n] == suffix]
        if starts:
            start = starts[-1] + n  # what followed, repeated past the row's end
            return [tokens[start + i % (length - start)] for i in range(k)]
    return [-1] * k


def test_prompt_lookup_proposes_what_the_hand_lookup_does():
    rng = random.Random(3)
    max_len, k = 64, 4
    d = NgramDrafter(8, max_len, k, 1, 3, HostToDevice(torch.device("cpu")))
    rows = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(8)]
    rows[0] = [7]  # nothing before its only token
    rows[1] = [1, 2, 3, 9, 1, 2, 3]  # the 3-gram beats the later 1-gram
    for i, r in enumerate(rows):
        d.set_row(i, r)
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    got = d.propose(8, lens, k, max(len(r) for r in rows)).tolist()
    assert got == [_lookup(r, k, 1, 3) for r in rows]
    assert got[1] == [9, 1, 2, 3] and got[0] == [-1] * k
    # A verify step's tokens land after each row's length; a moved row takes its tokens.
    made = torch.tensor([[5, 6, 7, 8, 9]] * 8)
    d.append(8, lens, made)
    d.remove_row(0, 1)
    lens2 = lens + 2  # two of the five accepted: the rest lies past the length
    lens2[0] = lens2[1]
    rows2 = [r + [5, 6] for r in rows]
    rows2[0] = rows2[1]
    got = d.propose(8, lens2, k, int(lens2.max())).tolist()
    assert got == [_lookup(r, k, 1, 3) for r in rows2]


@pytest.mark.parametrize("backend", ["portable", "cpu"])
def test_each_prompt_lookup_op_proposes_what_the_hand_lookup_does(backend, monkeypatch):
    """kernels.prompt_lookup's portable op (CUDA, NPU) and the CPU's C op alike, over rows
    of a few distinct tokens (many matches), in a buffer wider than the lengths (the
    drafter's width is its rows' longest: kernels/cpu_rows.c clamps a length past it)."""
    if backend == "cpu" and not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    ops = importlib.import_module(f"kernels.{backend}")
    if backend == "cpu":  # the C op itself, never the portable one it falls back to
        monkeypatch.setattr(portable, "prompt_lookup", None)
    rng = random.Random(5)
    for k, (min_n, max_n) in ((4, (1, 3)), (7, (2, 5)), (1, (1, 1))):
        rows = [[rng.randrange(3) for _ in range(rng.randrange(1, 48))] for _ in range(16)]
        tokens = torch.randint(0, 3, (16, 64), dtype=torch.int32)  # past a row: anything
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
        lens = torch.tensor([len(r) for r in rows], dtype=torch.int32)
        width = int(lens.max())
        got = ops.prompt_lookup(tokens, lens, k, min_n, max_n, width).tolist()
        assert got == [_lookup(r, k, min_n, max_n) for r in rows]


def test_drafts_from_a_loop_carry_on_round_it_past_the_rows_end():
    cpu = HostToDevice(torch.device("cpu"))
    rows = [[4, 4, 4], [9, 1, 2, 1, 2], [5, 6, 7, 8, 5, 6, 7, 8, 5]]
    want = [[4, 4, 4, 4], [1, 2, 1, 2], [6, 7, 8, 5]]
    ngram = NgramDrafter(3, 16, 4, 1, 3, cpu)
    suffix = SuffixDrafter(3, 4, 24, 0, cpu)
    for i, r in enumerate(rows):
        ngram.set_row(i, r)
        suffix.set_row(i, r)
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    assert ngram.propose(3, lens, 4, 9).tolist() == want
    # Suffix decoding drafts at most as many as its match is long: [4, 4] and [1, 2] are
    # 2-matches, [8, 5] is found as a 4-match.
    assert suffix.propose(3, lens, 4, 0).tolist() == [[4, 4, -1, -1], [1, 2, -1, -1], want[2]]


def test_suffix_decoding_drafts_from_its_own_tokens_and_finished_requests():
    cpu = HostToDevice(torch.device("cpu"))
    d = SuffixDrafter(4, 4, 24, 1, cpu)

    def propose(n):
        return d.propose(n, torch.zeros(n, dtype=torch.int32), 4, 0).tolist()

    d.set_row(0, [5, 6, 7, 8, 5, 6])  # its own earlier [5, 6]: then 7, 8 (two: a 2-match)
    d.set_row(1, [1, 2, 3, 4, 50, 60, 70])
    d.set_row(2, [40, 41])  # found nowhere
    assert propose(3) == [[7, 8, -1, -1], [-1] * 4, [-1] * 4]
    d.remove_row(1, 2)  # row 1 finishes (cached); row 2 moves into it
    d.set_row(2, [9, 3, 4])
    d.set_row(3, [1, 2, 3, 4])
    assert propose(4)[2:] == [[50, 60, -1, -1], [50, 60, 70, -1]]  # the finished one's
    d.took([[7], [42], [50], [9]])  # each row's new token
    got = propose(4)
    assert got[0] == [8, 5, -1, -1] and got[2] == [60, 70, -1, -1]
    d.remove_row(0, 3)  # a second finished request pushes the first out (max_cached=1)
    assert d.num_cached == 1
    got = propose(3)
    assert got[2] == [-1] * 4  # [4, 50] was the first finished request's alone
    assert got[0] == [3, -1, -1, -1]  # the moved row: [..., 9] as in row 2's [9, 3, ...]


def test_suffix_decodings_index_is_bounded_by_tokens(monkeypatch):
    """Found in review: the cache was bounded by requests alone, at ~1 KB a token."""
    from common.engine.drafting import suffix

    monkeypatch.setattr(suffix, "MAX_INDEXED", 64)
    monkeypatch.setattr(suffix, "MAX_CACHED_TOKENS", 256)
    d = SuffixDrafter(2, 4, 24, 1000, HostToDevice(torch.device("cpu")))
    rng = random.Random(1)
    for _ in range(20):  # long requests, each finishing
        d.set_row(0, [rng.randrange(50) for _ in range(300)])
        d.took([[rng.randrange(50)] for _ in range(1)])
        d.remove_row(0, 0)
        assert d._num_cached_tokens <= 256 and len(d._index) <= 256 * len(d.lengths)
    assert all(len(t) <= 64 + 32 for t in d._sources.values())  # the indexed tokens alone
    d.set_row(0, [1, 2, 3])
    for _ in range(500):  # a live row's long output: its oldest windows leave
        d.took([[rng.randrange(50)]])
        d.propose(1, torch.zeros(1, dtype=torch.int32), 4, 0)
    first, end = d._indexed[d._row_source[0]]
    assert end - first <= 64 and len(d._index) <= (256 + 64) * len(d.lengths)
    empty = SuffixDrafter(1, 4, 24, 0, HostToDevice(torch.device("cpu")))  # no cache
    empty.set_row(0, list(range(100)))
    empty.propose(1, torch.zeros(1, dtype=torch.int32), 4, 0)
    empty.remove_row(0, 0)
    assert not empty._index and not empty._sources


def test_suffix_decodings_cache_counts_what_a_lagging_row_holds(monkeypatch):
    """Found in review: a row that ran plain steps after a first verify step kept nearly all
    its tokens when it finished (its indexed windows lag) but counted only those indexed."""
    from common.engine.drafting import suffix

    monkeypatch.setattr(suffix, "MAX_CACHED_TOKENS", 4096)
    d = SuffixDrafter(1, 4, 24, 1000, HostToDevice(torch.device("cpu")))
    for i in range(6):
        d.set_row(0, [i] * 2000)
        d.propose(1, torch.zeros(1, dtype=torch.int32), 4, 0)
        d.took([list(range(3000))])
        d.remove_row(0, 0)
        held = sum(len(t) for t in d._sources.values())
        assert held == d._num_cached_tokens <= 4096


def test_suffix_decodings_sliding_index_keeps_repeats_inside_it(monkeypatch):
    """Found in review: a window sliding out deleted a key a later place inside still held."""
    from common.engine.drafting import suffix

    monkeypatch.setattr(suffix, "MAX_INDEXED", 64)
    rng = random.Random(0)
    motif = [7, 8, 9, 10, 11]
    tokens = [rng.randrange(100, 200) for _ in range(10)] + motif
    tokens += [rng.randrange(100, 200) for _ in range(40)] + motif
    tokens += [rng.randrange(100, 200) for _ in range(40)]
    d = SuffixDrafter(1, 4, 24, 4, HostToDevice(torch.device("cpu")))
    d.set_row(0, tokens[:1])
    for t in tokens[1:]:  # a token a step, each a verify step
        d.took([[t]])
        d.propose(1, torch.zeros(1, dtype=torch.int32), 4, 0)
    first, end = d._indexed[0]
    assert first > 12 and first <= 57  # the first motif's windows out, the second's in
    assert d._index[hash((7, 8))] == 57 and d._index[hash((7, 8, 9, 10))] == 59  # source 0


def test_suffix_decoding_indexes_a_bounded_number_of_windows_a_step(monkeypatch):
    """Found in review: a row back from a long rest was indexed whole in one step."""
    from common.engine.drafting import suffix

    monkeypatch.setattr(suffix, "INDEX_BUDGET", 100)
    placed = []
    d = SuffixDrafter(4, 4, 24, 4, HostToDevice(torch.device("cpu")))
    monkeypatch.setattr(d, "_place", lambda *a: placed.append(a))
    for row in range(4):
        d.set_row(row, list(range(row, row + 3000)))
    d.propose(4, torch.zeros(4, dtype=torch.int32), 4, 0)
    assert len(placed) == 100
    for _ in range(50):
        d.propose(4, torch.zeros(4, dtype=torch.int32), 4, 0)
    assert len(placed) == 4 * suffix.MAX_INDEXED  # each row's window, whole at last


def test_suffix_decoding_indexes_finished_requests_leanly_while_drafts_miss(monkeypatch):
    """Found measuring a tiny model where drafts never match: each finished request's
    windows were indexed as it left (~0.8 ms a request, 2-16% of TPOT). Finishing indexes
    nothing now; the steps that propose index finished requests, newest first: LEAN_BUDGET
    windows a step after a verify step that took no draft, FINISHED_BUDGET after one that
    took some."""
    from common.engine.drafting import suffix

    d = SuffixDrafter(2, 4, 24, 100, HostToDevice(torch.device("cpu")))
    placed = []
    place = d._place
    monkeypatch.setattr(d, "_place", lambda sid, end: (placed.append(sid), place(sid, end)))
    zeros = torch.zeros(1, dtype=torch.int32)
    d.set_row(0, [1, 2, 3])
    d.propose(1, zeros, 4, 0)
    d.took([[5]])  # a verify step whose row took no draft
    rng = random.Random(2)
    finished = [[rng.randrange(1000, 2000) for _ in range(200)] for _ in range(6)]
    for tokens in finished:  # six requests finish on row 1
        d.set_row(1, tokens)
        d.remove_row(1, 1)
    placed.clear()
    d.set_row(1, finished[-1][:50])  # asks what the newest finished one was asked
    got = d.propose(2, torch.zeros(2, dtype=torch.int32), 4, 0).tolist()
    newest = max(d._finished)
    assert placed.count(newest) == suffix.LEAN_BUDGET  # the others: the live rows'
    assert set(placed) <= {newest, *d._row_source}
    assert got[1] == finished[-1][50:54]  # its windows, found
    d.took([[7], finished[-1][50:55]])  # row 1 took its drafts
    placed.clear()
    d.propose(2, torch.zeros(2, dtype=torch.int32), 4, 0)
    assert len(placed) > suffix.LEAN_BUDGET and not d._unindexed  # the rest, in one step
    assert set(d._finished) <= set(placed)  # each finished one


def test_suffix_decodings_finished_requests_take_no_more_than_the_steps_budget(monkeypatch):
    """Review: FINISHED_BUDGET is fixed at import; a step's budget set lower must still bound
    the windows a step indexes, finished requests' and rows' together."""
    from common.engine.drafting import suffix

    monkeypatch.setattr(suffix, "INDEX_BUDGET", 100)
    d = SuffixDrafter(2, 4, 24, 100, HostToDevice(torch.device("cpu")))
    placed = []
    place = d._place
    monkeypatch.setattr(d, "_place", lambda sid, end: (placed.append(sid), place(sid, end)))
    for i in range(4):  # finished requests with 300 windows each, none indexed
        d.set_row(1, list(range(i * 1000, i * 1000 + 300)))
        d.remove_row(1, 1)
    d.set_row(0, list(range(50_000, 50_400)))
    d.propose(1, torch.zeros(1, dtype=torch.int32), 4, 0)  # the first: FINISHED_BUDGET asked
    assert len(placed) == 100 and d._budget == 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_verify_steps_make_plain_decodings_tokens_and_accept_drafts(tiny_model, method):
    """Prompts that repeat, so prompt lookup proposes from the first step; rows of several
    lengths leave at different steps. fp32 against transformers' own Qwen3."""
    prompts = [[5, 6, 7, 8, 9] * 6, [3, 4, 5], [11, 12, 13, 14] * 3 + [11]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 30, 25)]
    with _worker(tiny_model, spec=SpeculativeConfig("off")) as worker:
        plain = generate(worker, prompts, params)
    with _worker(tiny_model, spec=SpeculativeConfig(method, 4)) as worker:
        spec = generate(worker, prompts, params)
        stats = worker.decode.stats()
        # Asked again: suffix decoding drafts from the first answers, all of them right.
        again = generate(worker, prompts, params)
        v = worker.decode.verifier
        num_accepted = v.num_accepted - stats["num_accepted_tokens"]
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in plain]
    for prompt, p, r in zip(prompts, params, spec):
        assert r["token_ids"] == hf_greedy(tiny_model, [prompt], p.max_tokens)[0]
    assert stats["num_verify_steps"] > 0 and stats["num_drafted_tokens"] > 0
    if method == "suffix":
        assert num_accepted >= sum(p.max_tokens for p in params) // 2


class _Oracle:
    """A drafter that knows each sequence's plain decoding: it proposes the next k tokens
    of it, every `wrong_every`th of them changed."""

    history = None  # it keeps no tokens on the device

    def __init__(self, sequences: list[list[int]], wrong_every: int = 0):
        self.sequences = sequences
        self.wrong_every = wrong_every
        self.rows: dict[int, list[int]] = {}
        self.num_drafted_rows: list[int | None] = []  # what each verify step told took()
        self.num_proposed_none = 0

    def set_row(self, row, token_ids):
        self.rows[row] = next(s for s in self.sequences if s[: len(token_ids)] == token_ids)

    def remove_row(self, row, last):
        self.rows[row] = self.rows[last]

    def propose(self, n, seq_lens, k, width):
        drafts = []
        for row, length in enumerate(seq_lens.tolist()):
            after = self.rows[row][length : length + k]
            after += [-1] * (k - len(after))
            if self.wrong_every:
                after = [
                    (t - 1 if t else 1) if (length + j) % self.wrong_every == 0 else t
                    for j, t in enumerate(after)
                ]
            drafts.append(after)
        return torch.tensor(drafts, dtype=torch.int64)

    def append(self, n, seq_lens, tokens):
        pass

    def took(self, tokens, num_drafted_rows=None):
        self.num_drafted_rows.append(num_drafted_rows)

    def took_one(self, tokens):
        pass

    def proposed_none(self):
        self.num_proposed_none += 1


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_drafts_that_are_right_are_all_accepted_and_a_wrong_one_cuts_the_run(tiny_model, sampled):
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44]]
    temp = dict(temperature=0.9, top_p=0.95, seed=8) if sampled else {}
    params = [SamplingParams(max_tokens=21, ignore_eos=True, **temp) for _ in prompts]
    with _worker(tiny_model, spec=SpeculativeConfig("off")) as worker:
        plain = [p + r["token_ids"] for p, r in zip(prompts, generate(worker, prompts, params))]
    with _worker(tiny_model, block_size=128) as worker:
        worker.decode.verifier.drafter = _Oracle(plain)
        before = worker.h2d.num_writes
        got = generate(worker, prompts, params)
        v = worker.decode.verifier
        # Each step makes 5 tokens a row: 20 after the first in 4 steps, 16 drafts accepted.
        assert (v.num_steps, v.num_accepted, v.num_drafted) == (4, 2 * 16, 2 * 16)
        stats = v.stats()
        assert stats["num_drafts"] == 2 * 4 and stats["num_accepted_per_pos"] == [8, 8, 8, 8]
        assert stats["mean_accepted_len"] == 5.0
        assert [p + r["token_ids"] for p, r in zip(prompts, got)] == plain
        spec_writes = worker.h2d.num_writes - before
    with _worker(tiny_model) as worker:
        worker.decode.verifier.drafter = _Oracle(plain, wrong_every=3)
        got = generate(worker, prompts, params)
        v = worker.decode.verifier
        assert [p + r["token_ids"] for p, r in zip(prompts, got)] == plain
        assert 0 < v.num_accepted < v.num_drafted and v.num_steps > 4
        by_pos = v.stats()["num_accepted_per_pos"]
        assert sum(by_pos) == v.num_accepted and by_pos == sorted(by_pos, reverse=True)
        assert by_pos[0] > by_pos[-1]  # a wrong draft cuts the run: later places less often
    # The same host-to-device writes as plain decoding in one block (prefill and joins): a
    # verify step adds none, though its rows advance by counts only the device knows.
    with _worker(tiny_model, spec=SpeculativeConfig("off"), block_size=128) as worker:
        before = worker.h2d.num_writes
        generate(worker, prompts, params)
        assert spec_writes == worker.h2d.num_writes - before


def test_a_request_that_opts_out_is_verified_with_no_drafts(tiny_model):
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44]]
    params = [
        SamplingParams(max_tokens=21, ignore_eos=True),
        SamplingParams(max_tokens=21, ignore_eos=True, no_drafts=True),
    ]
    with _worker(tiny_model, spec=SpeculativeConfig("off")) as worker:
        plain = [p + r["token_ids"] for p, r in zip(prompts, generate(worker, prompts, params))]
    with _worker(tiny_model) as worker:
        worker.decode.verifier.drafter = _Oracle(plain)
        got = generate(worker, prompts, params)
        v = worker.decode.verifier
        assert [p + r["token_ids"] for p, r in zip(prompts, got)] == plain
        # the first row's drafts, all right; none of the second's
        assert v.num_drafted == v.num_accepted == 16  # 4 steps of 4, then the second alone
        # the drafter hears of one row with drafts a step (its share of rows that took one)
        told = v.drafter.num_drafted_rows
        assert told[:4] == [1] * 4 and set(told[4:]) <= {0}


def test_prompt_lookups_rows_hold_every_token_plain_steps_and_verify_steps_alike(tiny_model):
    """The drafter's rows are written on the device by every step; a row that leaves is
    filled by the last, its tokens with it."""
    prompts = [[5, 6, 7] * 4, [9, 8] * 3, [1, 2, 3, 4]]
    p = SamplingParams(max_tokens=40, ignore_eos=True)
    with _worker(tiny_model, block_size=128) as worker:
        d, rows = worker.decode, {}
        for key, prompt in zip("abc", prompts):
            (first,), _ = worker.prefill([PrefillChunk(prompt, 0, [1 + "abc".index(key)], p)])
            d.add(key, first, len(prompt), [1 + "abc".index(key)], p, token_ids=prompt + [first])
            rows[key] = prompt + [first]
        for k in (0, 0, 3, 0, 2, 2, 0):
            ticket = d.launch(k)
            for key, made in zip(ticket.keys, d.collect_many(ticket)):
                rows[key] += made
            if k == 3:
                d.remove("a")  # row 0 leaves: row 2 ("c") moves into it
        for row, key in enumerate(d.keys()):
            n = len(rows[key])
            assert d.verifier.drafter.tokens[row, :n].tolist() == rows[key]
            assert int(d.host_seq_lens[row]) == n


def test_the_benchmark_sets_speculation_against_plain_decoding_in_one_run(tiny_model, capsys):
    from launch.bench import spec

    argv = ["--model", str(tiny_model), "--batch-sizes", "1,2", "--prompt-len", "12"]
    assert spec.main([*argv, "--output-len", "10", "--kv-cache-memory", "16MiB"]) == 0
    out = capsys.readouterr()
    records = [json.loads(line) for line in out.out.splitlines()]
    loads = ("fresh", "repeat", "sampled")
    got = [(r["batch_size"], r["load"]) for r in records]
    assert got == [(b, x) for b in (1, 2) for x in loads]
    for r in records:
        assert r["is_identical"] and r["device"] == "cpu" and r["baseline_tokens_per_s"] > 0
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["baseline_tokens_per_s"], 1e-2)
        ratio = r["tpot_p50_ms"] / r["baseline_tpot_p50_ms"]
        assert r["tpot_ratio"] == pytest.approx(ratio, 1e-2)
    # The sampled load has a baseline of its own: other prompts, other tokens.
    assert records[2]["baseline_tokens_per_s"] != records[0]["baseline_tokens_per_s"]
    assert "TPOT p50" in out.err and "NO" not in out.err
    assert spec.main([*argv, "--speculative-config", "off"]) == 2
    assert spec.main([*argv, "--loads", "fresh,edit"]) == 2
    assert spec.main([*argv, "--output-len", "4", "--loads", "sampled"]) == 0
    assert [json.loads(x)["load"] for x in capsys.readouterr().out.splitlines()] == ["sampled"] * 2
    # auto: what a decode node on this device runs (a CPU: prompt lookup of 4 drafts)
    auto = ["--output-len", "4", "--loads", "sampled", "--speculative-config", "auto"]
    assert spec.main([*argv, *auto]) == 0
    configs = [json.loads(x)["speculative_config"] for x in capsys.readouterr().out.splitlines()]
    assert [(c["method"], c["num_speculative_tokens"]) for c in configs] == [("ngram", 4)] * 2
    # auto is off in bf16 (a row's logits round apart alone and among others): said, no run
    assert spec.main([*argv, *auto, "--dtype", "bfloat16"]) == 2
    assert "auto is off on cpu in bfloat16" in capsys.readouterr().err
    # the largest batch's KV is checked before any batch runs
    assert spec.main([*argv, "--batch-sizes", "1,64", "--kv-cache-memory", "1MiB"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "batch 64 needs" in out.err


def test_drafts_that_cross_several_blocks_in_one_step_are_written_whole(tiny_model):
    """Found in review: the block table staged one new block a row per launch; a verify step
    of k drafts can take ceil((k + 1) / block_size) + 1."""
    prompts, p = [[5, 6, 7, 8, 9] * 3] * 2, SamplingParams(max_tokens=30, ignore_eos=True)
    small = dict(block_size=2, max_batch_size=2)  # NOTE: staging then holds 2 entries a row
    with _worker(tiny_model, spec=SpeculativeConfig("off"), **small) as worker:
        plain = generate(worker, prompts, [p, p])
    with _worker(tiny_model, spec=SpeculativeConfig("ngram", 8), **small) as worker:
        got = generate(worker, prompts, [p, p])
        assert worker.decode.stats()["num_verify_steps"] > 0
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in plain]


def test_metrics_give_each_nodes_draft_counts_and_accepted_by_position():
    """/metrics' spec_decode families from decode nodes' stats: counts under vLLM's names,
    accepted tokens by their place in the draft; a node whose figures do not parse (or that
    does not speculate) is left out."""
    from types import SimpleNamespace

    from frontend.metrics import _spec_decode_families

    stats = {"num_drafts": 5, "num_drafted_tokens": 12, "num_accepted_tokens": 7}
    nodes = {
        "decode-0": SimpleNamespace(stats={**stats, "num_accepted_per_pos": [4, 2, 1]}),
        "decode-1": SimpleNamespace(stats={**stats, "num_drafts": "x"}),
        "prefill-0": SimpleNamespace(stats={}),
    }
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in _spec_decode_families(nodes)
        for s in family.samples
    }
    node = (("node", "decode-0"),)
    assert got[("pdserve_spec_decode_num_draft_tokens_total", node)] == 12
    assert got[("pdserve_spec_decode_num_accepted_tokens_total", node)] == 7
    by_pos = {
        dict(labels)["position"]: v
        for (name, labels), v in got.items()
        if name == "pdserve_spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert by_pos == {"0": 4, "1": 2, "2": 1} and sum(by_pos.values()) == 7
    assert not any(dict(labels).get("node") != "decode-0" for _, labels in got)
