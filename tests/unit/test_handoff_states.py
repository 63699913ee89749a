"""The handoff's two halves, joined by an in-memory KV link on a fake clock:
reserve -> write -> commit, leases renewed every third, the waiting line,
aborts under a write, restarts, silence, refusals. Each side's state is read
from its enum (Stage on the prefill side, Hold on the decode side)."""

from __future__ import annotations

import pytest
import torch

from common import transfer
from common.base.request import SamplingParams
from common.handoff import asks
from common.handoff.asks import MAX_RETRY_S, RETRY_S
from common.handoff.lease import Lease
from common.handoff.states import Hold, Stage
from common.kv.blocks import BlockAllocator, num_blocks_for
from common.wire import protocol
from common.wire.protocol import HandoffAck, KVCommit, KVRelease, KVReserve, KVReserved
from decode_node.scheduler import DecodeScheduler
from tests.handoff_util import PREFILL, Pair, receiver, reserve


def _handoff(p: Pair, rid: str, **job):
    j = p.job(rid, **job)
    p.tx.begin(j)
    p.pump()
    return j, p.tx.by_id[rid]


def test_reserve_write_commit_lands_the_blocks_and_frees_them_here():
    p = Pair()
    num_free = p.prefix.num_free
    job, h = _handoff(p, "r", prompt_len=10)
    src = list(job.block_ids)
    r = p.rx.held["r"]
    assert h.stage is Stage.RESERVED and job.is_reserved and r.hold is Hold.RESERVED
    assert h.dst_block_ids == r.block_ids and len(r.block_ids) == num_blocks_for(10, 4)
    p.tx.start_writes([job])
    assert h.stage is Stage.WRITING
    p.pump()
    assert h.stage is Stage.WRITTEN and job.block_ids == [] and p.prefix.num_free == num_free
    assert torch.equal(p.dst[:, :, r.block_ids], p.src[:, :, src])  # the frames landed
    p.tx.set_first_token(job, 7, {"prefill_end": 1.0})
    assert h.stage is Stage.COMMITTED
    p.pump()
    assert "r" not in p.tx.by_id and p.tx.num_handoffs == 1 and not p.failed
    got = p.rx.next_ready()
    assert got is r and got.error is None and got.commit.first_token == 7 and "r" not in p.rx.held
    assert p.tx.bytes_written == len(src) * p.src[:, :, :1].numel() * 4


def test_the_first_token_may_come_before_the_write_ends():
    p = Pair()
    job, h = _handoff(p, "r")
    p.tx.set_first_token(job, 5, {})
    assert h.stage is Stage.RESERVED  # nothing to commit before the write
    p.tx.start_writes([job])
    p.pump()
    assert "r" not in p.tx.by_id and p.rx.next_ready().commit.first_token == 5


def test_renewals_every_third_keep_a_reservation_past_its_lease_and_silence_frees_it():
    p = Pair(lease_s=30.0, handoff_lease_s=10.0)
    job, h = _handoff(p, "r")
    num_asks = p.sent(KVReserve)
    p.run_for(100)  # three leases: renewed about every 10 s
    assert p.rx.held["r"].hold is Hold.RESERVED and h.stage is Stage.RESERVED
    assert 9 <= p.sent(KVReserve) - num_asks <= 11
    p.link.is_cut = p.data.is_cut = True  # the decode node hears nothing more
    p.run_for(9.5)  # silence counts from the first unanswered ask
    assert not p.failed and "r" in p.rx.held
    p.run_for(15)
    assert p.failed == [("r", "decode node decode-0 did not answer for a reservation within 10s")]
    assert "r" not in p.tx.by_id and job.block_ids == []
    p.run_for(30)  # the decode node's lease ends too: its blocks are
    assert p.rx.held["r"].is_quarantined  # held a lease more (a writer never heard from might
    p.run_for(30)  # copy into them unseen, as ipc does)
    assert "r" not in p.rx.held and p.rx.num_expired == 1
    assert p.pool.prefix_cache.num_free == p.pool.prefix_cache.capacity


