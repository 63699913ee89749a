"""The decode node's batch with speculative decoding on: its turn as the node runs it (a
step run ahead wherever the batch allows), blocks grown for the drafts from a request's
reservation or from the free pool, a stop token inside a verified run, and every block
back at the end; tokens equal to plain decoding's (the draft chooser on a fake clock:
test_draft_chooser)."""

import contextlib

import pytest

from common.base.config import WorkerConfig
from common.base.recent import Recent
from common.base.request import SamplingParams
from common.base.speculative import SpeculativeConfig
from common.engine.worker import DeviceWorker, PrefillChunk
from common.kv.blocks import num_blocks_for
from common.kv.prefix import PrefixCache
from common.kv.sequence import Sequence
from decode_node.batch import Batch
from decode_node.scheduler import DecodeScheduler
from tests.unit.test_speculative import _Oracle

PROMPTS = [[5, 6, 7, 8] * 4, [9, 8] * 3, [1, 2, 3, 4, 5] * 3 + [1], [11, 12, 13] * 5]
STOP_ROW = 3  # its request stops at its 12th token


def _serve(model, spec, is_preemptive, stops=None, oracle=None, block_size=16, parts=None):
    """The node's turn over PROMPTS (launch; the next one ahead where can_run_ahead says;
    collect), the draft chooser taking every draft the rows have room for. -> (tokens per
    request, the batch, the worker's stats, (free, reserved) blocks at the end); parts, if
    given, takes each request's timings parts from its last update."""
    cfg = WorkerConfig(
        model=str(model),
        kv_cache_memory=8 * 2**20,
        block_size=block_size,
        max_batch_size=4,
        speculative=spec,
    )
    out = {}
    with DeviceWorker(cfg) as w:
        cache = PrefixCache(w.num_kv_blocks)
        s = DecodeScheduler(cache, block_size, 4, is_preemptive=is_preemptive)
        b = Batch(w, s, None, Recent(100))
        if oracle:
            w.decode.verifier.drafter = oracle
            b.drafts.choose = lambda keys, limit: limit
        for i, prompt in enumerate(PROMPTS):
            stop = (stops[i],) if stops and i == STOP_ROW else ()
            p = SamplingParams(max_tokens=30 + 3 * i, ignore_eos=True, stop_token_ids=stop)
            seq = Sequence(f"r{i}", len(prompt), p, prompt_ids=list(prompt))
            need = s.blocks_at_reserve(len(prompt), p.max_tokens)
            cache.reserve(need)
            seq.num_reserved = need
            for _ in range(num_blocks_for(len(prompt), block_size)):
                seq.take_block(cache)
            (first,), _ = w.prefill([PrefillChunk(prompt, 0, seq.block_ids, p)])
            s.admit(seq)
            b.join(seq, first, None, {})
            out[seq.request_id] = [first]
        running = b.launch()
        while running is not None:
            ahead = b.launch() if b.can_run_ahead() else None
            for update in b.collect(running, is_next_launched=ahead is not None):
                out[update.request_id].extend(update.token_ids)
                if update.finish_reason and parts is not None:
                    parts[update.request_id] = update.timings or {}
            running = ahead if ahead is not None or not s.running else b.launch()
        return out, b, w.decode.stats(), (cache.num_free, cache.num_reserved)


