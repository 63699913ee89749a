"""KV transfer backends, in one process: after reserve -> write the decode
worker's reserved blocks equal the prefill worker's, and decoding goes on from
them exactly. Layouts, handles and frames that do not fit are refused with a
clear error."""

import dataclasses
import time

import pytest
import torch

from common import transfer
from common.base.config import WorkerConfig
from common.base.request import SamplingParams
from common.engine.worker import DeviceWorker, PrefillChunk
from common.handoff.receiver import Receiver
from common.kv.blocks import BlockAllocator, num_blocks_for
from common.kv.sequence import blocks_to_join
from common.wire import protocol
from common.wire.protocol import KVTransfer
from decode_node.scheduler import DecodeScheduler
from launch.tools.offline import generate
from tests.handoff_util import reserve, start_all


def _wire(msg):
    """Through the real encoding, as the KV link carries it."""
    return protocol.decode([bytes(f) for f in protocol.encode(msg)])


def _sink(dw, accepted, host="127.0.0.1"):
    return transfer.KVSink(transfer.LocalCache(dw.kv_cache, host, dw.kv_shm_name), accepted)


def _frame(rid, first_layer, kv, first_block=0):
    return KVTransfer(rid, "g", "tcp", {"first_layer": first_layer, "first_block": first_block}, kv)


def _dist(rid, group, tag):
    return KVTransfer(
        rid, "g", "dist", {"group": group, "tag": tag}, torch.empty(0, dtype=torch.uint8)
    )


needs_nixl = pytest.mark.skipif(
    transfer.backend("nixl").why_unusable(torch.device("cpu")) is not None,
    reason=str(transfer.backend("nixl").why_unusable(torch.device("cpu"))),
)


@pytest.fixture
def workers(tiny_model):
    cfg = WorkerConfig(model=str(tiny_model), block_size=16, kv_cache_memory=2 * 2**20)
    with (
        DeviceWorker(cfg) as pw,
        DeviceWorker(dataclasses.replace(cfg, is_cache_in_shm=True)) as dw,
    ):
        yield pw, dw


@pytest.mark.parametrize("backend", ["ipc", pytest.param("nixl", marks=needs_nixl), "tcp", "dist"])
def test_decode_blocks_equal_prefill_blocks_and_decoding_continues(workers, backend):
    pw, dw = workers
    prompt = list(range(3, 60))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    palloc = BlockAllocator(pw.num_kv_blocks)
    palloc.allocate(5)  # so the two nodes' block ids differ
    src = palloc.allocate(num_blocks_for(len(prompt), 16))
    (first,), _ = pw.prefill([PrefillChunk(prompt, 0, src, params)])

    sched = DecodeScheduler(BlockAllocator(dw.num_kv_blocks), 16, 4)
    sched.prefix_cache.allocate(2)
    offered = (
        "auto" if backend in ("ipc", "tcp") else backend
    )  # auto: never dist, nixl across hosts
    sink = _sink(dw, transfer.offered(offered, dw.device, is_reachable_remotely=False))
    rx = Receiver(
        epoch="e1",
        lease_s=10.0,
        max_queue=4,
        pool=sched,
        sink=sink,
        send=lambda msg, to: True,
        vocab_size=dw.spec.vocab_size,
        max_model_len=dw.max_model_len,
    )
    r = reserve(rx, "r", len(prompt), params.max_tokens)
    frames = []
    writer = transfer.open_writer(
        backend, _wire(sink.welcome("e1")), pw.kv_cache, lambda m: frames.append(_wire(m)) or True
    )
    assert writer.name == backend
    num_written = writer.write("r", r.name, src, r.block_ids, within_s=30)
    done, num_frames, deadline = [], 0, time.monotonic() + 60
    while not (done and sink.is_landed("r")):  # dist: both sides join their group first
        assert time.monotonic() < deadline, "the write did not complete"
        done += writer.poll()
        for f in frames:
            sink.receive(b"p", f, r.block_ids)
        num_frames += len(frames)
        frames.clear()
        sink.progress()
    assert done == [("r", None)] and bool(num_frames) == (backend != "ipc")
    assert r.block_ids != src
    assert torch.equal(dw.kv_cache[:, :, r.block_ids], pw.kv_cache[:, :, src])

    commit_and_decode(pw, dw, rx, sched, r, backend, prompt, params, first, num_written)
    sched.finish("r")
    sched.prefix_cache.free([1, 2])
    assert (
        sched.prefix_cache.num_free == sched.prefix_cache.capacity
        and sched.prefix_cache.num_reserved == 0
    )
    writer.close()
    sink.close()


