"""KV transfer backends, in one process: after reserve -> write the decode
worker's reserved blocks equal the prefill worker's, and decoding goes on from
them exactly. Layouts, handles and frames that do not fit are refused with a
clear error."""
import dataclasses
import time

import pytest
import torch

from common.wire import protocol

from common import transfer
from common.base.config import WorkerConfig
from common.kv.blocks import BlockAllocator, num_blocks_for
from common.wire.protocol import KVBlocks
from common.base.request import SamplingParams
from common.kv.sequence import blocks_to_join
from common.engine.worker import DeviceWorker, PrefillChunk
from decode_node.scheduler import DecodeScheduler
from launch.generate import generate


def _wire(msg):
    """Through the real encoding, as the KV link carries it."""
    return protocol.decode([bytes(f) for f in protocol.encode(msg)])


@pytest.fixture
def workers(tiny_model):
    cfg = WorkerConfig(model=str(tiny_model), block_size=16, kv_cache_memory=2 * 2**20)
    with DeviceWorker(cfg) as pw, DeviceWorker(dataclasses.replace(cfg, is_cache_in_shm=True)) as dw:
        yield pw, dw


@pytest.mark.parametrize("backend", ["ipc", "tcp", "dist"])
def test_decode_blocks_equal_prefill_blocks_and_decoding_continues(workers, backend):
    pw, dw = workers
    prompt = list(range(3, 60))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    palloc = BlockAllocator(pw.num_kv_blocks)
    palloc.allocate(5)  # so the two nodes' block ids differ
    src = palloc.allocate(num_blocks_for(len(prompt), 16))
    (first,), _ = pw.prefill([PrefillChunk(prompt, 0, src, params)])

    sched = DecodeScheduler(BlockAllocator(dw.num_kv_blocks), 16, 4, 4)
    sched.blocks.allocate(2)
    r = sched.reserve("r", b"p", len(prompt), params.max_tokens, lease_s=10)
    offered = "dist" if backend == "dist" else "auto"   # auto never offers dist
    sink = transfer.KVSink(dw.kv_cache, dw.kv_shm_name, transfer.accepted_backends(offered, dw.device),
                           "127.0.0.1")
    frames = []
    writer = transfer.open_writer(backend, _wire(sink.welcome("e1")), pw.kv_cache,
                                  lambda m: frames.append(_wire(m)) or True)
    assert writer.name == backend
    writer.write("r", src, r.block_ids)
    done, num_frames, deadline = [], 0, time.monotonic() + 60
    while not (done and sink.is_landed("r")):   # dist: both sides join their group first
        assert time.monotonic() < deadline, "the write did not complete"
        done += writer.poll()
        for f in frames:
            sink.receive(b"p", f, r.block_ids)
        num_frames += len(frames)
        frames.clear()
    assert done == ["r"] and bool(num_frames) == (backend != "ipc")
    assert r.block_ids != src
    assert torch.equal(dw.kv_cache[:, :, r.block_ids], pw.kv_cache[:, :, src])

    sched.commit(r, protocol.KVCommit("r", len(prompt), first, params, {}, backend, prompt))
    seq = sched.start(sched.next_admissible(sink.is_landed))
    blocks_to_join(seq, 16, sched.blocks)
    dw.add_decode_seq("r", first, len(prompt), seq.block_ids, params)
    tokens = [first]
    for _ in range(params.max_tokens - 1):
        if dw.next_position("r") // 16 >= dw.num_blocks("r"):
            dw.append_block("r", seq.take_block(sched.blocks))
        tokens += dw.decode_step()
    assert tokens == generate(pw, [prompt], [params])[0]["token_ids"]
    dw.remove_decode_seq("r")
    sched.finish("r")
    sched.blocks.free([1, 2])
    assert sched.blocks.num_free == sched.blocks.capacity and sched.blocks.num_reserved == 0
    writer.close()
    sink.close()


def test_tcp_frames_are_a_group_of_layers_each(workers, monkeypatch):
    pw, dw = workers
    monkeypatch.setattr(transfer.tcp, "FRAME_BYTES", 1)  # one layer per frame
    src = [1, 2, 3]
    pw.kv_cache[:, :, src] = torch.randn_like(pw.kv_cache[:, :, src])
    frames = []
    writer = transfer.tcp.TcpWriter(pw.kv_cache, lambda m: frames.append(m) or True)
    writer.write("r", src, [7, 8, 9])
    assert writer.poll() == ["r"]
    assert [f.first_layer for f in frames] == list(range(pw.kv_cache.shape[0]))
    sink = transfer.KVSink(dw.kv_cache, None, ["tcp"], "127.0.0.1")
    for f in frames:
        sink.receive(b"p", _wire(f), [7, 8, 9])
    assert torch.equal(dw.kv_cache[:, :, [7, 8, 9]], pw.kv_cache[:, :, src])


