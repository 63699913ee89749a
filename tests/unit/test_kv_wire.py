"""int8 on the KV wire (--kv-wire-dtype): the rule that chooses it, tcp frames of int8 rows
that land dequantized (exactly what the reference's quantize-dequantize gives, never the
bytes as they are), dist's one send alike, --kv-verify's sums over what lands, and a
request's timings and the node's figures saying which format it crossed in and why."""

from __future__ import annotations

import time

import pytest
import torch

from common import transfer
from common.base import kv_wire
from common.transfer import tcp
from common.wire import protocol
from common.wire.node import ttft_parts
from common.wire.protocol import KVCommit, KVTransfer
from kernels import kv_quant
from tests.handoff_util import Pair, start_all
from tests.kv_quant_ref import quantize_dequantize

calls = []


def _rate(value: float):
    def measure() -> float:
        calls.append(value)
        return value

    return measure


def test_the_rule_sends_int8_only_where_the_link_time_saved_outweighs_quantizing():
    calls.clear()
    assert kv_wire.choose("same", 10**6, 5 * 10**5, 1e3, _rate(1e9)).dtype == "same"
    forced = kv_wire.choose("int8", 10**6, 5 * 10**5, 1e12, _rate(1.0))
    assert (forced.dtype, kv_wire.WHY[forced.why]) == ("int8", "--kv-wire-dtype int8")
    unmeasured = kv_wire.choose("auto", 10**6, 5 * 10**5, 0.0, _rate(1e9))
    assert (unmeasured.dtype, unmeasured.why) == ("same", 2)
    assert calls == []  # nothing measured where the choice does not need it
    slow = kv_wire.choose("auto", 10**6, 5 * 10**5, 1e6, _rate(1e9))  # 0.5 s saved, 1 ms cost
    assert (slow.dtype, slow.why) == ("int8", 3)
    assert slow.saved_s == pytest.approx(0.5) and slow.cost_s == pytest.approx(1e-3)
    fast = kv_wire.choose("auto", 10**6, 5 * 10**5, 1e11, _rate(1e9))  # 5 us saved, 1 ms cost
    assert (fast.dtype, fast.why) == ("same", 4)
    assert calls == [1e9, 1e9]
    # The measured link rate is low by each write's latency: int8 needs twice its cost back.
    margin = kv_wire.choose("auto", 10**6, 5 * 10**5, 1e9 / 3, lambda: 1e9)  # 1.5 ms for 1 ms
    assert margin.dtype == "same" and margin.saved_s == pytest.approx(1.5e-3)
    # Pushed layer by layer beside a prefill of 0.4 s, a 1 s transfer saves 0.5 - 0 ...
    beside = kv_wire.choose("auto", 10**6, 5 * 10**5, 1e6, lambda: 1e9, hidden_s=0.4)
    assert beside.dtype == "int8" and beside.saved_s == pytest.approx(0.5)
    beside = kv_wire.choose("auto", 10**6, 5 * 10**5, 1e6, lambda: 1e9, hidden_s=0.7)
    assert beside.dtype == "int8" and beside.saved_s == pytest.approx(0.3)
    # A saving of a few ms is within the latency the link rate folds in: not trusted.
    small = kv_wire.choose("auto", 10**6, 5 * 10**5, 1e8, lambda: 1e12)  # 5 ms for ~0
    assert small.dtype == "same" and small.saved_s == pytest.approx(5e-3)
    # ... and nothing where the prefill hides all of it either way (nothing measured then).
    calls.clear()
    hidden = kv_wire.choose("auto", 10**6, 5 * 10**5, 1e6, _rate(1e9), hidden_s=1.5)
    assert (hidden.dtype, kv_wire.WHY[hidden.why], calls) == (
        "same",
        "auto: the prefill hides the transfer either way",
        [],
    )
    assert "kv_wire_saved_ms" not in hidden.stamps()


def test_timings_say_the_format_and_why_and_ignore_what_does_not_parse():
    stamps = {"prefill_end": 10.0, "written": 10.5} | kv_wire.choose(
        "auto", 10**6, 5 * 10**5, 1e6, lambda: 1e9
    ).stamps()
    parts = ttft_parts(stamps)
    assert parts["kv_wire"] == "int8"
    assert parts["kv_wire_why"] == "auto: the link time saved outweighs quantizing"
    assert parts["kv_wire_saved_ms"] == pytest.approx(500.0)
    assert parts["kv_write_ms"] == pytest.approx(500.0)
    for bad in ({"kv_wire_int8": 2, "kv_wire_why": 0}, {"kv_wire_int8": 1, "kv_wire_why": 99}):
        assert "kv_wire" not in ttft_parts(bad)
    assert "kv_wire" not in ttft_parts({"prefill_end": 1.0})  # a link that cannot carry int8


