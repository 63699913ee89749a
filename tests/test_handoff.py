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
from common.handoff.receiver import Receiver
from decode_node.scheduler import DecodeScheduler
from tests.handoff_util import reserve
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

    sched = DecodeScheduler(BlockAllocator(dw.num_kv_blocks), 16, 4)
    sched.blocks.allocate(2)
    offered = "dist" if backend == "dist" else "auto"   # auto never offers dist
    sink = transfer.KVSink(dw.kv_cache, dw.kv_shm_name, transfer.accepted_backends(offered, dw.device),
                           "127.0.0.1")
    rx = Receiver("e1", 10.0, 4, sched, sink, lambda msg, to: True, dw.spec.vocab_size, dw.max_model_len)
    r = reserve(rx, "r", len(prompt), params.max_tokens)
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

    rx.receive(b"p", protocol.KVCommit("r", len(prompt), first, params, {}, backend, prompt))
    seq = sched.start(rx.next_ready())
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
