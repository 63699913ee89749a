"""A grant's blocks are written only while the grant holds, and a write stopped at its
deadline leaves both halves consistent: the sender and receiver on a fake clock, with the
ipc writer copying into a shared-memory decode cache as a prefill node on its host does."""

from __future__ import annotations

import pytest
import torch

from common.base.request import SamplingParams
from common.handoff.states import Hold, Stage
from common.kv.blocks import BlockAllocator
from common.kv.prefix import PrefixCache, block_hashes
from common.transfer import TransferError
from common.wire.protocol import Fork, KVCommit, KVRelease, KVReserve, KVTransfer
from decode_node.scheduler import DecodeScheduler
from tests.handoff_util import PREFILL, Pair, receiver, reserve, start_all


def _layerwise_ipc(prompt_len: int = 22):
    """A chunked prompt's write pushed layer by layer over ipc, its first pass's first
    layer written: (pair, job, handoff)."""
    p = Pair(layerwise="on", lease_s=30.0, backend="ipc")
    job = p.job("r", prompt_len=prompt_len)
    p.tx.begin(job)
    p.pump()
    h = p.tx.by_id["r"]
    assert h.stage is Stage.RESERVED and h.peer.writer.name == "ipc"
    p.tx.push_layers([(job, 2)], 1)
    assert h.stage is Stage.WRITING
    return p, job, h


def test_a_layer_pushed_past_the_grants_deadline_is_never_written():
    """Defect: a layer-wise ipc write went on after its grant ended (the deadline was not
    checked once a write was under way): a pass longer than the lease let the decode node
    give the blocks to another request while the pass kept copying into them."""
    p, job, h = _layerwise_ipc()
    dst = h.dst_block_ids
    p.clock.advance(p.lease_s + 1)  # a pass (or a pause) longer than the lease
    p.rx.turn()  # the decode node's lease ends
    r = p.rx.held["r"]
    assert r.is_quarantined and r.hold is Hold.FAILED  # its blocks wait for the writer to stop
    reserve(p.rx, "other", 12, 4, sender=PREFILL)  # another request's grant, meanwhile
    assert not set(p.rx.held["other"].block_ids) & set(dst)
    before = p.dst[:, :, dst].clone()
    p.src[:, :, job.block_ids] = 9.0  # the pass goes on: layer 2, and the rest
    p.tx.push_layers([(job, 2)], 2)
    p.tx.start_writes([])
    assert torch.equal(p.dst[:, :, dst], before)  # nothing landed past the deadline
    assert h.stage is Stage.CANCELLING
    p.pump()  # the write ends; its release frees them there
    assert p.failed == [
        (
            "r",
            "KV transfer to decode-0 failed: its reservation could end before these "
            "layers are written: stopped",
        )
    ] and p.retryable == {"r"}
    assert "r" not in p.rx.held and "r" not in p.tx.by_id
    p.close()


def test_a_write_cancelled_at_its_deadline_leaves_the_next_pass_nothing_to_trip_on():
    """Defect: the deadline's cancel left the handoff WRITING while ipc forgot the write:
    the next pass's push raised KeyError (the prefill node's loop died), and the cancel was
    reported a success, so the prompt's blocks were freed while it was still chunked."""
    p, job, h = _layerwise_ipc()
    num_free = p.prefix.num_free
    p.clock.advance(h.write_deadline - p.clock() + 0.1)
    p.tx.advance()  # the deadline: the write is stopped
    assert h.stage is Stage.CANCELLING
    p.tx.push_layers([(job, 2)], 2)  # the next pass: no KeyError, nothing written
    p.tx.start_writes([job])
    p.tx.advance()  # ended: failed (retryable), never committed
    assert p.failed and p.retryable == {"r"} and p.sent(KVCommit) == 0
    assert "r" not in p.tx.by_id and job.block_ids == []
    assert p.prefix.num_free == num_free + 6  # its 6 blocks freed once, not twice
    p.pump()
    assert "r" not in p.rx.held and p.pool.prefix_cache.num_free == p.pool.prefix_cache.capacity
    p.close()