def test_no_write_starts_in_the_last_third_of_the_lease():
    """ipc writes straight into the decode node's memory: once the reservation may have
    ended there, its blocks may be another request's."""
    p = Pair(lease_s=30.0, handoff_lease_s=100.0)
    a, ha = _handoff(p, "a")
    b, hb = _handoff(p, "b")
    p.link.is_cut = p.data.is_cut = True  # renewals are lost
    p.run_for(19)
    p.tx.start_writes([a])
    assert ha.stage is Stage.WRITING  # 11 s of the lease left: writes
    p.run_for(2)
    p.tx.start_writes([b])
    assert hb.stage is Stage.RESERVED  # 9 s left: renew first
    p.run_for(10)
    assert hb.stage is Stage.ASKING and not b.is_reserved  # ran out: asked again


def test_the_lease_counts_from_the_ask_it_answers():
    lease = Lease(1000.0, 30.0)
    assert (lease.end, lease.renew_at, lease.write_by, lease.write_deadline) == (
        1030.0,
        1010.0,
        1020.0,
        1025.0,
    )
    assert Lease(5.0, 0.0).end == Lease(5.0, 0.0).write_by == float("inf")  # held until released
    p = Pair()
    job = p.job("r")
    p.tx.begin(job)
    h = p.tx.by_id["r"]
    p.clock.advance(24)
    asks.ask(p.tx, h)  # two asks out, numbered
    p.clock.advance(1)
    first, second = sorted(h.asks)
    peer = h.peer

    def grant(ask: int) -> KVReserved:
        return KVReserved("r", "e1", [3, 4, 5], lease_s=30.0, ask=ask, reservation="g1")

    p.tx._on_reserved(peer, grant(first))
    assert job.is_reserved and h.lease.end == pytest.approx(p.clock() + 5)  # from the older ask
    p.tx._on_reserved(peer, grant(second))
    assert h.lease.end == pytest.approx(p.clock() + 29)  # the renewal's answer
    p.tx._on_reserved(peer, grant(first))  # a repeat of an older answer shortens nothing
    assert h.lease.end == pytest.approx(p.clock() + 29)
    # Answers out of order (one lost, one late): each counts from its own ask, never a later one.
    job2 = p.job("s")
    p.tx.begin(job2)
    h2 = p.tx.by_id["s"]
    p.clock.advance(10)
    asks.ask(p.tx, h2)
    early, late = sorted(h2.asks)
    p.tx._on_reserved(
        peer, KVReserved("s", "e1", [6, 7, 8], lease_s=30.0, ask=early, reservation="g2")
    )
    assert h2.lease.end == pytest.approx(p.clock() + 20)
    fresh = p.job("t")
    p.tx.begin(fresh)
    p.tx._on_reserved(
        peer, KVReserved("t", "e1", [9, 10, 11], lease_s=30.0, ask=10**6, reservation="g3")
    )
    assert p.tx.by_id["t"].lease.end == float(
        "-inf"
    )  # asked by nobody: grants nothing, asked again


def test_a_full_decode_node_queues_requests_and_grants_them_unasked_in_order():
    p = Pair(num_decode_blocks=8, lease_s=30.0)
    big, hb = _handoff(p, "big", prompt_len=24)  # 7 blocks with its first output's
    a, ha = _handoff(p, "a", prompt_len=8)
    b, hbb = _handoff(p, "b", prompt_len=8)
    assert hb.stage is Stage.RESERVED and ha.stage is hbb.stage is Stage.QUEUED
    assert [w.request_id for w in p.rx.waiting] == ["a", "b"]
    p.run_for(25)  # the line keeps its place by asking
    assert ha.stage is Stage.QUEUED and len(p.rx.waiting) == 2
    p.tx.abort("big")
    p.pump()
    assert "big" not in p.rx.held and p.rx.num_granted == 2 and not p.rx.waiting
    assert ha.stage is hbb.stage is Stage.RESERVED and set(ha.dst_block_ids).isdisjoint(
        hbb.dst_block_ids
    )
    for j in (a, b):
        p.tx.start_writes([j])
        p.tx.set_first_token(j, 3, {})
    p.pump()
    assert not p.tx.by_id and [p.rx.next_ready().request_id for _ in range(2)] == ["a", "b"]