@pytest.mark.parametrize("is_preemptive", [True, False], ids=["preemptive", "reserved"])
def test_the_nodes_turn_verifies_drafts_and_gives_every_block_back(tiny_model, is_preemptive):
    off = SpeculativeConfig("off")
    plain, _, plain_stats, plain_blocks = _serve(tiny_model, off, is_preemptive)
    whole = [PROMPTS[i] + plain[f"r{i}"] for i in range(len(PROMPTS))]
    parts = {}
    got, _, stats, blocks = _serve(
        tiny_model, SpeculativeConfig("ngram", 4), is_preemptive, oracle=_Oracle(whole), parts=parts
    )
    assert got == plain and blocks == plain_blocks and blocks[1] == 0
    # Each request's timings say its drafts: together, the node's.
    assert sorted(parts) == sorted(plain)
    for key in ("num_draft_tokens", "num_accepted_tokens"):
        assert all(p[key] > 0 for p in parts.values())
        assert sum(p[key] for p in parts.values()) == stats[key.replace("draft", "drafted")]
    # drafts that are all right: far fewer steps (preemptive: with no reservation, their
    # blocks from the pool, as test_drafts_never_take_the_pools_last_blocks reckons)
    assert stats["num_verify_steps"] > 0
    assert stats["num_decode_steps"] * 3 < plain_stats["num_decode_steps"]


def test_a_stop_token_inside_a_verified_run_ends_the_request_there(tiny_model):
    plain, *_ = _serve(tiny_model, SpeculativeConfig("off"), True)
    row = plain[f"r{STOP_ROW}"]
    stops = {STOP_ROW: row[11]}
    want, *_ = _serve(tiny_model, SpeculativeConfig("off"), True, stops)
    end = row.index(row[11]) + 1
    assert want[f"r{STOP_ROW}"] == row[:end]
    whole = [PROMPTS[i] + plain[f"r{i}"] for i in range(len(PROMPTS))]  # past the stop too
    got, batch, stats, blocks = _serve(
        tiny_model, SpeculativeConfig("ngram", 4), True, stops, oracle=_Oracle(whole)
    )
    assert got == want and blocks[1] == 0 and stats["num_verify_steps"] > 0
    assert batch.num_discarded_tokens > 0  # drafts accepted past the stop, dropped


def test_a_step_with_no_draft_in_any_row_runs_plain(tiny_model):
    """Drafts chosen (k > 0) and none proposed (a sampled load's drafts, found almost never):
    a verify step would compute k + 1 positions a row for the one token a plain step makes;
    on the host, where the drafts are read first for nothing, the step runs plain."""
    plain, _, plain_stats, _ = _serve(tiny_model, SpeculativeConfig("off"), True)
    known = [PROMPTS[i] + plain[f"r{i}"][:1] for i in range(len(PROMPTS))]  # nothing past
    spec = SpeculativeConfig("ngram", 4)
    oracle = _Oracle(known)
    got, batch, stats, blocks = _serve(tiny_model, spec, True, oracle=oracle)
    assert got == plain and blocks[1] == 0
    assert stats["num_verify_steps"] == 0
    assert stats["num_decode_steps"] == plain_stats["num_decode_steps"]
    won, tried = batch.drafts._pooled[0]  # greedy rows' drafts, over the run
    assert won == 0 and tried > 0  # the chooser was told: each row refused what was asked
    assert oracle.num_proposed_none > 0  # and the drafter


@contextlib.contextmanager
def _preemptive_batch(model):
    """A worker with prompt lookup of 4 drafts, and a preemptive node's batch over it: ->
    (worker, prefix cache, scheduler, batch)."""
    cfg = WorkerConfig(
        model=str(model),
        kv_cache_memory=8 * 2**20,
        max_batch_size=4,
        speculative=SpeculativeConfig("ngram", 4),
    )
    with DeviceWorker(cfg) as w:
        cache = PrefixCache(w.num_kv_blocks)
        s = DecodeScheduler(cache, 16, 4, is_preemptive=True)
        yield w, cache, s, Batch(w, s, None, Recent(100))


