"""A decode node's committed requests whose grammar still compiles (GrammarWait): they keep
their ids and their place in the queue while aside, a compile is timed from its own start,
and a compile nobody waits for any more is dropped. In this process: the real
DecodeNode._admit, DecodeScheduler, Receiver and grammar.Compiles, a stub compile."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from common.base import grammar
from common.base.recent import Recent
from common.base.request import SamplingParams
from common.kv.blocks import BlockAllocator
from common.wire.protocol import KVRelease
from decode_node.grammar_wait import COMPILE_DEADLINE_S, GrammarWait
from decode_node.node import DecodeNode
from decode_node.scheduler import DecodeScheduler
from tests.handoff_util import FakeClock, receiver
from tests.unit.test_grants import _commit_group


def _node(gate: threading.Event, max_queue: int = 8, rows: int = 4, compile=None):
    """A decode node's admission parts over 80 blocks and `rows` rows: (node, blocks,
    clock). A grammar "slow" compiles once the gate opens; any other at once (or as
    compile says); node.local.num_runs counts its local prefill turns."""

    def gated(g):
        if g[1] == "slow":
            gate.wait(10)
        return ("compiled", g)

    compile = compile or gated
    clock = FakeClock()
    node = object.__new__(DecodeNode)
    node.compiles = grammar.Compiles(lambda: SimpleNamespace(compile=compile), clock=clock)
    node.grammars = GrammarWait(node.compiles)
    blocks = BlockAllocator(80)
    node.scheduler = DecodeScheduler(blocks, 4, rows)
    node.scheduler.aside = node.grammars.waiting  # as DecodeNode.__init__ shares it
    node.handoff = receiver(node.scheduler, clock=clock, max_queue=max_queue)
    node.joined, node.sent = [], []
    node.local = SimpleNamespace(abort=lambda rid: False, held_ids=set, num_runs=0)
    node.local.run = lambda: setattr(node.local, "num_runs", node.local.num_runs + 1)
    node.preemption = SimpleNamespace(resume_all=lambda: None)
    node.runtime = SimpleNamespace(send=node.sent.append)
    node.pending_aborts, node.ended, node.num_forked = set(), Recent(64), 0
    node._join = lambda seq, token, lp, timings, compiled=None: node.joined.append(
        (seq.request_id, compiled)
    )
    return node, blocks, clock


def _regex(spec: str) -> SamplingParams:
    return SamplingParams(max_tokens=6, grammar=("regex", spec, "compact"))


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_a_request_waiting_for_its_grammar_keeps_its_id_and_its_place_in_the_queue():
    """Defect: a committed request that left the handoff to wait for its grammar was in
    neither the handoff nor the batch: a second reservation of its id (or a fork's) was
    granted, and its commit overwrote the waiting one (its blocks never freed) or, without
    a grammar, forgot its compile (a KeyError out of the decode loop: the node died); and
    --max-queue no longer counted it, so any number could wait for the one compile thread."""
    gate = threading.Event()
    node, blocks, _ = _node(gate, max_queue=3)
    free_at_start = blocks.num_free
    try:
        _commit_group(node.handoff, "slow", ["slow-1"], params=_regex("slow"))
        node._admit()
        assert list(node.grammars.waiting) == ["slow"] and "slow" not in node.handoff.held
        for rid in ("slow", "slow-1"):
            why, is_retryable = node.handoff.refusal(rid, 8, 6)
            assert "already on this decode node" in why and not is_retryable
        _commit_group(node.handoff, "slow2", [], params=_regex("slow"))
        _commit_group(node.handoff, "slow3", [], params=_regex("slow"))
        node._admit()
        assert len(node.grammars.waiting) == 3 and not node.handoff.held
        assert node.handoff.refusal("x", 8, 6) == ("decode queue is full (3)", True)
        gate.set()
        _until(lambda: all(node.compiles.is_done(r) for r in ("slow2", "slow3")), "compiles")
        _until(lambda: node._admit() is not None and len(node.joined) == 4, "admission")
        assert sorted(rid for rid, _ in node.joined) == ["slow", "slow-1", "slow2", "slow3"]
        for rid in ("slow", "slow-1", "slow2", "slow3"):
            node.scheduler.finish(rid)
        assert (blocks.num_free, blocks.num_reserved) == (free_at_start, 0)
    finally:
        gate.set()
        node.compiles.close()


def test_a_compile_queued_behind_a_slow_one_is_timed_from_its_own_start():
    """Defect: every compile's deadline ran from when it was asked, and compiles run one at
    a time: behind one client's slow grammars, another client's request failed (for good,
    not moved) with a compile it had barely started. Now the deadline is the compile's own:
    asked 45 s ago, compiling for 20 s of them, it still waits, and then starts."""
    gates = {"slow": threading.Event(), "slower": threading.Event()}

    def compile(g):
        if g[1] in gates:
            gates[g[1]].wait(10)
        return ("compiled", g)

    node, blocks, clock = _node(threading.Event())
    node.compiles._make = lambda: SimpleNamespace(compile=compile)
    try:
        _commit_group(node.handoff, "first", [], params=_regex("slow"))
        _commit_group(node.handoff, "second", [], params=_regex("slower"))
        node._admit()
        _until(lambda: node.compiles.running_s("first") is not None, "the first compile")
        assert node.compiles.running_s("second") is None  # queued behind it
        clock.advance(25)
        gates["slow"].set()
        _until(lambda: node._admit() is not None and node.joined, "the first one's turn")
        _until(lambda: node.compiles.running_s("second") is not None, "the second compile")
        clock.advance(20)  # 45 s asked, 20 s its own
        node._admit()
        assert not node.sent and list(node.grammars.waiting) == ["second"]
        gates["slower"].set()
        _until(lambda: node._admit() is not None and len(node.joined) == 2, "the second one")
        assert not node.sent
    finally:
        for gate in gates.values():
            gate.set()
        node.compiles.close()


def test_a_hung_compile_fails_its_request_and_sends_the_line_elsewhere():
    """A compile that runs past its deadline cannot be stopped, and holds the one compile
    thread: it fails its request, and while it runs on, those queued behind it and those
    that come fail at once, retryable (the node's fault, not their grammars': the frontend
    moves them to another decode node), none held for minutes. Once it ends, the node
    compiles again."""
    gate = threading.Event()
    node, blocks, clock = _node(gate)
    try:
        _commit_group(node.handoff, "hung", [], params=_regex("slow"))
        node._admit()
        _until(lambda: node.compiles.running_s("hung") is not None, "the hung compile to begin")
        clock.advance(COMPILE_DEADLINE_S - 1)
        _commit_group(node.handoff, "queued", [], params=_regex("a+"))
        node._admit()
        assert list(node.grammars.waiting) == ["hung", "queued"] and not node.sent
        clock.advance(2)
        node._admit()
        assert [(m.request_id, m.is_retryable) for m in node.sent] == [
            ("hung", True),
            ("queued", True),
        ]
        assert "did not compile within 30s" in node.sent[0].error
        assert "held by one" in node.sent[1].error
        _commit_group(node.handoff, "later", [], params=_regex("b+"))
        node._admit()
        assert node.sent[-1].request_id == "later" and node.sent[-1].is_retryable
        gate.set()  # the hung one ends at last
        _until(lambda: not node.compiles.is_stuck(COMPILE_DEADLINE_S), "the thread back")
        _commit_group(node.handoff, "after", [], params=_regex("c+"))
        _until(lambda: node._admit() is not None and node.joined, "the next compile")
        assert node.joined == [("after", ("compiled", ("regex", "c+", "compact")))]
        node.scheduler.finish("after")
        assert (blocks.num_free, blocks.num_reserved) == (blocks.capacity, 0)  # each freed once
    finally:
        gate.set()
        node.compiles.close()


def test_a_first_compile_whose_vocabulary_load_hangs_fails_at_its_deadline():
    """The first compile loads the tokenizer's vocabulary, inside its own time: a load
    that hangs fails that request at COMPILE_DEADLINE_S (retryable), not at the line's
    deadline minutes later, its blocks freed."""
    gate = threading.Event()
    node, blocks, clock = _node(gate)
    node.compiles._make = lambda: gate.wait(10) and None  # the load hangs
    try:
        _commit_group(node.handoff, "r", [], params=_regex("a+"))
        node._admit()
        _until(lambda: node.compiles.running_s("r") is not None, "its compile to begin")
        clock.advance(COMPILE_DEADLINE_S - 1)
        node._admit()
        assert not node.sent and list(node.grammars.waiting) == ["r"]
        clock.advance(2)
        node._admit()
        assert [(m.request_id, m.is_retryable) for m in node.sent] == [("r", True)]
        assert (blocks.num_free, blocks.num_reserved) == (blocks.capacity, 0)
    finally:
        gate.set()
        node.compiles.close()


def test_a_compile_of_a_request_released_before_admission_is_dropped():
    """Defect: a committed request's compile started at commit stayed (compiling, and its
    bookkeeping kept) after its prefill node released the grant: only an abort pruned it,
    so with none they piled up and took the compile thread from requests that wait."""
    gate = threading.Event()
    node, blocks, _ = _node(gate)
    try:
        _commit_group(node.handoff, "r", [], params=_regex("slow"))
        node.grammars.ask(node.handoff)  # as while a step runs
        assert node.compiles.keys() == ["r"]
        r = node.handoff.held["r"]
        node.handoff.receive(b"p", KVRelease("r", r.name))
        assert "r" not in node.handoff.held
        node.grammars.ask(node.handoff)
        assert node.compiles.keys() == [] and not node.grammars.ids()
    finally:
        gate.set()
        node.compiles.close()


def test_a_dropped_compiles_start_is_not_its_successors():
    """Defect: a compile's start was stamped under its key from the compile thread: a key
    dropped just as its compile began got a stamp after the drop, and the same id asked
    again (a retried handoff), still queued, read as running since then and failed its
    deadline. Each submission has its own stamp now."""
    gate, stamping, stamped = threading.Event(), threading.Event(), threading.Event()

    def clock() -> float:  # the compile thread's stamp waits until the test says
        if threading.current_thread().name.startswith("grammar"):
            stamping.set()
            stamped.wait(10)
        return 100.0

    compiles = grammar.Compiles(
        lambda: SimpleNamespace(
            compile=lambda g: gate.wait(10) if g[1] == "slow" else ("compiled", g)
        ),
        clock=clock,
    )
    try:
        compiles.submit("x", ("regex", "slow", "compact"))
        _until(stamping.is_set, "x's compile to begin")
        compiles.drop("x")  # as it begins; it runs on, holding the thread
        stamped.set()
        compiles.submit("x", ("regex", "a+", "compact"))
        time.sleep(0.05)  # the first one's stamp is written by now
        assert compiles.running_s("x") is None  # queued: not started, whatever came before
        gate.set()
        _until(lambda: compiles.is_done("x"), "x again")
        assert compiles.take("x") == ("compiled", ("regex", "a+", "compact"))
    finally:
        gate.set()
        stamped.set()
        compiles.close()


def test_a_decode_node_admits_past_a_grammar_still_compiling():
    """Defect: a decode node asked for a committed request's grammar compile only once it
    was at the head of the ready line (DecodeNode._admit: peek_ready -> _is_compiled ->
    break), and admitted nothing behind it, nor prefilled locally, until that compile
    ended: a client's slow grammars, compiled one after another, made every other
    client's time to first token wait for all of them, and a hung compile, for good. Now
    compiles start at commit, a request whose grammar still compiles waits aside (its
    blocks its own) while those behind it are admitted; a grammar that does not compile
    fails its request for good, a compile past its deadline (and, while it holds the
    thread, those queued behind it) retryably; blocks freed once."""
    gate = threading.Event()

    def compile(g):  # "slow" hangs until the gate opens; "bad" does not compile
        if g[1] == "slow":
            gate.wait(10)
        if g[1] == "bad":
            raise grammar.GrammarError("the regex does not compile: bad")
        return ("compiled", g)

    node, blocks, clock = _node(gate, rows=2, compile=compile)
    joined, sent = node.joined, node.sent
    free_at_start = blocks.num_free

    def regex(spec):
        return SamplingParams(max_tokens=6, grammar=("regex", spec, "compact"))

    try:
        _commit_group(node.handoff, "slow", [], params=regex("slow"))
        _commit_group(node.handoff, "plain", [])
        _commit_group(node.handoff, "plain2", [])
        assert node._admit() == []
        wait = time.monotonic() + 10
        while node.compiles.running_s("slow") is None:  # its compile has begun
            assert time.monotonic() < wait
            time.sleep(0.001)
        assert [rid for rid, _ in joined] == ["plain", "plain2"]  # past "slow", still compiling
        assert "slow" in node._held_ids()
        clock.advance(COMPILE_DEADLINE_S - 10)
        _commit_group(node.handoff, "bad", [], params=regex("bad"))
        _commit_group(node.handoff, "quick", [], params=regex("a+"))
        node._admit()  # no row free: their compiles are asked anyway
        assert set(node.compiles.keys()) == {"slow", "bad", "quick"}
        node.scheduler.finish("plain2")
        num_local = node.local.num_runs
        node._admit()
        assert node.local.num_runs == num_local + 1 and not sent  # a prompt here runs meanwhile
        clock.advance(11)  # "slow" is past its deadline, still running
        node._admit()
        # It fails, and so do those queued behind it while it holds the one compile thread:
        # the node's fault, not their grammars': each may go to another decode node.
        assert [(m.request_id, m.is_retryable, m.is_bad_request) for m in sent] == [
            ("slow", True, False),
            ("bad", True, False),
            ("quick", True, False),
        ]
        assert "did not compile within 30s" in sent[0].error and "held by" in sent[1].error
        gate.set()  # the thread is the next compile's
        deadline = time.monotonic() + 10
        while node.compiles.is_stuck(COMPILE_DEADLINE_S):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        _commit_group(node.handoff, "bad2", [], params=regex("bad"))
        _commit_group(node.handoff, "quick2", [], params=regex("a+"))
        node._admit()
        while len(sent) < 4 or len(joined) < 3:  # their compiles end, on the freed thread
            assert time.monotonic() < deadline
            time.sleep(0.001)
            node._admit()
        assert [(m.request_id, m.is_retryable) for m in sent[3:]] == [("bad2", False)]
        # the grammar's own fault: said (a 400), not moved
        assert "regex does not" in sent[3].error and sent[3].is_bad_request
        assert joined[2:] == [("quick2", ("compiled", ("regex", "a+", "compact")))]
        assert not node.grammars.waiting and node.compiles.keys() == []
        for rid in ("plain", "quick2"):
            node.scheduler.finish(rid)
        assert (blocks.num_free, blocks.num_reserved) == (free_at_start, 0)  # each freed once
    finally:
        gate.set()
        node.compiles.close()


def test_only_a_grammar_that_cannot_go_on_fails_a_join_alone():
    """Defect: the decode node caught every ValueError of a sequence's join as its grammar's,
    so the batch's own refusal (a row for an id already decoding) was sent to the client as
    a failure while the sequence stayed running, holding its blocks, with no row: a drain
    then waited out its timeout. Only the grammar's end is the request's; the rest is the
    node's fault and is not swallowed."""
    import pytest

    from common.kv.sequence import Sequence
    from decode_node.batch import Batch

    class Refusing:
        verifier = None  # no speculative decoding

        def add(self, *args):
            raise ValueError("sequence 'r' is already decoding")

    spec = SimpleNamespace(vocab_size=100, eos_token_ids=(0,))
    worker = SimpleNamespace(spec=spec, max_model_len=64, block_size=4, decode=Refusing())
    sched = DecodeScheduler(BlockAllocator(32), 4, 8)
    block_ids, num_reserved = sched.take_blocks(5, 10)
    seq = Sequence("r", 5, SamplingParams(max_tokens=10), block_ids, num_reserved, [1] * 5)
    sent = []
    node = object.__new__(DecodeNode)
    node.batch = Batch(worker, sched, SimpleNamespace(grammars={}), Recent(10))
    node.runtime = SimpleNamespace(send=sent.append)
    with pytest.raises(ValueError, match="already decoding"):
        node._join(sched.admit(seq), 7, None, {})
    assert sent == []