def test_an_abort_during_a_write_waits_for_it_then_releases_both_sides():
    p = Pair()
    num_free = p.prefix.num_free
    job, h = _handoff(p, "r")
    p.tx.start_writes([job])
    p.tx.abort("r")
    assert h.stage is Stage.CANCELLING and job.block_ids and "r" in p.rx.held  # still read
    p.pump()
    assert "r" not in p.tx.by_id and "r" not in p.rx.held and not p.failed
    assert p.sent(KVRelease) == 1 and p.sent(KVCommit) == 0
    assert p.prefix.num_free == num_free
    assert p.pool.prefix_cache.num_free == p.pool.prefix_cache.capacity


def test_an_abort_on_the_decode_node_refuses_the_commit_and_frees_the_blocks():
    p = Pair()
    job, h = _handoff(p, "r")
    p.rx.abort("r")
    assert p.rx.held["r"].hold is Hold.FAILED  # its prefill node may be writing
    p.tx.start_writes([job])
    p.tx.set_first_token(job, 3, {})
    p.pump()
    assert p.failed == [("r", "decode node refused the request: the request was aborted")]
    assert "r" not in p.rx.held and p.pool.prefix_cache.num_free == p.pool.prefix_cache.capacity
    assert not p.retryable  # the request's own ending: the frontend must not move it


def test_a_restarted_decode_node_voids_reservations_and_fails_what_was_written_there():
    p = Pair()
    queued, hq = _handoff(p, "q")
    written, hw = _handoff(p, "w")
    p.tx.start_writes([written])
    p.pump()
    assert hq.stage is Stage.RESERVED and hw.stage is Stage.WRITTEN
    p.start_decode("e2")  # the same address, a new life
    p.link.to_prefill.append([bytes(f) for f in protocol.encode(p.rx.sink.welcome("e2"))])
    p.pump()
    assert hq.stage is Stage.RESERVED and hq.epoch == "e2" and p.rx.held["q"].hold is Hold.RESERVED
    assert p.failed == [("w", "decode node decode-0 restarted before the handoff was committed")]
    assert "w" not in p.rx.held
    assert p.retryable == {"w"}  # the path's failure: the frontend may move it


def test_a_commit_never_acknowledged_fails_its_request_and_releases_the_blocks():
    p = Pair(handoff_lease_s=10.0)
    job, h = _handoff(p, "r")
    p.tx.start_writes([job])
    p.pump()
    p.link.is_cut = p.data.is_cut = True  # the commit and its answer are lost
    p.tx.set_first_token(job, 7, {})
    p.run_for(9.5)
    assert not p.failed and h.stage is Stage.COMMITTED
    p.run_for(1)
    assert p.failed == [("r", "decode node did not confirm the KV handoff within 10s")]
    assert p.retryable == {"r"}
    assert isinstance(p.link.sent[-1], KVRelease) and "r" not in p.tx.by_id
    p.tx._on_ack(h.peer, HandoffAck("r", True))  # too late: nobody's
    assert p.tx.num_handoffs == 0 and len(p.failed) == 1


def test_retryable_refusals_are_asked_again_less_and_less_often():
    """Past the decode node's waiting line, a backlog of prompts must not ask 20 times a
    second each; a place in line or a grant starts the count again."""
    p = Pair()
    job = p.job("r")
    p.tx.begin(job)
    h, peer = p.tx.by_id["r"], p.tx.by_id["r"].peer
    delays = []
    for _ in range(7):
        p.tx._on_reserved(peer, KVReserved("r", "e1", None, True, "line full"))
        delays.append(h.next_ask_at - p.clock())
    assert (
        delays == pytest.approx([min(RETRY_S * 2**i, MAX_RETRY_S) for i in range(7)])
        and delays[-1] < 1.0
    )
    p.tx._on_reserved(
        peer, KVReserved("r", "e1", None, reason="waiting", is_queued=True, lease_s=30.0)
    )
    assert (
        h.stage is Stage.QUEUED
        and h.num_refusals == 0
        and h.next_ask_at == pytest.approx(p.clock() + 10)
    )
    p.tx._on_reserved(peer, KVReserved("r", "e1", None, True, "line full"))
    assert h.next_ask_at - p.clock() == pytest.approx(RETRY_S)
    p.tx._on_reserved(peer, KVReserved("r", "e1", [3, 4, 5], lease_s=30.0))
    assert job.is_reserved and h.num_refusals == 0