def test_drafts_never_take_the_pools_last_blocks(tiny_model):
    """A preemptive node's rows hold no reservation: drafts grow into the free pool only
    beyond its watermark; with the pool that low, the steps are plain."""
    plain, *_ = _serve(tiny_model, SpeculativeConfig("off"), True)
    whole = [PROMPTS[i] + plain[f"r{i}"] for i in range(len(PROMPTS))]
    with _preemptive_batch(tiny_model) as (w, cache, s, b):
        w.decode.verifier.drafter = _Oracle(whole)
        seq = Sequence("r0", 16, SamplingParams(max_tokens=40), prompt_ids=PROMPTS[0])
        seq.output_ids = list(range(13))  # 29 tokens with the next input: two blocks
        seq.take_block(cache)  # holds one: the next token takes one from the pool
        s.admit(seq)
        held = cache.allocate(cache.num_available - s.watermark - 1)
        assert b._room() == 3  # one block past the watermark: tokens up to 32
        cache.free(held[:1])
        assert b._room() == 4  # two: 33 tokens
        cache.allocate(2)
        assert b._room() == 0  # none: the next token's block is the watermark's
        cache.free(held)
        assert b._room() == 4
        seq.params = SamplingParams(max_tokens=40, no_drafts=True)
        assert b._room() == 0  # every row opted out: no verify step to pay for


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_the_first_step_after_a_handoff_verifies_drafts_from_the_prompt(tiny_model, method):
    """A request joins as from a handoff (its tokens and first token; no KV of drafts):
    its very first decode step verifies drafts the node proposed from its prompt (each
    token of the vocabulary occurs in it, so whatever the first token, a match)."""
    cfg = WorkerConfig(
        model=str(tiny_model),
        kv_cache_memory=8 * 2**20,
        max_batch_size=4,
        speculative=SpeculativeConfig(method, 4),
    )
    with DeviceWorker(cfg) as w:
        prompt = list(range(w.spec.vocab_size))
        cache = PrefixCache(w.num_kv_blocks)
        s = DecodeScheduler(cache, 16, 4, is_preemptive=True)
        b = Batch(w, s, None, Recent(100))
        b.drafts.choose = lambda keys, limit: limit
        p = SamplingParams(max_tokens=8, ignore_eos=True)
        seq = Sequence("r0", len(prompt), p, prompt_ids=prompt)
        for _ in range(num_blocks_for(len(prompt), 16)):
            seq.take_block(cache)
        (first,), _ = w.prefill([PrefillChunk(prompt, 0, seq.block_ids, p)])
        s.admit(seq)
        b.join(seq, first, None, {})
        ticket = b.launch()
        assert ticket.num_drafts == 4
        (update,) = b.collect(ticket, is_next_launched=False)
        # suffix decoding's drafts are at most as many as its match is long
        assert ticket.num_drafted[0] >= 1 and len(update.token_ids) == 1 + ticket.num_accepted[0]
        b.finish("r0", in_batch=True)


def test_no_step_runs_ahead_of_a_check(tiny_model):
    """Where steps queue (CUDA) the next is launched before this one is collected, where
    the batch allows. After a check (a plain step that times plain steps afresh) the next is
    chosen once the check is timed: chosen before, it was a second check."""
    with _preemptive_batch(tiny_model) as (w, cache, s, b):
        prompt, p = PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True)
        seq = Sequence("r0", len(prompt), p, prompt_ids=list(prompt))
        for _ in range(num_blocks_for(len(prompt), 16)):
            seq.take_block(cache)
        (first,), _ = w.prefill([PrefillChunk(prompt, 0, seq.block_ids, p)])
        s.admit(seq)
        b.join(seq, first, None, {})
        # the chooser's past: plain steps timed while the cores were busy, then verify steps
        # of one draft that pay (by under 2x) against them: a check is due
        for _ in range(20):
            b.drafts.observe(["r0"], 0, 3.0, [])
        for i in range(20):
            b.drafts.observe(["r0"], 1, 1.5, [int(i % 3 == 0)])
        running = b.launch()
        assert running.num_drafts == 0 and b.drafts.is_checking
        assert not b.can_run_ahead()
        b.collect(running, is_next_launched=False)
        assert not b.drafts.is_checking  # timed: the next step may be chosen
        b.finish("r0", in_batch=True)