def commit_and_decode(pw, dw, rx, sched, r, backend, prompt, params, first, num_written) -> None:
    """Commit request "r" written into reservation r, then decode on from its landed blocks:
    its tokens equal the prefill worker's own generation."""
    rx.receive(
        b"p",
        protocol.KVCommit(
            "r", len(prompt), first, params, {}, backend, prompt, r.name, num_written
        ),
    )
    (seq,), _ = start_all(sched, rx.next_ready())
    blocks_to_join(seq, 16, sched.prefix_cache)
    dw.decode.add("r", first, len(prompt), seq.block_ids, params)
    tokens = [first]
    for _ in range(params.max_tokens - 1):
        if dw.decode.next_position("r") // 16 >= dw.decode.num_blocks("r"):
            dw.decode.append_block("r", seq.take_block(sched.prefix_cache))
        tokens += dw.decode.step()
    assert tokens == generate(pw, [prompt], [params])[0]["token_ids"]
    dw.decode.remove("r")


def test_tcp_frames_are_a_group_of_layers_each(workers, monkeypatch):
    pw, dw = workers
    src = [1, 2, 3]
    monkeypatch.setattr(
        transfer.tcp, "FRAME_BYTES", pw.kv_cache[0, :, :3].numel() * pw.kv_cache.element_size()
    )
    pw.kv_cache[:, :, src] = torch.randn_like(pw.kv_cache[:, :, src])
    frames = []
    writer = transfer.tcp.TcpWriter(pw.kv_cache, lambda m: frames.append(m) or True)
    writer.write("r", "g", src, [7, 8, 9], within_s=30)
    assert writer.poll() == [("r", None)]
    assert [f.header["first_layer"] for f in frames] == list(range(pw.kv_cache.shape[0]))
    sink = _sink(dw, ["tcp"])
    for f in frames:
        sink.receive(b"p", _wire(f), [7, 8, 9])
    assert torch.equal(dw.kv_cache[:, :, [7, 8, 9]], pw.kv_cache[:, :, src])


def test_tcp_splits_a_layer_larger_than_a_frame_by_blocks(workers, monkeypatch):
    from common.transfer import tcp

    pw, dw = workers
    per_block = pw.kv_cache[0, :, :1].numel() * pw.kv_cache.element_size()
    monkeypatch.setattr(tcp, "FRAME_BYTES", 2 * per_block)  # a layer of 5 blocks: frames of 2, 2, 1
    src, dst = [1, 2, 3, 4, 5], [9, 10, 11, 12, 13]
    pw.kv_cache[:, :, src] = torch.randn_like(pw.kv_cache[:, :, src])
    frames = []
    writer = tcp.TcpWriter(pw.kv_cache, lambda m: frames.append(m) or True)
    writer.write("r", "g", src, dst, within_s=30)
    assert writer.poll() == [("r", None)]
    num_layers = pw.kv_cache.shape[0]
    assert [
        (f.header["first_layer"], f.header["first_block"], f.data.shape[2]) for f in frames
    ] == [(layer, b, n) for layer in range(num_layers) for b, n in ((0, 2), (2, 2), (4, 1))]
    sink = _sink(dw, ["tcp"])
    for i, f in enumerate(frames):
        sink.receive(b"p", _wire(f), dst)
        assert sink.why_incomplete("tcp", "r", 5, num_layers) is None or i < len(frames) - 1
    assert sink.receivers["tcp"].num_received("r") == num_layers
    assert torch.equal(dw.kv_cache[:, :, dst], pw.kv_cache[:, :, src])
    with pytest.raises(transfer.TransferError, match="arrived twice"):
        sink.receive(b"p", _wire(frames[1]), dst)