def test_a_quarantined_grant_is_freed_by_its_writers_release_or_one_more_lease():
    p = Pair(lease_s=30.0)
    r = reserve(p.rx, "a", 10, 4, sender=PREFILL)
    p.clock.advance(31)
    p.rx.turn()
    assert r.is_quarantined and "a" in p.rx.held and p.rx.num_expired == 1
    answer = []
    p.rx.send = lambda msg, to: answer.append(msg) or True
    p.rx.receive(PREFILL, KVReserve("a", 10, 4, 7))  # asked again: not renewed
    assert (
        answer[-1].block_ids is None and answer[-1].is_retryable and "ran out" in answer[-1].reason
    )
    p.rx.receive(PREFILL, KVRelease("a", r.name))  # its writer says it stopped
    assert "a" not in p.rx.held
    s = reserve(p.rx, "b", 10, 4, sender=PREFILL)
    p.clock.advance(31)
    p.rx.turn()
    p.clock.advance(29)
    p.rx.turn()
    assert "b" in p.rx.held and s.is_quarantined
    p.clock.advance(2)
    p.rx.turn()  # no word from its writer: one more lease
    assert "b" not in p.rx.held and p.rx.num_expired == 2
    assert p.pool.prefix_cache.num_free == p.pool.prefix_cache.capacity


def test_a_release_frees_only_the_grant_it_names():
    """Defect: KVRelease named only the request: a late release meant for an earlier grant
    (a reset link, a restarted decode node) freed the request's new grant, and its commit
    was refused "no reservation for this request"."""
    pool = DecodeScheduler(BlockAllocator(20), 16, 4)
    rx = receiver(pool)
    first = reserve(rx, "r", 20, 4)
    name = first.name
    rx.receive(b"p", KVRelease("r", name))
    second = reserve(rx, "r", 20, 4)
    assert second.name != name
    rx.receive(b"p", KVRelease("r", name))  # the first grant's, late
    rx.receive(b"p", KVRelease("r"))  # one naming no grant: a place in line only
    assert rx.held["r"] is second
    rx.receive(b"p", KVRelease("r", second.name))
    assert "r" not in rx.held and pool.prefix_cache.num_free == pool.prefix_cache.capacity


def test_a_commit_for_a_grant_gone_is_refused_retryable():
    """The path failed, not the request: it may go on elsewhere."""
    sent = []
    rx = receiver(
        DecodeScheduler(BlockAllocator(20), 16, 4), lambda msg, to: sent.append(msg) or True
    )
    rx.receive(
        b"p", KVCommit("r", 20, 1, SamplingParams(max_tokens=4), {}, "tcp", [1] * 20, "0123")
    )
    assert (
        not sent[-1].is_accepted and sent[-1].is_retryable and "no reservation" in sent[-1].reason
    )
    rx.abort("q")
    rx.receive(
        b"p", KVCommit("q", 20, 1, SamplingParams(max_tokens=4), {}, "tcp", [1] * 20, "0123")
    )
    assert not sent[-1].is_accepted and not sent[-1].is_retryable and "aborted" in sent[-1].reason


def test_forks_of_a_request_whose_kv_failed_never_reach_the_prefix_cache():
    """Defect: forks were made cacheable whatever their request's KV: once the request let
    go, the last fork to finish published the prompt's blocks, whose KV had not landed
    (or failed --kv-verify), for a later prompt or chat turn on that node to reuse."""
    cache = PrefixCache(41, True)
    sched = DecodeScheduler(cache, 4, 8)
    rx = receiver(sched)
    _commit_group(rx, "a", ["a1", "a2"], prompt=list(range(1, 9)))
    got = rx.next_ready()
    got.error = "its KV does not hold what the prefill node wrote (--kv-verify)"
    seqs, _ = start_all(sched, got)
    assert not any(s.is_cacheable for s in seqs)
    for s in seqs:
        s.output_ids += [5, 6]
        sched.finish(s.request_id)
    assert not any(h in cache.block_of for h in block_hashes(list(range(1, 9)), 4))


def _commit_group(
    rx,
    rid: str,
    fork_ids: list[str],
    prompt=(1,) * 8,
    max_tokens: int = 6,
    params: SamplingParams | None = None,
) -> None:
    """Request rid with forks reserved, its KV written (zeros) and committed."""
    params = params or SamplingParams(max_tokens=max_tokens)
    rx.receive(b"p", KVReserve(rid, len(prompt), max_tokens, 1, list(fork_ids)))
    r = rx.held[rid]
    c = rx.sink.cache
    rx.receive(
        b"p",
        KVTransfer(
            rid,
            r.name,
            "tcp",
            {"first_layer": 0},
            torch.zeros(c.shape[0], 2, len(r.block_ids), *c.shape[3:]),
        ),
    )
    forks = [Fork(f, 10 + i, first_token=3) for i, f in enumerate(fork_ids)]
    rx.receive(
        b"p",
        KVCommit(
            rid, len(prompt), 2, params, {}, "tcp", list(prompt), r.name, c.shape[0], forks=forks
        ),
    )