def test_a_reservation_of_the_wrong_size_is_refused_and_released():
    p = Pair()
    job = p.job("r")
    p.tx.begin(job)
    p.tx._on_reserved(p.tx.by_id["r"].peer, KVReserved("r", "e1", [3, 3, 4], lease_s=30.0))
    assert p.failed and "not one distinct block per prompt block" in p.failed[0][1]
    assert isinstance(p.link.sent[-1], KVRelease) and p.tx.num_bad_replies == 1


def test_a_full_reservation_holds_every_block_until_released():
    pool = DecodeScheduler(BlockAllocator(20), 16, 4, is_preemptive=False)
    rx = receiver(pool, max_queue=2)
    r = reserve(rx, "a", 40, 30)
    assert len(r.block_ids) == 3 and r.num_reserved == num_blocks_for(69, 16) - 3
    assert rx.refusal("a", 40, 30)[1] is False  # a duplicate, for good
    assert rx.refusal("b", 300, 30)[1] is False  # never fits
    assert rx.refusal("b", 200, 100)[1] is True  # not now
    reserve(rx, "b", 10, 5)
    assert "queue is full" in rx.refusal("c", 10, 5)[0]
    rx.peer_backends[b"p"] = (
        "tcp"  # a writer whose late KV lands only through this node: freed at once
    )
    rx.clock = lambda: float("inf")
    rx.turn()  # both leases end
    assert rx.num_expired == 2 and not rx.held
    assert pool.prefix_cache.num_free == 19 and pool.prefix_cache.num_reserved == 0


def test_only_the_prefill_node_that_reserved_may_commit_or_release():
    pool = DecodeScheduler(BlockAllocator(20), 16, 4)
    sent = []
    rx = receiver(pool, lambda msg, to: sent.append((to, msg)) or True)
    reserve(rx, "r", 20, 4, sender=PREFILL)
    rx.receive(b"other", KVRelease("r"))
    rx.receive(b"other", KVCommit("r", 20, 1, SamplingParams(max_tokens=4), {}, "tcp", [1] * 20))
    assert rx.held["r"].hold is Hold.RESERVED
    assert sent[-1] == (
        b"other",
        HandoffAck("r", False, True, "no reservation for this request (expired or released)"),
    )
    rx.receive(
        PREFILL, KVCommit("r", 20, 1, SamplingParams(max_tokens=4), {}, "tcp", [1] * 19 + [100])
    )
    assert "outside the vocabulary" in sent[-1][1].reason and "r" not in rx.held


def test_a_write_its_writer_reports_failed_fails_retryable_and_frees_both_sides():
    """A one-sided backend (nixl) says so in poll(): the request may move, the local
    blocks are freed, and the reservation there is released."""
    p = Pair()
    num_free = p.prefix.num_free
    job, h = _handoff(p, "r")
    writer = h.peer.writer
    polled = writer.poll
    writer.poll = lambda: [(rid, "NIXL: NIXL_ERR_REMOTE_DISCONNECT") for rid, _ in polled()]
    p.tx.start_writes([job])
    p.tx.set_first_token(job, 7, {})
    p.pump()
    assert p.failed == [("r", "KV transfer to decode-0 failed: NIXL: NIXL_ERR_REMOTE_DISCONNECT")]
    assert p.retryable == {"r"} and "r" not in p.tx.by_id and p.sent(KVCommit) == 0
    assert p.sent(KVRelease) == 1 and "r" not in p.rx.held
    assert (
        p.prefix.num_free == num_free
        and p.pool.prefix_cache.num_free == p.pool.prefix_cache.capacity
    )
    assert p.tx.transfer_figures()["tcp"]["num_failed"] == 1


