"""A grammar whose parse costs more with every token (an ambiguous one: xgrammar's Earley
parser keeps every way to read the output), or more than the meter's mean all along, ends
its request with a clear error before it stalls the node's batch for long; ordinary
grammars never trip the meter."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from common.base import grammar_cost
from common.base.grammar import GrammarError
from common.base.grammar_cost import CostMeter
from common.base.grammar_matcher import matcher_for
from common.base.request import SamplingParams
from common.base.speculative import SpeculativeConfig
from common.engine.prefill_job import PrefillJob
from prefill_node.grammars import PrefillGrammars
from prefill_node.node import PrefillNode
from tests.unit import test_speculative_grammar as spec_grammar

AMBIGUOUS = ("grammar", 'root ::= root root | root | "a" | ""', "compact")
MAX_TOKENS = 1000


# test_speculative_grammar's fixture, under its own name: the tiny model's grammars.
grammars = spec_grammar.grammars


@pytest.fixture(scope="module")
def a_token(tiny_model) -> int:
    from transformers import AutoTokenizer

    (token,) = AutoTokenizer.from_pretrained(str(tiny_model)).encode("a")
    return token


def _params(g=AMBIGUOUS, **kw) -> SamplingParams:
    # min_tokens: no EOS, so the grammar's output must go on
    return SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, grammar=g, **kw)


def test_the_meter_refuses_a_slow_call_a_slow_mean_a_growing_cost_or_a_slow_replay():
    one = CostMeter()
    one.add(grammar_cost.MAX_CALL_S * 0.9)  # a mask at a costly state: served
    assert one.error is None
    one.add(grammar_cost.MAX_CALL_S * 1.1)  # at once, whatever the allowance left
    assert "for one mask or token" in one.error and "over 2 masks" in one.error
    # slow all along, under the mean's limit: never refused, however long
    steady = CostMeter()
    for _ in range(20_000):
        steady.add(grammar_cost.MAX_MEAN_S * 0.9)
    assert steady.error is None
    # over it: refused once the excess passes the allowance, not at the first slow call
    slow = CostMeter()
    while slow.error is None:
        slow.add(grammar_cost.MAX_MEAN_S * 2)
    expected = grammar_cost.ALLOWANCE_S / grammar_cost.MAX_MEAN_S
    assert expected <= slow.num_calls <= expected + 2, slow.num_calls
    assert "20.0 ms of CPU a mask or token" in slow.error and "on average" in slow.error
    # a cost that grows: refused once it is past MIN_SLOW_S and GROWTH times the first calls'
    growing = CostMeter()
    for n in range(1, 5000):
        growing.add(1e-6 * n * n / 100)  # as an ambiguous grammar's: the square of the output
        if growing.error is not None:
            break
    assert "lately" in growing.error and "ambiguous" in growing.error
    assert growing.recent_s < 2 * grammar_cost.MIN_SLOW_S  # no later than it must
    cheap_then_slow = CostMeter()  # the first calls cheap, the rest a steady cost
    for n in range(5 * grammar_cost.NUM_FIRST):
        cheap_then_slow.add(grammar_cost.MIN_SLOW_S / 2 if n > 64 else 1e-5)
    assert cheap_then_slow.error is None  # past GROWTH, but below MIN_SLOW_S
    replay = CostMeter()
    num_calls = int(grammar_cost.MAX_REPLAY_S / grammar_cost.MAX_MEAN_S) + 100
    for i in range(num_calls):
        replay.add(grammar_cost.MAX_MEAN_S * 0.99)
        replay.check_replay(i + 1)
        if replay.error is not None:
            break
    assert "to follow its first" in replay.error and "again" in replay.error
    assert replay.total_s < grammar_cost.MAX_REPLAY_S + grammar_cost.MAX_MEAN_S  # at once


def test_an_ambiguous_grammar_trips_the_meter_and_a_plain_one_never(grammars, a_token):
    vocab_size = grammars.info.vocab_size
    m = matcher_for(_params(), [], vocab_size, grammars)
    for num_tokens in range(1, 400):
        m.fill()
        assert m.accept(a_token)
        if m.cost.error is not None:
            break
    assert m.cost.error is not None and "ambiguous" in m.cost.error, num_tokens
    # its replay, as a node that takes the request over runs it: refused, not run to the end
    with pytest.raises(GrammarError, match="costs too much"):
        matcher_for(_params(), [a_token] * 2000, vocab_size, grammars)
    plain = matcher_for(_params(("regex", "a+", "compact")), [], vocab_size, grammars)
    for _ in range(2 * num_tokens + 200):
        plain.fill()
        assert plain.accept(a_token)
    assert plain.cost.error is None and plain.cost.num_calls > 2 * grammar_cost.NUM_FIRST


def test_a_prefill_node_refuses_to_follow_a_moved_requests_costly_outputs(grammars, a_token):
    """A request moved with outputs it streamed: its matcher is brought past them when its
    grammar is taken, so one too costly to follow fails before any pass is spent on it,
    and the client is told it is its request's fault (a 400)."""
    vocab_size = grammars.info.vocab_size
    node = object.__new__(PrefillNode)
    node.grammars = PrefillGrammars(lambda: grammars, vocab_size)
    node.grammars.compiles.close()  # no thread: its compiles are stood in for
    node.grammars.compiles = SimpleNamespace(
        grammars=grammars, take=lambda rid: None, is_done=lambda rid: True
    )

    def job(rid: str, num_outputs: int) -> PrefillJob:
        p = _params(num_prior_outputs=num_outputs)
        job = PrefillJob(rid, [3, 4, 5] + [a_token] * num_outputs, p, 0.0, "d", "tcp://x:1")
        job.is_compiling = True
        return job

    short, costly = job("short", 8), job("costly", 2000)
    aborted, sent = [], []
    node.scheduler = SimpleNamespace(waiting=[short, costly])
    node.handoffs = SimpleNamespace(abort=aborted.append)
    node.frontend = SimpleNamespace(send=lambda msg, block: sent.append(msg) or True)
    node.num_failed = 0
    node._take_compiled()
    assert short.matcher is not None and not short.is_compiling
    assert aborted == ["costly"] and [m.request_id for m in sent] == ["costly"]
    assert "costs too much" in sent[0].error and sent[0].is_bad_request
    assert not sent[0].is_retryable and node.num_failed == 1