def test_tcp_sends_the_write_with_the_fewest_bytes_left_first_as_the_link_takes_frames():
    """A long prompt's KV began first; a short one's comes next: the link takes one frame a
    turn (full), and the short write goes out whole before the long one's next frame."""
    from common.transfer import tcp

    cache = torch.randn(4, 2, 40, 4, 1, 2)
    room, sent = [0], []

    def send(m) -> bool:
        if room[0] == 0:
            return False
        room[0] -= 1
        sent.append(m.request_id)
        return True

    writer = tcp.TcpWriter(cache, send)
    layer_bytes = cache[0, :, :1].numel() * cache.element_size()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tcp, "FRAME_BYTES", layer_bytes)  # one layer of a one-block write a frame
        writer.write("long", "g1", list(range(30)), list(range(30)), within_s=30)
        room[0] = 1
        writer.flush()  # the long write's first frame goes
        assert writer.is_stalled and sent == ["long"]
        writer.write("short", "g2", [35], [35], within_s=30)
        for _ in range(6):
            room[0] = 1
            writer.flush()
    assert sent == ["long"] + ["short"] * 4 + ["long"] * 2
    assert dict(writer.poll()) == {"short": None}  # the short one is done, the long goes on


def test_the_decode_cache_is_shared_memory_and_freed_on_close(tiny_model):
    import os

    cfg = WorkerConfig(model=str(tiny_model), kv_cache_memory=2**20, is_cache_in_shm=True)
    w = DeviceWorker(cfg).prepare()
    path = f"/dev/shm/{w.kv_shm_name}"
    assert os.path.exists(path)
    w.close()
    assert not os.path.exists(path)


def _welcome(dw, **change):
    sink = _sink(dw, ["ipc", "tcp"])
    return dataclasses.replace(sink.welcome("e1"), **change)


def test_a_cache_of_another_layout_is_refused(workers):
    pw, dw = workers
    shape = list(dw.kv_cache.shape)
    for change in (
        {"cache_shape": [shape[0] + 1, *shape[1:]]},
        {"dtype": "bfloat16"},
        {"cache_shape": shape[:3] + [32] + shape[4:]},
    ):
        with pytest.raises(transfer.TransferError, match="does not match"):
            transfer.open_writer("auto", _welcome(dw, **change), pw.kv_cache, lambda m: True)


def test_ipc_needs_the_same_host_and_a_real_segment(workers):
    pw, dw = workers
    assert (
        transfer.open_writer(
            "auto", _welcome(dw, host_id="elsewhere/1"), pw.kv_cache, lambda m: True
        ).name
        == "tcp"
    )
    with pytest.raises(transfer.TransferError, match="another host"):
        transfer.open_writer(
            "ipc", _welcome(dw, host_id="elsewhere/1"), pw.kv_cache, lambda m: True
        )
    for name in ("pdserve-kv-0-missing", "../etc/passwd", None):
        with pytest.raises(transfer.TransferError, match="segment"):
            transfer.open_writer(
                "ipc",
                _welcome(dw, backends={"ipc": {"shm_name": name}}),
                pw.kv_cache,
                lambda m: True,
            )
    for bad in ({"shm_name": 7}, {"shm_name": "x", "smuggled": 1}, {"cuda": {"device": 0}}, "ipc"):
        with pytest.raises(transfer.TransferError, match="ipc"):
            transfer.open_writer(
                "ipc", _welcome(dw, backends={"ipc": bad}), pw.kv_cache, lambda m: True
            )
    with pytest.raises(transfer.TransferError, match="accepts ipc"):
        transfer.open_writer("tcp", _welcome(dw, backends={"ipc": {}}), pw.kv_cache, lambda m: True)


def test_ipc_refuses_blocks_outside_the_decode_cache(workers):
    pw, dw = workers
    writer = transfer.open_writer("ipc", _welcome(dw), pw.kv_cache, lambda m: True)
    for dst in ([0], [dw.num_kv_blocks]):
        with pytest.raises(transfer.TransferError, match="outside"):
            writer.write("r", "g", [1], dst, within_s=30)
    writer.close()


def test_a_frame_of_the_wrong_shape_or_dtype_is_refused(workers):
    pw, dw = workers
    sink = _sink(dw, ["tcp"])
    good = pw.kv_cache[:2, :, [1, 2]].clone()
    before = dw.kv_cache.clone()
    for kv, first_layer, first_block in (
        (good, 0, 1),
        (good[:, :, :1], 0, 2),
        (good.to(torch.float16), 0, 0),
        (good, dw.kv_cache.shape[0] - 1, 0),
        (good.flatten(0, 1), 0, 0),
        (good[:, :, :, :8].contiguous(), 0, 0),
        (good[:, :, :0], 0, 0),
    ):
        with pytest.raises(transfer.TransferError, match="does not fit"):
            sink.receive(b"p", _wire(_frame("r", first_layer, kv, first_block)), [5, 6])
    for header in (
        {},
        {"first_layer": -1},
        {"first_layer": "0"},
        {"first_layer": 0, "extra": 1},
        {"first_layer": 0, "first_block": -1},
    ):
        with pytest.raises(transfer.TransferError, match="tcp header"):
            sink.receive(b"p", _wire(KVTransfer("r", "g", "tcp", header, good)), [5, 6])
    assert torch.equal(dw.kv_cache, before)
    for name in ("dist", "smoke-signals"):
        with pytest.raises(transfer.TransferError, match="does not accept"):
            sink.receive(
                b"p",
                _dist("r", "g", 1) if name == "dist" else KVTransfer("r", "g", name, {}, good),
                [5, 6],
            )