def test_an_abort_under_a_write_stops_the_write_and_frees_the_blocks_when_it_ends():
    """A write that can be stopped (nixl to a silent peer) is told to stop when its
    handoff ends; what it reports then is the abort's ending, not a failure."""
    p = Pair()
    num_free = p.prefix.num_free
    job, h = _handoff(p, "r")
    writer = h.peer.writer
    polled, cancelled = writer.poll, []
    writer.cancel = cancelled.append
    writer.poll = lambda: [(rid, "cancelled") for rid in cancelled] if cancelled else []
    p.tx.start_writes([job])
    p.pump()
    assert h.stage is Stage.WRITING  # the peer went silent: the write hangs
    p.tx.abort("r")
    assert cancelled == ["r"] and h.stage is Stage.CANCELLING and job.block_ids
    p.pump()
    assert "r" not in p.tx.by_id and not p.failed and p.prefix.num_free == num_free
    assert (
        p.sent(KVRelease) == 1 and p.tx.transfer_figures().get("tcp", {}).get("num_failed", 0) == 0
    )
    writer.poll = polled


def test_transfer_figures_count_writes_bytes_time_and_failures():
    from common.wire.figures import BUCKET_KEYS, WRITE_BUCKETS_S

    p = Pair()
    job, h = _handoff(p, "r")
    p.tx.start_writes([job])
    p.clock.advance(0.003)  # the write takes 3 ms by the clock
    p.pump()
    f = p.tx.transfer_figures()["tcp"]
    assert (f["num_transfers"], f["num_bytes"], f["num_failed"]) == (1, 3 * p.tx.block_bytes, 0)
    assert f["write_s_sum"] == pytest.approx(0.003)
    counts = [f[k] for k in BUCKET_KEYS]
    assert (
        f["write_s_le_0.005"] == 1 and sum(counts) == 1 and len(counts) == len(WRITE_BUCKETS_S) + 1
    )
    # As a heartbeat carries them: within the codec's bounds on a node's figures.
    beat = protocol.Heartbeat("prefill", "prefill-0", {"kv_writes": p.tx.transfer_figures()}, 1)
    reply = protocol.StatsReply(True, {"prefill-0": beat.stats})
    for m in (beat, reply):
        assert protocol.decode([bytes(x) for x in protocol.encode(m)]) == m
    bad, hb = _handoff(p, "bad")
    hb.peer.num_blocks = 1  # its reserved ids no longer fit: refused at the start
    p.tx.start_writes([bad])
    assert p.tx.transfer_figures()["tcp"]["num_failed"] == 1 and hb.stage is Stage.CANCELLED


def test_a_cache_that_cannot_be_opened_fails_only_what_its_process_answered():
    """A welcome from a decode node on its way out (a drain: its cache already gone)
    fails the handoffs that node answered, releasing their blocks; one its restarted
    successor answers waits for the successor's welcome and lands."""
    p = Pair()
    opened = p.tx.links.open_writer

    def gone_in_e1(welcome, send):
        if welcome.epoch == "e1":
            raise transfer.TransferError("cannot open the decode node's KV cache: no such segment")
        return opened(welcome, send)

    p.tx.links.open_writer = gone_in_e1
    p.tx.begin(p.job("a"))
    p.pump()
    assert p.failed == [
        (
            "a",
            "cannot hand KV to decode node decode-0: cannot open the decode node's "
            "KV cache: no such segment",
        )
    ]
    assert "a" not in p.rx.held and p.pool.prefix_cache.num_free == p.pool.prefix_cache.capacity
    p.start_decode("e2")  # the successor, at the same address
    p.clock.advance(1.0)  # past the hello interval
    job, h = _handoff(p, "b")
    assert h.stage is Stage.RESERVED and h.epoch == "e2" and h.peer.writer is not None
    p.tx.start_writes([job])
    p.tx.set_first_token(job, 3, {})
    p.pump()
    assert len(p.failed) == 1 and p.rx.held["b"].hold is Hold.COMMITTED