def test_a_grammar_a_prefill_node_cannot_compile_is_its_fault_or_the_requests():
    """A grammar that does not compile is the request's own fault (a 400, each fork's); one
    this node could not compile for a reason of its own (its vocabulary does not load) is
    retryable: the frontend moves the request on, no 400 for a server's fault."""

    def no_vocabulary():
        raise RuntimeError("tokenizer.json unreadable")

    def bad_regex():
        return SimpleNamespace(compile=lambda g: (_ for _ in ()).throw(GrammarError("no")))

    for make, is_ours in ((no_vocabulary, True), (bad_regex, False)):
        node = object.__new__(PrefillNode)
        node.grammars = PrefillGrammars(make, 100)
        p = SamplingParams(max_tokens=4, grammar=("regex", "a+", "compact"))
        job = PrefillJob("r", [3, 4, 5], p, 0.0, "d", "tcp://x:1")
        job.forks = [SimpleNamespace(request_id="r-1")]
        node.grammars.submit(job)
        aborted, sent = [], []
        node.scheduler = SimpleNamespace(waiting=[job])
        node.handoffs = SimpleNamespace(abort=aborted.append)
        node.frontend = SimpleNamespace(send=lambda msg, block: sent.append(msg) or True)
        node.num_failed = 0
        try:
            deadline = time.monotonic() + 30
            while not node.grammars.compiles.is_done("r"):  # on the grammars' thread
                assert time.monotonic() < deadline
                time.sleep(0.001)
            node._take_compiled()
        finally:
            node.grammars.close()
        assert aborted == ["r", "r-1"] and [m.request_id for m in sent] == ["r", "r-1"]
        assert {(m.is_retryable, m.is_bad_request) for m in sent} == {(is_ours, not is_ours)}


def _serve_failing(model, grammars, params, spec, monkeypatch) -> tuple:
    """test_speculative_grammar's serve, with the (request id, error) of each row the
    decode node ended failed (what it tells the frontend: a 400) as a fourth item."""
    failed = []
    real_collect = spec_grammar.Batch.collect

    def collect(batch, *args, **kwargs):
        updates = real_collect(batch, *args, **kwargs)
        failed.extend(batch.failed)
        batch.failed.clear()
        return updates

    monkeypatch.setattr(spec_grammar.Batch, "collect", collect)
    return (*spec_grammar._serve(model, grammars, params, spec), failed)