def test_a_dist_group_belongs_to_the_peer_that_made_it(workers):
    _, dw = workers
    sink = _sink(dw, ["dist"])
    assert sink.welcome("e").backends["dist"]["store"].startswith("127.0.0.1:")
    sink.receive(b"peer-a", _dist("r1", "g", 1), [5, 6])
    with pytest.raises(transfer.TransferError, match="another prefill node"):
        sink.receive(b"peer-b", _dist("r2", "g", 2), [7])
    with pytest.raises(transfer.TransferError, match="second KV announcement"):
        sink.receive(b"peer-a", _dist("r1", "g", 3), [5, 6])
    assert not sink.is_landed("r1")  # posted, never sent: nothing lands in the cache
    sink.forget("r1")
    assert sink.is_landed("r1")
    sink.receive(b"peer-a", _dist("r3", "g", 4), [8])
    sink.receive(b"peer-a", _dist("r4", "g2", 1), [9])  # a new group replaces "g"
    assert sink.is_landed("r3") and "replaced" in sink.landing_error("r3")
    assert len(sink.receivers["dist"]._groups) == 1
    sink.close()


def test_copy_blocks_handles_scattered_ids():
    src = torch.randn(2, 2, 40, 4, 1, 3)
    dst = torch.zeros_like(src)
    s_ids = list(range(1, 40, 2))  # 20 runs: the gather path
    d_ids = list(range(39, 19, -1))
    transfer.copy_blocks(src, s_ids, dst, d_ids)
    assert torch.equal(dst[:, :, d_ids], src[:, :, s_ids])
    transfer.copy_blocks(src, [3, 4, 5], dst, [10, 11, 12])  # one run: a slice copy
    assert torch.equal(dst[:, :, 10:13], src[:, :, 3:6])
    with pytest.raises(transfer.TransferError):
        transfer.copy_blocks(src, [1, 2], dst, [3])


def test_auto_prefers_ipc_on_one_host_and_nixl_across_hosts():
    cpu = torch.device("cpu")
    w = protocol.KVWelcome(
        "e",
        transfer.host_id(),
        "cpu",
        [1, 2, 4, 16, 1, 8],
        "float32",
        {"ipc": {}, "nixl": {}, "tcp": {}, "dist": {}},
    )
    elsewhere = dataclasses.replace(w, host_id="x/y")
    assert transfer.choose_backend("auto", w, cpu) == "ipc"
    assert transfer.choose_backend("tcp", w, cpu) == "tcp"
    has_nixl = transfer.backend("nixl").why_unusable(cpu) is None
    assert transfer.choose_backend("auto", elsewhere, cpu) == ("nixl" if has_nixl else "tcp")
    assert (
        transfer.choose_backend(
            "auto", dataclasses.replace(elsewhere, backends={"tcp": {}, "dist": {}}), cpu
        )
        == "tcp"
    )  # never dist, never ipc across hosts
    with pytest.raises(transfer.TransferError, match="another host"):
        transfer.choose_backend("ipc", elsewhere, cpu)
    assert transfer.offered("tcp", cpu, False) == ["tcp"]
    assert transfer.offered("auto", cpu, False) == [
        "ipc",
        "tcp",
    ]  # never dist; nixl only across hosts
    assert (
        transfer.offered("auto", cpu, True) == ["ipc", "nixl", "tcp"]
        if has_nixl
        else ["ipc", "tcp"]
    )
    assert transfer.offered("dist", cpu, False) == ["dist"]
    assert transfer.needs_shared_cache("auto", cpu) and not transfer.needs_shared_cache("tcp", cpu)
    for bad in ("smoke-signals", "auto "):
        with pytest.raises(transfer.TransferError, match="must be one of"):
            transfer.offered(bad, cpu, False)
    help_text = transfer.availability()
    assert "usable here (cpu): ipc" in help_text and "tcp" in help_text