def _wire(msg):
    """Through the real encoding, as the KV link carries it."""
    return protocol.decode([bytes(f) for f in protocol.encode(msg)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_frames_land_as_the_reference_quantizes_them(dtype, monkeypatch):
    monkeypatch.setattr(transfer.copy, "WIRE_PIECE_BYTES", 300)  # checksums piece by piece
    torch.manual_seed(0)
    src = torch.randn(3, 2, 10, 4, 2, 16).to(dtype)  # [L, 2, blocks, block_size, Hk, D]
    dst = torch.zeros_like(src)
    monkeypatch.setattr(tcp, "FRAME_BYTES", src[0, :, :2].nbytes)  # frames split the blocks
    frames = []
    writer = tcp.TcpWriter(src, lambda m: frames.append(m) or True)
    assert writer.wire_dtypes == ("int8",)
    src_ids, dst_ids = [1, 4, 5, 7], [2, 3, 8, 9]
    writer.write("r", "g", src_ids, dst_ids, within_s=30, wire="int8")
    assert writer.poll() == [("r", None)] and len(frames) > 3
    assert sum(f.data.nbytes for f in frames) == writer.wire_bytes(len(src_ids))
    assert writer.wire_bytes(4) == 4 * (3 * 2 * 4 * 2) * (16 + 4)  # rows of D bytes and a scale
    sink = transfer.KVSink(transfer.LocalCache(dst, "127.0.0.1"), ["tcp"])
    for f in frames:
        assert f.header["is_int8"] and f.data.dtype == torch.int8
        sink.receive(b"p", _wire(f), dst_ids)
    landed, sent = dst[:, :, dst_ids], src[:, :, src_ids]
    assert torch.equal(landed, quantize_dequantize(sent, "int8"))
    assert not torch.equal(landed, sent)  # lossy: the bytes did not cross as they are
    assert dst[:, :, [0, 1, 4]].abs().sum() == 0  # nothing outside the reservation
    # --kv-verify: the prefill side's sums, over what the decode side lands from int8 rows
    assert torch.equal(
        transfer.block_checksums(src, src_ids, "int8"), transfer.block_checksums(dst, dst_ids)
    )
    assert not torch.equal(
        transfer.block_checksums(src, src_ids), transfer.block_checksums(dst, dst_ids)
    )


def test_int8_frames_are_refused_where_they_do_not_fit():
    src, eight_bit = torch.randn(2, 2, 6, 4, 1, 8), torch.zeros(2, 2, 6, 4, 1, 12, dtype=torch.int8)
    frames = []
    writer = tcp.TcpWriter(src, lambda m: frames.append(m) or True)
    writer.write("r", "g", [1, 2], [1, 2], within_s=30, wire="int8")
    writer.write("q", "g", [1, 2], [1, 2], within_s=30)
    assert len(writer.poll()) == 2 and len(frames) == 2
    # An 8-bit cache takes its pages as they are, never int8 rows meant for a float cache.
    sink = transfer.KVSink(transfer.LocalCache(eight_bit, "127.0.0.1"), ["tcp"])
    with pytest.raises(transfer.TransferError, match="int8 rows"):
        sink.receive(b"p", _wire(frames[0]), [1, 2])
    # Frames that say int8 but carry the cache's own dtype are refused too.
    lie = next(f for f in frames if f.request_id == "q")
    lie.header["is_int8"] = True
    sink = transfer.KVSink(transfer.LocalCache(torch.zeros_like(src), "127.0.0.1"), ["tcp"])
    with pytest.raises(transfer.TransferError, match="does not fit"):
        sink.receive(b"p", _wire(lie), [1, 2])
    # An int8 frame larger than a writer makes one (its landing's temporaries are several
    # times its size) is refused, whatever the link lets through.
    per_block = src[0, :, :1].nbytes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tcp, "FRAME_BYTES", 2 * per_block)
        big = kv_quant.quantize(src[:, :, 1:4], torch.int8)  # 2 layers x 3 blocks
        frame = KVTransfer("b", "g", "tcp", {"first_layer": 0, "is_int8": True}, big)
        with pytest.raises(transfer.TransferError, match="does not fit"):
            sink.receive(b"p", _wire(frame), [1, 2, 3])
    # An 8-bit cache's own writer has nothing smaller to send.
    assert tcp.TcpWriter(eight_bit, lambda m: True).wire_dtypes == ()
    with pytest.raises(transfer.TransferError, match="cannot send"):
        tcp.TcpWriter(eight_bit, lambda m: True).write("r", "g", [1], [1], 30, wire="int8")


def test_dist_sends_int8_rows_that_land_as_the_reference_quantizes_them():
    """dist's one send a write, quantized as it is gathered, dequantized as it lands."""
    torch.manual_seed(1)
    src = torch.randn(2, 2, 8, 4, 2, 16).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    sink = transfer.KVSink(transfer.LocalCache(dst, "127.0.0.1"), ["dist"])
    frames = []
    writer = transfer.open_writer(
        "dist", _wire(sink.welcome("e1")), src, lambda m: frames.append(_wire(m)) or True
    )
    assert writer.wire_dtypes == ("int8",)
    assert writer.wire_bytes(3) == 3 * (2 * 2 * 4 * 2) * (16 + 4)
    src_ids, dst_ids = [1, 2, 6], [3, 4, 5]
    writer.write("r", "g", src_ids, dst_ids, 30, wire="int8")
    done, deadline = [], time.monotonic() + 60
    while not (done and sink.is_landed("r")):  # both sides join their group first
        assert time.monotonic() < deadline, "the write did not complete"
        done += writer.poll()
        for f in frames:
            assert f.header["is_int8"] is True
            sink.receive(b"p", f, dst_ids)
        frames.clear()
        time.sleep(0.01)
    assert done == [("r", None)] and sink.landing_error("r") is None
    assert torch.equal(dst[:, :, dst_ids], quantize_dequantize(src[:, :, src_ids], "int8"))
    writer.close()
    sink.close()


@pytest.mark.parametrize("layerwise", ["off", "on"])
def test_a_handoff_crosses_in_int8_verified_and_says_so(layerwise):
    p = Pair(layerwise=layerwise)
    p.tx.wire_dtype = "int8"
    p.tx.checksums = lambda ids, wire: transfer.block_checksums(p.src, ids, wire)
    p.rx.is_verifying = True
    job = p.job("r", prompt_len=10)
    src = p.src[:, :, job.block_ids].clone()
    p.tx.begin(job)
    p.pump()
    if layerwise == "on":
        p.tx.push_layers([(job, None)], p.src.shape[0])
    p.tx.start_writes([job])
    p.tx.set_first_token(job, 3, {})
    p.pump()
    r = p.rx.next_ready()
    assert r is not None and r.error is None, r and r.error
    assert torch.equal(p.dst[:, :, r.block_ids], quantize_dequantize(src, "int8"))
    # Its blocks hold lossy KV: never kept in the decode node's prefix cache under the
    # prompt's hashes (a later prompt would take them for exact).
    assert r.is_lossy
    (seq,), _ = start_all(p.pool, r)
    assert not seq.is_cacheable
    (commit,) = [m for m in p.link.sent if isinstance(m, KVCommit)]
    parts = ttft_parts(commit.timings)
    assert (parts["kv_wire"], parts["kv_wire_why"]) == ("int8", "--kv-wire-dtype int8")
    figures = p.tx.transfers["tcp"]
    assert figures.num_int8 == 1
    assert figures.num_bytes == tcp.TcpWriter(p.src, None).wire_bytes(len(r.block_ids))
    p.close()


def test_auto_learns_the_link_from_layer_wise_writes_too(monkeypatch):
    """Where every write goes layer by layer (no whole write ever times the link), the
    tails after the passes give auto its rate: it chooses, rather than waiting forever."""
    from common.handoff import writes

    monkeypatch.setattr(writes, "MIN_RATE_BYTES", 0)  # the test's caches are tiny
    p = Pair(layerwise="on")
    p.tx.wire_dtype = "auto"
    p.tx.prefill_s = lambda num_tokens: 10.0  # NOTE: a tail rate already leaves it out
    whys = []
    for rid in ("a", "b"):
        job = p.job(rid, prompt_len=10)
        p.tx.begin(job)
        p.pump()
        p.tx.push_layers([(job, None)], p.src.shape[0])
        p.tx.start_writes([job])
        p.tx.set_first_token(job, 3, {})
        p.clock.advance(1.0)  # a slow link: the tail after the pass takes a second
        p.pump()
        assert p.rx.next_ready().error is None
        (commit,) = [m for m in p.link.sent if isinstance(m, KVCommit) and m.request_id == rid]
        whys.append(ttft_parts(commit.timings)["kv_wire_why"])
    assert whys[0] == "auto: no link rate measured yet"
    assert p.tx.transfers["tcp"].tail_bytes_per_s > 0 and p.tx.transfers["tcp"].bytes_per_s == 0
    # a second's tail for each write: int8 (6 bytes a row of 2 fp32 values) saves a quarter
    assert whys[1] == "auto: the link time saved outweighs quantizing"
    p.close()