def test_a_group_of_n_starts_what_fits_and_the_rest_take_the_next_rows_first():
    """Defect: a request with n - 1 forks was admitted when one row was free: the batch
    overflowed ("decode batch is full") and the decode node died. Now the sequences that
    fit start, the rest wait at the head holding their blocks and take the next rows that
    free, before anything admitted after them (a steady load cannot starve them); n above
    the node's rows is refused for good."""
    sched = DecodeScheduler(BlockAllocator(80), 4, 4)
    rx = receiver(sched)
    why = rx.refusal("big", 8, 6, ["f1", "f2", "f3", "f4"])
    assert why == (
        "its 5 sequences (n) need 5 batch rows, this decode node has 4 (--max-batch-size)",
        False,
    )
    _commit_group(rx, "lone", [])
    _commit_group(rx, "g", ["g1", "g2", "g3"])
    _commit_group(rx, "late", [])
    start_all(sched, rx.next_ready())  # "lone" runs: 3 rows free, the group is 4
    started, _ = sched.start(rx.next_ready())
    sched.joining.extend(started)
    joined = []
    while (j := sched.next_joining()) is not None:
        joined.append(sched.admit(j.seq).request_id)
    assert joined == ["g", "g1", "g2"] and [j.seq.request_id for j in sched.joining] == ["g3"]
    assert not sched.can_admit()  # "late" waits behind g3, though rows may free
    sched.finish("lone")
    assert sched.next_joining().seq.request_id == "g3" and sched.can_admit()
    assert rx.has_ready() and rx.ready[0] == "late"
    gone = sched.drop_joining("nobody")
    assert gone is None


def test_a_sequence_waiting_for_a_row_cannot_be_reserved_again():
    """Defect: a started sequence waiting for a row (joining) was no longer held by the
    handoff, and the scheduler's checks did not see it: a KVReserve naming its id was
    granted, and the second copy overwrote the first's row (its blocks leaked; adding the
    id to the batch twice raises)."""
    sched = DecodeScheduler(BlockAllocator(80), 4, 2)
    rx = receiver(sched)
    _commit_group(rx, "g", ["g1"])
    _commit_group(rx, "lone", [])
    start_all(sched, rx.next_ready())
    started, _ = sched.start(rx.next_ready())
    sched.joining.extend(started)
    assert rx.refusal("lone", 8, 6) == ("request 'lone' is already on this decode node", False)


def test_a_commit_for_a_quarantined_grant_is_refused_retryable():
    """The grant ran out under a paused prefill process (the path failed, not the request):
    the request may go on elsewhere, as it may when the grant is gone altogether."""
    p = Pair(backend="ipc", lease_s=6.0, handoff_lease_s=10.0)
    job = p.job("r")
    p.tx.begin(job)
    p.pump()
    p.tx.start_writes([job])
    p.tx.set_first_token(job, 1, {})
    p.clock.advance(7)  # paused past the lease before its commit went out
    p.rx.turn()
    assert p.rx.held["r"].is_quarantined
    p.pump()
    assert p.failed and p.retryable == {"r"} and "r" not in p.rx.held
    p.close()


def test_a_grant_that_ran_out_before_its_write_is_released_at_once():
    """Defect: the prefill side dropped a grant that ran out before its write without a
    word: the decode node held its blocks (and refused the request) a lease more, as it
    must for a writer that might still copy."""
    p = Pair(lease_s=30.0)
    job = p.job("r")
    p.tx.begin(job)
    p.pump()
    first = p.tx.by_id["r"].reservation
    p.clock.advance(31)  # paused before its prefill: no write began
    p.rx.turn()
    p.pump()
    h = p.tx.by_id["r"]
    assert h.stage is Stage.RESERVED and h.reservation != first  # reserved again at once
    assert not p.failed and p.rx.held["r"].name == h.reservation


def test_an_ipc_write_stopped_part_way_leaves_nothing_open():
    p = Pair(backend="ipc", lease_s=30.0)
    job = p.job("r")
    p.tx.begin(job)
    p.pump()
    h = p.tx.by_id["r"]
    w = h.peer.writer
    times = iter([0.0, 100.0, 100.0])  # past its deadline after the first layer
    w.clock = lambda: next(times)
    with pytest.raises(TransferError, match="stopped at its deadline"):
        w.write("r", h.reservation, job.block_ids, h.dst_block_ids, within_s=1.0)
    assert not w._open and not w.poll()
    p.close()