def test_the_decode_cache_is_shared_memory_and_freed_on_close(tiny_model):
    import os
    cfg = WorkerConfig(model=str(tiny_model), kv_cache_memory=2**20, is_cache_in_shm=True)
    w = DeviceWorker(cfg).prepare()
    path = f"/dev/shm/{w.kv_shm_name}"
    assert os.path.exists(path)
    w.close()
    assert not os.path.exists(path)


def _welcome(dw, **change):
    sink = transfer.KVSink(dw.kv_cache, dw.kv_shm_name, ["ipc", "tcp"], "127.0.0.1")
    return dataclasses.replace(sink.welcome("e1"), **change)


def test_a_cache_of_another_layout_is_refused(workers):
    pw, dw = workers
    shape = list(dw.kv_cache.shape)
    for change in ({"cache_shape": [shape[0] + 1, *shape[1:]]}, {"dtype": "bfloat16"},
                   {"cache_shape": shape[:3] + [32] + shape[4:]}):
        with pytest.raises(transfer.TransferError, match="does not match"):
            transfer.open_writer("auto", _welcome(dw, **change), pw.kv_cache, lambda m: True)


def test_ipc_needs_the_same_host_and_a_real_segment(workers):
    pw, dw = workers
    assert transfer.open_writer("auto", _welcome(dw, host_id="elsewhere/1"), pw.kv_cache,
                                lambda m: True).name == "tcp"
    with pytest.raises(transfer.TransferError, match="another host"):
        transfer.open_writer("ipc", _welcome(dw, host_id="elsewhere/1"), pw.kv_cache, lambda m: True)
    for name in ("pdserve-kv-0-missing", "../etc/passwd", None):
        with pytest.raises(transfer.TransferError, match="segment"):
            transfer.open_writer("ipc", _welcome(dw, shm_name=name), pw.kv_cache, lambda m: True)
    with pytest.raises(transfer.TransferError, match="tcp"):
        transfer.open_writer("tcp", _welcome(dw, backends=["ipc"]), pw.kv_cache, lambda m: True)


def test_ipc_refuses_blocks_outside_the_decode_cache(workers):
    pw, dw = workers
    writer = transfer.open_writer("ipc", _welcome(dw), pw.kv_cache, lambda m: True)
    for dst in ([0], [dw.num_kv_blocks]):
        with pytest.raises(transfer.TransferError, match="outside"):
            writer.write("r", [1], dst)
    writer.close()


def test_a_frame_of_the_wrong_shape_or_dtype_is_refused(workers):
    pw, dw = workers
    sink = transfer.KVSink(dw.kv_cache, None, ["tcp"], "127.0.0.1")
    good = pw.kv_cache[:2, :, [1, 2]].clone()
    before = dw.kv_cache.clone()
    for kv, first_layer in ((good[:, :, :1], 0), (good.to(torch.float16), 0),
                            (good, dw.kv_cache.shape[0] - 1), (good.flatten(0, 1), 0),
                            (good[:, :, :, :8].contiguous(), 0)):
        with pytest.raises(transfer.TransferError, match="does not fit"):
            sink.receive(b"p", _wire(KVBlocks("r", first_layer, kv)), [5, 6])
    assert torch.equal(dw.kv_cache, before)
    with pytest.raises(transfer.TransferError, match="does not accept dist"):
        sink.receive(b"p", protocol.KVDist("r", "g", 1), [5, 6])


def test_a_dist_group_belongs_to_the_peer_that_made_it(workers):
    _, dw = workers
    sink = transfer.KVSink(dw.kv_cache, None, ["dist"], "127.0.0.1")
    assert sink.welcome("e").dist_store.startswith("127.0.0.1:")
    sink.receive(b"peer-a", protocol.KVDist("r1", "g", 1), [5, 6])
    with pytest.raises(transfer.TransferError, match="another prefill node"):
        sink.receive(b"peer-b", protocol.KVDist("r2", "g", 2), [7])
    with pytest.raises(transfer.TransferError, match="second KV announcement"):
        sink.receive(b"peer-a", protocol.KVDist("r1", "g", 3), [5, 6])
    assert not sink.is_landed("r1")   # posted, never sent: nothing lands in the cache
    sink.forget("r1")
    assert sink.is_landed("r1")
    sink.receive(b"peer-a", protocol.KVDist("r3", "g", 4), [8])
    sink.receive(b"peer-a", protocol.KVDist("r4", "g2", 1), [9])   # a new group replaces "g"
    assert sink.is_landed("r3") and "replaced" in sink.landing_error("r3")
    assert len(sink.dist._groups) == 1
    sink.close()