@pytest.mark.parametrize("spec", [SpeculativeConfig("off"), SpeculativeConfig("ngram", 4)])
def test_a_decode_node_ends_a_costly_grammars_request_and_the_batch_goes_on(
    tiny_model, grammars, monkeypatch, spec
):
    """Its row ends failed (the node tells the frontend: a 400), its blocks go back, and the
    other rows run to their end."""
    monkeypatch.setattr(spec_grammar, "NEW_TOKENS", 40)
    params = spec_grammar._params(sampled=False)
    _, _, blocks = spec_grammar._serve(tiny_model, grammars, params, spec)
    params[0] = _params()
    out, stats, got_blocks, failed = _serve_failing(tiny_model, grammars, params, spec, monkeypatch)
    ((rid, error),) = failed
    assert rid == "r0" and "costs too much" in error
    assert len(out["r0"]) < MAX_TOKENS // 2  # its tokens in the failing step are not sent
    assert [len(out[f"r{i}"]) for i in (1, 2, 3)] == [40, 40, 40]
    assert got_blocks == blocks and got_blocks[1] == 0  # every block back
    if spec.method != "off":
        assert stats["num_verify_steps"] > 0


NO_TEXT = ("grammar", "root ::= root", "compact")
# "a", "b", then a rule with no way to end: the tiny model's vocabulary is one character a
# token, so "a" is the prefill node's token, "b" the decode node's, then nothing may follow
DEAD_END = ("grammar", 'root ::= "a" "b" x\nx ::= x "c"', "compact")


def test_a_grammar_that_matches_no_text_is_refused_before_any_work(grammars):
    """Hunt: `root ::= root` compiled, and the request ran every step under a mask that
    allowed no token: token 0 a step, a 200 with garbage ending in "length". A grammar
    whose first mask allows nothing is refused when it compiles (the frontend's check, a
    400), and one that comes to a dead end is refused where its output is followed."""
    for g in (NO_TEXT, ("grammar", 'x ::= x "b"\nroot ::= x', "compact")):
        with pytest.raises(GrammarError, match="matches no text"):
            grammars.compile(g)
    vocab_size = grammars.info.vocab_size
    a, b = (grammars.info.decoded_vocab.index(c.encode()) for c in "ab")
    m = matcher_for(SamplingParams(max_tokens=8, grammar=DEAD_END), [a], vocab_size, grammars)
    assert m.error is None and m.accept(b) and m.error is None
    assert not m.fill().any() and "allows no next token" in m.error
    assert "cannot go on from here" in m.error and "min_tokens" in m.error  # what may cause it
    with pytest.raises(GrammarError, match="allows no next token"):  # a move's replay
        matcher_for(SamplingParams(max_tokens=8, grammar=DEAD_END), [a, b], vocab_size, grammars)
    m = matcher_for(SamplingParams(max_tokens=8, grammar=DEAD_END), [], vocab_size, grammars)
    assert not m.accept(b) and f"token {b} was made, which it does not allow" in m.error


@pytest.mark.parametrize("spec", [SpeculativeConfig("off"), SpeculativeConfig("ngram", 4)])
def test_a_decode_node_ends_a_request_whose_grammar_has_no_way_on(
    tiny_model, grammars, monkeypatch, spec
):
    """The row whose grammar comes to a dead end fails there (a 400 for the client), with
    none of the tokens its empty masks made; the other rows run to their end."""
    monkeypatch.setattr(spec_grammar, "NEW_TOKENS", 30)
    params = spec_grammar._params(sampled=False)
    _, _, blocks = spec_grammar._serve(tiny_model, grammars, params, spec)
    params[0] = SamplingParams(max_tokens=30, grammar=DEAD_END)
    out, _, got_blocks, failed = _serve_failing(tiny_model, grammars, params, spec, monkeypatch)
    ((rid, error),) = failed
    assert rid == "r0" and "allows no next token" in error, error
    a, b = (grammars.info.decoded_vocab.index(c.encode()) for c in "ab")
    assert out["r0"] == [a, b]
    assert [len(out[f"r{i}"]) for i in (1, 2, 3)] == [30, 30, 30]
    assert got_blocks == blocks and got_blocks[1] == 0  # every block back