def test_a_backend_that_cannot_be_imported_is_not_offered(monkeypatch, caplog):
    from common.transfer import nixl

    monkeypatch.setattr(
        nixl, "_module", lambda: (None, "cannot import nixl_cu12 (ImportError: gone)")
    )
    cpu = torch.device("cpu")
    with caplog.at_level("INFO", logger="pdserve.transfer"):
        assert transfer.offered("auto", cpu, True) == ["ipc", "tcp"]
    assert [r.getMessage() for r in caplog.records if "nixl" in r.getMessage()] == [
        "the nixl KV transfer is not offered: cannot import nixl_cu12 (ImportError: gone)"
    ]
    with pytest.raises(
        transfer.TransferError, match="cannot offer the nixl KV transfer: cannot import"
    ):
        transfer.offered("nixl", cpu, True)
    assert "nixl: cannot import nixl_cu12" in transfer.availability()
    with pytest.raises(transfer.TransferError, match="cannot use the nixl KV transfer here"):
        transfer.check_usable("nixl", cpu)
    transfer.check_usable("auto", cpu)


def test_a_node_asked_for_a_backend_it_cannot_use_says_so_in_one_line(
    monkeypatch, capsys, tiny_model
):
    import decode_node.__main__ as decode_main
    import prefill_node.__main__ as prefill_main
    from common.transfer import nixl

    monkeypatch.setattr(
        nixl, "_module", lambda: (None, "cannot import nixl_cu12 (ImportError: gone)")
    )
    common = [
        "--frontend",
        "tcp://127.0.0.1:5991",
        "--model",
        str(tiny_model),
        "--kv-transfer",
        "nixl",
    ]
    for module, more in ((decode_main, ["--kv-bind", "tcp://127.0.0.1:5992"]), (prefill_main, [])):
        monkeypatch.setattr(module, "stop_event_on_signals", lambda: None)
        assert module.main(common + more) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{role}: cannot use the nixl KV transfer here: cannot import nixl_cu12 (ImportError: gone)"
        for role in ("decode_node", "prefill_node")
    ]


@needs_nixl
def test_nixl_lands_only_what_its_announcer_notified(workers):
    """The decode side admits a request once the notification from the agent that
    announced it arrives, whichever comes first; another agent's is not enough."""
    _, dw = workers
    sink = _sink(dw, ["nixl"])
    rx = sink.receivers["nixl"]

    def announce(rid, agent):
        return KVTransfer(rid, "g", "nixl", {"agent": agent}, torch.empty(0, dtype=torch.uint8))

    sink.receive(b"p", _wire(announce("r1", "writer-a")), [5])
    assert not sink.is_landed("r1") and sink.progress()
    rx._early[("writer-b", "r1")] = None  # as if writer-b had sent "r1"
    rx._early[("writer-a", "r2")] = None  # a notification ahead of its announcement
    sink.receive(b"p", _wire(announce("r2", "writer-a")), [6])
    assert sink.is_landed("r2") and not sink.is_landed("r1")
    with pytest.raises(transfer.TransferError, match="second NIXL write"):
        sink.receive(b"p", announce("r1", "writer-a"), [5])
    for bad in ({}, {"agent": 5}, {"agent": "a", "more": 1}):
        with pytest.raises(transfer.TransferError, match="nixl header"):
            sink.receive(
                b"p", KVTransfer("r3", "g", "nixl", bad, torch.empty(0, dtype=torch.uint8)), [7]
            )
    sink.forget("r1")
    assert sink.is_landed("r1") and not sink.progress()
    sink.close()


def test_auto_pairs_ipc_and_nixl_only_with_a_cache_of_the_same_device_kind():
    cpu = torch.device("cpu")
    w = protocol.KVWelcome(
        "e",
        transfer.host_id(),
        "cuda:0",
        [1, 2, 4, 16, 1, 8],
        "float32",
        {"ipc": {}, "nixl": {}, "tcp": {}},
    )
    assert transfer.choose_backend("auto", w, cpu) == "tcp"
    for name in ("ipc", "nixl"):
        with pytest.raises(
            transfer.TransferError, match="its cache is on cuda:0, this node's on cpu"
        ):
            transfer.choose_backend(name, w, cpu)
    odd = dataclasses.replace(w, device="not a device!")  # off the wire: refused, never raised past
    assert transfer.choose_backend("auto", odd, cpu) == "tcp"