def test_copy_blocks_handles_scattered_ids():
    src = torch.randn(2, 2, 40, 4, 1, 3)
    dst = torch.zeros_like(src)
    s_ids = list(range(1, 40, 2))            # 20 runs: the gather path
    d_ids = list(range(39, 19, -1))
    transfer.copy_blocks(src, s_ids, dst, d_ids)
    assert torch.equal(dst[:, :, d_ids], src[:, :, s_ids])
    transfer.copy_blocks(src, [3, 4, 5], dst, [10, 11, 12])   # one run: a slice copy
    assert torch.equal(dst[:, :, 10:13], src[:, :, 3:6])
    with pytest.raises(transfer.TransferError):
        transfer.copy_blocks(src, [1, 2], dst, [3])


def test_auto_prefers_ipc_on_one_host():
    w = protocol.KVWelcome("e", transfer.host_id(), "cpu", [1, 2, 4, 16, 1, 8], "float32", ["ipc", "tcp"])
    assert transfer.choose_backend("auto", w, torch.device("cpu")) == "ipc"
    assert transfer.choose_backend("tcp", w, torch.device("cpu")) == "tcp"
    assert transfer.choose_backend("auto", dataclasses.replace(w, host_id="x/y"),
                                   torch.device("cpu")) == "tcp"
    assert transfer.accepted_backends("tcp", torch.device("cpu")) == ["tcp"]
    assert transfer.accepted_backends("auto", torch.device("cpu")) == ["ipc", "tcp"]   # never dist
    assert transfer.accepted_backends("dist", torch.device("cpu")) == ["dist"]
    with pytest.raises(ValueError):
        transfer.accepted_backends("smoke-signals", torch.device("cpu"))


def test_a_full_reservation_holds_every_block_until_released():
    sched = DecodeScheduler(BlockAllocator(20), 16, 4, 2, is_preemptive=False)
    r = sched.reserve("a", b"p", 40, 30, lease_s=0.0)
    assert len(r.block_ids) == 3 and r.num_reserved == num_blocks_for(69, 16) - 3
    assert sched.refusal("a", 40, 30)[1] is False              # a duplicate, for good
    assert sched.refusal("b", 300, 30)[1] is False             # never fits
    assert sched.refusal("b", 200, 100)[1] is True             # not now
    sched.reserve("b", b"p", 10, 5, lease_s=10)
    assert "queue is full" in sched.refusal("c", 10, 5)[0]
    assert sched.expired(float("inf")) == ["a", "b"] and sched.expired(0.0) == []
    sched.release("a")
    sched.release("b")
    assert sched.blocks.num_free == 19 and sched.blocks.num_reserved == 0


def test_no_write_starts_in_the_last_third_of_a_reservation_lease():
    """ipc writes straight into the decode node's memory: once the reservation may have
    ended there, its blocks may be another request's."""
    from prefill_node.handoff import DecodePeer, Handoff, Handoffs
    from prefill_node.scheduler import PrefillJob
    job = PrefillJob("r", [1] * 20, SamplingParams(max_tokens=4), 0.0, "decode-0", "tcp://127.0.0.1:1")
    peer = DecodePeer("decode-0", "tcp://127.0.0.1:1", channel=None, epoch="e", writer=object(), num_blocks=8)
    h = Handoff(job, peer, dst_block_ids=[3, 4], epoch="e", is_computed=True)
    now = time.monotonic()
    Handoffs._lease(h, now, 30.0)                      # just answered
    assert Handoffs._can_write(h) and h.renew_at > now + 9
    Handoffs._lease(h, now - 19, 30.0)                 # asked 19 s ago: 11 s left
    assert Handoffs._can_write(h)
    Handoffs._lease(h, now - 21, 30.0)                 # 9 s left: renew first
    assert not Handoffs._can_write(h)
    Handoffs._lease(h, now - 1000, 0.0)                # no lease: held until released
    assert Handoffs._can_write(h)


def test_a_reservation_lease_counts_from_the_request_it_answers():
    from prefill_node.handoff import DecodePeer, Handoff, Handoffs
    from prefill_node.scheduler import PrefillJob
    hs = Handoffs.__new__(Handoffs)
    hs.cache, hs.by_id = torch.zeros(1, 2, 4, 16, 1, 1), {}
    peer = DecodePeer("decode-0", "tcp://127.0.0.1:1", channel=None, epoch="e", writer=object(), num_blocks=8)
    job = PrefillJob("r", [1] * 20, SamplingParams(max_tokens=4), 0.0, "decode-0", "tcp://127.0.0.1:1")
    h = hs.by_id["r"] = Handoff(job, peer, is_computed=True)
    now = time.monotonic()
    h.reserve_sent.extend([now - 25, now - 1])     # two asked; answers come in that order
    hs._on_reserved(peer, protocol.KVReserved("r", "e", [3, 4], lease_s=30.0))
    assert job.is_reserved and h.dst_block_ids == [3, 4]
    assert abs(h.reserved_until - (now + 5)) < 0.1 and not Handoffs._can_write(h)   # from the older one
    hs._on_reserved(peer, protocol.KVReserved("r", "e", [3, 4], lease_s=30.0))    # the renewal's answer
    assert abs(h.reserved_until - (now + 29)) < 0.1 and Handoffs._can_write(h)
    hs._on_reserved(peer, protocol.KVReserved("r", "e", [3, 4], lease_s=30.0))    # asked by nobody
    assert h.reserved_until == float("-inf")   # grants nothing: the next turn asks again


