"""n > 1 sequences of one request: one prefill samples every first token, and the decode
node forks the sequences over the prompt's blocks (shared by reference count, the
partial last block copied). Cluster-level equality with the requests alone is in
test_api_features.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.base.config import WorkerConfig
from common.base.request import SamplingParams
from common.engine.worker import DeviceWorker, PrefillChunk
from common.kv.blocks import BlockAllocator
from common.wire.protocol import Fork, KVCommit, KVReserve, KVTransfer
from decode_node.scheduler import DecodeScheduler
from tests.handoff_util import Pair, receiver, start_all

BS = 4


def _group(
    sched: DecodeScheduler, rx, prompt_len: int, max_tokens: int, fork_ids=("a1", "a2"), sender=b"p"
):
    """Request "a" with forks reserved, written and committed: its reservation."""
    rx.receive(sender, KVReserve("a", prompt_len, max_tokens, 1, list(fork_ids)))
    r = rx.held["a"]
    c = rx.sink.cache
    kv = torch.zeros(c.shape[0], 2, len(r.block_ids), *c.shape[3:], dtype=c.dtype)
    rx.receive(sender, KVTransfer("a", r.name, "tcp", {"first_layer": 0}, kv))
    forks = [Fork(f, 100 + i, first_token=3 + i) for i, f in enumerate(fork_ids)]
    rx.receive(
        sender,
        KVCommit(
            "a",
            prompt_len,
            2,
            SamplingParams(max_tokens=max_tokens, seed=99),
            {},
            "tcp",
            [1] * prompt_len,
            r.name,
            c.shape[0],
            forks=forks,
        ),
    )
    return r


@pytest.mark.parametrize("prompt_len", [6, 8])  # a partial last block, and none
def test_forks_share_the_prompts_full_blocks_and_copy_its_partial_one(prompt_len):
    sched = DecodeScheduler(BlockAllocator(41), BS, 8)
    rx = receiver(sched)
    free = sched.prefix_cache.num_available
    _group(sched, rx, prompt_len, 10)
    num_full, is_partial = prompt_len // BS, prompt_len % BS > 0
    own = sched.blocks_at_reserve(prompt_len, 10)
    assert free - sched.prefix_cache.num_available == own + 2 * (
        own - num_full
    )  # shared blocks counted once
    seqs, copies = start_all(sched, rx.next_ready())
    a, a1, a2 = seqs
    assert [s.request_id for s in seqs] == ["a", "a1", "a2"] and [s.params.seed for s in seqs] == [
        99,
        100,
        101,
    ]
    for b in a.block_ids[:num_full]:
        assert sched.prefix_cache.num_holders(b) == 3 and b in a1.block_ids and b in a2.block_ids
    if is_partial:  # each its own copy of the last, partial block
        assert len({a.block_ids[-1], a1.block_ids[-1], a2.block_ids[-1]}) == 3
    assert copies == (
        [(a.block_ids[-1], a1.block_ids[-1]), (a.block_ids[-1], a2.block_ids[-1])]
        if is_partial
        else []
    )
    assert (
        a.num_reserved == a1.num_reserved == a2.num_reserved
    )  # each the same promise for its outputs
    sched.preempt(sched.victim(), now=1.0)  # a fork leaves: the others keep the blocks
    assert all(sched.prefix_cache.num_holders(b) == 2 for b in a.block_ids[:num_full])
    sched.drop_preempted(sched.preempted[0].request_id)
    for rid in ["a", "a1"]:
        sched.finish(rid)
    assert sched.prefix_cache.num_available == free and sched.prefix_cache.num_reserved == 0


def test_one_fork_aborted_before_admission_goes_alone_and_all_aborted_frees_the_reservation():
    sched = DecodeScheduler(BlockAllocator(41), BS, 8)
    rx = receiver(sched)
    free = sched.prefix_cache.num_available
    rx.receive(b"p", KVReserve("a", 6, 10, 1, ["a1", "a2"]))
    assert {"a", "a1", "a2"} <= rx.held_ids()
    rx.abort("a")  # choice 0 is given up; its forks go on
    rx.abort("a1")
    assert rx.held["a"].aborted_ids == {"a", "a1"}
    rx.receive(b"p", KVReserve("a", 6, 10, 2, ["a1", "a2"]))  # its renewal is not refused
    assert "a" in rx.held
    rx.abort("a2")  # the last: all of it goes (freed once no write can land)
    rx.receive(
        b"p",
        KVCommit("a", 6, 2, SamplingParams(max_tokens=10), {}, "tcp", [1] * 6, rx.held["a"].name),
    )
    assert "a" not in rx.held and sched.prefix_cache.num_available == free


def test_a_request_with_forks_that_waits_in_line_is_granted_on_its_turn():
    """Hunt: a request of n > 1 that had to wait for blocks was refused for good on its
    turn ("request 'b1' is already on this decode node", a 500): its own entry, still in
    the line, was taken for another request holding its forks. Another request that does
    name a fork held here is still refused."""
    from common.wire.protocol import KVRelease

    sent = []
    sched = DecodeScheduler(BlockAllocator(41), BS, 8)
    rx = receiver(sched, send=lambda m, to: sent.append(m) or True)
    rx.receive(b"p", KVReserve("a", 140, 8, 1))  # most of the blocks
    assert sent[-1].block_ids
    rx.receive(b"p", KVReserve("b", 20, 8, 2, ["b1"]))
    assert sent[-1].is_queued and sent[-1].block_ids is None
    rx.receive(b"p", KVReserve("c", 4, 4, 3, ["b1"]))  # names b's fork: not its to take
    assert sent[-1].block_ids is None and "already on this decode node" in sent[-1].reason
    rx.receive(b"p", KVRelease("a", rx.held["a"].name))
    rx.turn()
    assert sent[-1].request_id == "b" and sent[-1].block_ids, sent[-1]
    assert {"b", "b1"} <= rx.held_ids() and not rx.waiting


def test_a_commit_must_fork_what_was_reserved():
    sched = DecodeScheduler(BlockAllocator(41), BS, 8)
    acks = []
    rx = receiver(sched, send=lambda m, to: acks.append(m) or True)
    rx.receive(b"p", KVReserve("a", 6, 10, 1, ["a1"]))
    r = rx.held["a"]
    rx.receive(
        b"p",
        KVCommit(
            "a",
            6,
            2,
            SamplingParams(max_tokens=10),
            {},
            "tcp",
            [1] * 6,
            r.name,
            forks=[Fork("zz", 1, 2)],
        ),
    )
    assert not acks[-1].is_accepted and "forks" in acks[-1].reason
    rx.receive(b"p", KVReserve("b", 6, 10, 1, ["b", "b1"]))  # its own id as a fork
    assert acks[-1].block_ids is None and "ids of their own" in acks[-1].reason
    many = DecodeScheduler(
        BlockAllocator(9), BS, 9
    )  # 8 blocks; each of 9 sequences: 1 shared + 1 own
    assert (
        "9 sequences need 10 KV blocks"
        in receiver(many).refusal("c", 7, 20, [f"c{i}" for i in range(8)])[0]
    )


def test_forks_first_tokens_equal_each_sampled_alone(tiny_model):
    prompt = [5, 17, 99, 3, 250, 41, 8]
    base = SamplingParams(max_tokens=4, temperature=1.0, seed=40, num_logprobs=2)
    with DeviceWorker(
        WorkerConfig(model=str(tiny_model), kv_cache_memory=2**20, block_size=BS)
    ) as w:
        alloc = BlockAllocator(w.num_kv_blocks)
        blocks = alloc.allocate(2)
        chunk = PrefillChunk(prompt, 0, blocks, base)
        chunk.fork_params = [dataclasses.replace(base, seed=40 + i) for i in range(1, 6)]
        (first,), _ = w.prefill([chunk])
        alone = []
        for i in range(6):
            c = PrefillChunk(prompt, 0, alloc.allocate(2), dataclasses.replace(base, seed=40 + i))
            (t,), _ = w.prefill([c])
            alone.append((t, c.logprobs))
        assert [(first, chunk.logprobs), *zip(chunk.fork_tokens, chunk.fork_logprobs)] == alone
        assert len(set(chunk.fork_tokens + [first])) > 1
        dst = alloc.allocate(2)
        w.copy_blocks(blocks, dst)
        assert torch.equal(w.export_blocks(blocks), w.export_blocks(dst))


def test_a_handoff_with_forks_through_both_halves():
    """Reserve with the fork ids, write, commit with their first tokens; a fork given up
    alone does not end the handoff, the last of them does; failures name every id."""
    p = Pair()
    job = p.job("r", prompt_len=10, max_tokens=4)
    job.forks = [Fork("r1", 7), Fork("r2", 8)]
    p.tx.begin(job)
    p.pump()
    assert p.rx.held["r"].fork_ids == ["r1", "r2"] and p.tx.holds("r2") and not p.tx.holds("r3")
    p.tx.abort("r")  # choice 0 given up: its forks still go
    assert "r" in p.tx.by_id
    p.tx.start_writes([job])
    p.pump()
    job.forks[0].first_token, job.forks[1].first_token = 11, 12
    p.tx.set_first_token(job, 10, {})
    p.pump()
    assert all(rid in p.tx.handed_off for rid in ("r", "r1", "r2")) and not p.failed
    r = p.rx.next_ready()
    assert [(f.request_id, f.seed, f.first_token) for f in r.commit.forks] == [
        ("r1", 7, 11),
        ("r2", 8, 12),
    ]
    lost = p.job("s", prompt_len=10)
    lost.forks = [Fork("s1", 1)]
    p.tx.begin(lost)
    p.tx.abort("s1")
    p.tx.abort("s")  # the last of them: the handoff ends, its blocks go back
    p.pump()
    assert "s" not in p.tx.by_id and "s" not in p.rx.held and not p.tx.holds("s1")
    failing = p.job("t", prompt_len=10)
    failing.forks = [Fork("t1", 1)]
    p.link.is_cut = p.data.is_cut = True  # its decode node never answers: every id fails, retryable
    p.tx.begin(failing)
    p.run_for(p.tx.handoff_lease_s + 1)
    assert {rid for rid, _ in p.failed} == {"t", "t1"} and p.retryable == {"t", "t1"}


def test_a_peer_cannot_claim_a_waiting_requests_id_as_a_fork():
    """Review: a request in line was not checked against the fork ids a later reserve named,
    so a hostile prefill node's request "x" with fork "b" (b waiting for blocks) queued
    behind b; on b's turn b was refused for good (its id was x's fork), and on x's turn x
    was granted holding b's id. A fork id naming a request in line is refused at once."""
    from common.wire.protocol import KVRelease

    sent = []
    sched = DecodeScheduler(BlockAllocator(41), BS, 8)
    rx = receiver(sched, send=lambda m, to: sent.append((to, m)) or True)
    rx.receive(b"p", KVReserve("a", 140, 8, 1))
    rx.receive(b"p", KVReserve("b", 20, 8, 2, ["b1"]))
    assert sent[-1][1].is_queued
    rx.receive(b"evil", KVReserve("x", 4, 4, 3, ["b"]))
    to, m = sent[-1]
    assert to == b"evil" and m.block_ids is None and "'b' is already on" in m.reason
    assert [w.request_id for w in rx.waiting] == ["b"]
    rx.receive(b"p", KVRelease("a", rx.held["a"].name))
    rx.turn()
    to, m = sent[-1]
    assert to == b"p" and m.request_id == "b" and m.block_ids
    assert "x" not in rx.held and rx.held["b"].fork_ids == ["b1"]