def test_a_commit_the_decode_node_never_acknowledges_fails_its_request_and_releases_the_blocks():
    """Written and committed, then silence: after the handoff lease the request fails with
    a clear error, the reservation is released there, and a late answer is ignored."""
    from types import SimpleNamespace
    from prefill_node.handoff import DecodePeer, Handoff, Handoffs
    from prefill_node.scheduler import PrefillJob
    sent, failed = [], []
    channel = SimpleNamespace(send=lambda m, block=True: sent.append(m) or True)
    hs = Handoffs.__new__(Handoffs)
    hs.cfg, hs.peers, hs.by_id, hs.num_handoffs = SimpleNamespace(handoff_lease_s=10.0), {}, {}, 0
    hs.scheduler = SimpleNamespace(abort=lambda rid: None)
    hs.prefix_cache = BlockAllocator(8)
    hs.fail = lambda rid, error: failed.append((rid, error))
    peer = DecodePeer("decode-0", "tcp://127.0.0.1:1", channel=channel, epoch="e", num_blocks=8)
    job = PrefillJob("r", [1] * 20, SamplingParams(max_tokens=4), 0.0, "decode-0", "tcp://127.0.0.1:1")
    h = hs.by_id["r"] = Handoff(job, peer, dst_block_ids=[3, 4], epoch="e", first_token=7,
                                is_computed=True, is_written=True, is_commit_sent=True)
    h.lease_deadline = time.monotonic() + 60
    hs.advance()
    assert not failed and not sent and "r" in hs.by_id        # within the lease: waits
    h.lease_deadline = time.monotonic() - 0.01
    hs.advance()
    assert failed == [("r", "decode node did not confirm the KV handoff within 10s")]
    assert [type(m).__name__ for m in sent] == ["KVRelease"] and sent[0].request_id == "r"
    assert "r" not in hs.by_id
    hs._on_ack(peer, protocol.HandoffAck("r", True))            # too late: nobody's
    assert hs.num_handoffs == 0 and len(failed) == 1


def test_retryable_refusals_are_asked_again_less_and_less_often():
    """Past the decode node's waiting line, a backlog of prompts must not ask 20 times a
    second each; a place in line or a grant starts the count again."""
    from types import SimpleNamespace
    from prefill_node.handoff import MAX_RETRY_S, RETRY_S, DecodePeer, Handoff, Handoffs
    from prefill_node.scheduler import PrefillJob
    hs = Handoffs.__new__(Handoffs)
    hs.cfg, hs.by_id = SimpleNamespace(handoff_lease_s=10.0), {}
    hs.cache = torch.zeros(1, 2, 4, 16, 1, 1)
    peer = DecodePeer("decode-0", "tcp://127.0.0.1:1", channel=None, epoch="e", num_blocks=8)
    job = PrefillJob("r", [1] * 20, SamplingParams(max_tokens=4), 0.0, "decode-0", "tcp://127.0.0.1:1")
    h = hs.by_id["r"] = Handoff(job, peer)
    delays = []
    for _ in range(7):
        now = time.monotonic()
        hs._on_reserved(peer, protocol.KVReserved("r", "e", None, True, "line full"))
        delays.append(h.next_reserve_at - now)
    expected = [min(RETRY_S * 2 ** i, MAX_RETRY_S) for i in range(7)]
    assert all(abs(d - e) < 0.01 for d, e in zip(delays, expected)) and delays[-1] < 1.0
    hs._on_reserved(peer, protocol.KVReserved("r", "e", None, reason="waiting", is_queued=True, lease_s=30.0))
    assert h.is_queued and h.num_refusals == 0
    now = time.monotonic()
    hs._on_reserved(peer, protocol.KVReserved("r", "e", None, True, "line full"))
    assert abs(h.next_reserve_at - now - RETRY_S) < 0.01
    hs._on_reserved(peer, protocol.KVReserved("r", "e", [3, 4], lease_s=30.0))
    assert job.is_reserved and h.num_refusals == 0
