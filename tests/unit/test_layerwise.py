"""KV pushed layer by layer during the prefill (--kv-layerwise): the sender's rules on a
fake clock (when a write goes layer-wise, what a failure or a pass that never ends
does), and each backend writing a real forward pass's layers as they are computed,
the decode node going on from them token for token."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from common import transfer
from common.base.config import WorkerConfig
from common.base.layerwise import MIN_HIDDEN_S, UNMEASURED_BYTES, is_layerwise
from common.base.request import SamplingParams
from common.engine.worker import DeviceWorker, PrefillChunk
from common.handoff import writes
from common.handoff.states import Hold, Stage
from common.kv.blocks import BlockAllocator, num_blocks_for
from common.transfer import TransferError
from common.wire.figures import TransferFigures
from common.wire.protocol import KVCommit, KVRelease, KVReserve, KVTransfer
from decode_node.scheduler import DecodeScheduler
from tests.handoff_util import PREFILL, Pair
from tests.unit.test_handoff import _sink, _wire, commit_and_decode, needs_nixl


def _reserved(p: Pair, rid: str = "r", prompt_len: int = 10):
    job = p.job(rid, prompt_len=prompt_len)
    p.tx.begin(job)
    p.pump()
    h = p.tx.by_id[rid]
    assert h.stage is Stage.RESERVED
    return job, h


def _frames(p: Pair) -> list[int]:
    return [m.header["first_layer"] for m in p.data.sent if isinstance(m, KVTransfer)]


def test_layers_go_out_during_the_pass_and_the_commit_waits_for_all_of_them():
    p = Pair(layerwise="on")
    job, h = _reserved(p)
    src = list(job.block_ids)
    p.tx.push_layers([(job, None)], 1)  # layer 0 computed, layer 1 not yet
    assert h.stage is Stage.WRITING and h.layers_sent == 1 and _frames(p) == [0]
    p.pump()  # the decode node lands layer 0; nothing ends
    r = p.rx.held["r"]
    assert h.stage is Stage.WRITING and r.hold is Hold.RESERVED
    assert torch.equal(p.dst[0][:, r.block_ids], p.src[0][:, src]) and not p.dst[1].any()
    p.tx.start_writes([job])  # the pass is done: the rest, and the end
    assert _frames(p) == [0, 1]
    p.tx.set_first_token(job, 7, {})
    p.pump()
    got = p.rx.next_ready()
    assert got is r and got.error is None and "r" not in p.tx.by_id and not p.failed
    assert torch.equal(p.dst[:, :, r.block_ids], p.src[:, :, src])
    f = p.tx.transfer_figures()["tcp"]
    assert (f["num_transfers"], f["num_layerwise"]) == (1, 1) and f[
        "bytes_per_s"
    ] == 0  # a tail is no rate


@pytest.mark.parametrize(
    "mode, rate, is_peer_layerwise, layerwise",
    [
        ("off", 0.0, True, False),
        ("on", 0.0, False, False),  # the decode node takes whole writes only
        ("auto", 0.0, True, False),  # a few hundred bytes: not worth it
        ("auto", 1e3, True, True),  # a slow link measured: worth it
        ("auto", 1e12, True, False),  # a fast one: not
    ],
)
def test_what_goes_layer_by_layer(mode, rate, is_peer_layerwise, layerwise):
    p = Pair(layerwise=mode)
    if rate:
        p.tx.transfers["tcp"] = TransferFigures(bytes_per_s=rate)  # as whole writes measured it
    job, h = _reserved(p)
    h.peer.is_layerwise = is_peer_layerwise
    p.tx.push_layers([(job, None)], 1)
    assert (h.stage is Stage.WRITING) == layerwise and _frames(p) == ([0] if layerwise else [])
    p.tx.start_writes([job])
    p.tx.set_first_token(job, 7, {})
    p.pump()
    assert p.rx.next_ready().error is None and not p.failed


def test_during_a_pass_the_node_is_called_on_to_send_what_is_held_back():
    """A CPU pass's lanes call on_layers as each layer's KV is written, and every FEED_S
    between: KV held back for a full link goes out as the link drains, not only at the next
    layer."""
    import time
    from types import SimpleNamespace

    from common.engine.lanes import FEED_S, Lanes

    def forward(chunks, between_layers=None, kv_written=None):
        for layer in range(2):
            kv_written(layer + 1)
            time.sleep(10 * FEED_S)
        return torch.zeros(len(chunks), 1)

    lanes, calls = Lanes(1, forward), []
    try:
        chunk = SimpleNamespace(token_ids=[1, 2], prompt_targets=None, context_len=0)
        lanes.forward([chunk], 1, on_layers=lambda idx, n: calls.append((list(idx), n)))
    finally:
        lanes.close()
    assert [c for c in calls if c[0]] == [([0], 1), ([0], 2)]
    assert calls.count(([], 0)) >= 3  # about 20 while the two layers ran (none without it)


def _blocks(p: Pair) -> list[tuple[int, int, int]]:
    """Each tcp frame's (first layer, layers, first block, blocks)."""
    return [
        (m.header["first_layer"], m.data.shape[0], m.header.get("first_block", 0), m.data.shape[2])
        for m in p.data.sent
        if isinstance(m, KVTransfer)
    ]


def test_a_chunked_prompt_goes_chunk_by_chunk_its_grant_renewed_across_passes():
    """Each pass pushes the blocks its chunk completes (a block its chunk ends inside goes
    with the next); between passes the write keeps its grant, the writer's deadline moved
    with each renewal, well past the first lease's."""
    p = Pair(layerwise="on", lease_s=30.0)
    job, h = _reserved(p, prompt_len=22)  # 6 blocks of 4
    src = list(job.block_ids)
    p.clock.advance(0.5)
    p.tx.push_layers([(job, 2)], 1)  # pass 1, tokens [0, 10): layer 0 of blocks 0-1
    p.tx.push_layers([(job, 2)], 2)  # its last layer: those blocks are all sent
    assert _blocks(p) == [(0, 1, 0, 2), (1, 1, 0, 2)] and (h.blocks_sent, h.layers_sent) == (2, 0)
    p.pump()
    r = p.rx.held["r"]
    assert (
        torch.equal(p.dst[:, :, r.block_ids[:2]], p.src[:, :, src[:2]])
        and not p.dst[:, :, r.block_ids[2:]].any()
    )
    first_deadline = h.write_deadline
    writer, renewals = h.peer.writer, []
    renew = writer.renew
    writer.renew = lambda rid, within_s: (
        renewals.append(p.clock() + within_s) or renew(rid, within_s)
    )
    for t in range(5):  # passes 2..6 over 50 s, a renewal every third of the lease
        p.run_for(10)
        p.tx.push_layers([(job, 3)], 2)  # tokens up to 12: block 2 (then passes of
        # chunks that complete no block)
    assert h.stage is Stage.WRITING and not p.failed and p.sent(KVReserve) >= 5
    assert h.write_deadline > first_deadline + 40 and p.clock() > first_deadline
    assert len(renewals) >= 4 and renewals[-1] == h.write_deadline  # the writer's own, moved too
    p.tx.push_layers([(job, None)], 1)  # the last chunk: layer 0 of blocks 3-5
    p.tx.start_writes([job])  # and the rest
    assert _blocks(p)[2:] == [
        (0, 2, 2, 1),
        (0, 1, 3, 3),
        (1, 1, 3, 3),
    ]  # block 2: both layers in one
    p.tx.set_first_token(job, 7, {})
    p.pump()
    got = p.rx.next_ready()
    assert got is r and got.error is None and not p.failed
    assert torch.equal(p.dst[:, :, r.block_ids], p.src[:, :, src])
    f = p.tx.transfer_figures()["tcp"]
    assert (f["num_transfers"], f["num_layerwise"], f["num_chunked"]) == (1, 1, 1)


def test_a_chunked_writes_renewal_lost_with_a_reset_link_is_asked_again():
    p = Pair(layerwise="on", lease_s=30.0)
    job, h = _reserved(p, prompt_len=22)
    p.clock.advance(1)
    p.tx.push_layers([(job, 2)], 2)
    p.link.is_cut = True
    p.run_for(10.5)  # its renewal goes, and is lost
    assert p.sent(KVReserve) == 2 and h.next_ask_at == float("inf")
    p.link.is_cut = False
    p.link.reset()  # the link is made again: asked at once
    p.tx.push_layers([(job, 3)], 2)
    p.pump()
    assert p.sent(KVReserve) == 3 and h.lease.start == p.clock()
    p.run_for(20)  # past the first lease's write deadline
    p.tx.push_layers([(job, None)], 2)
    p.tx.start_writes([job])
    p.tx.set_first_token(job, 7, {})
    p.pump()
    assert p.rx.next_ready().error is None and not p.failed


def test_a_chunked_write_whose_prompt_stops_is_not_renewed_and_fails_at_its_deadline():
    p = Pair(layerwise="on", lease_s=30.0)
    num_free = p.prefix.num_free
    job, h = _reserved(p, prompt_len=22)
    p.clock.advance(1)
    p.tx.push_layers([(job, 2)], 2)  # one chunk, and no pass after it
    p.run_for(40)  # one renewal (pushed since the grant), no second
    assert p.failed and p.retryable == {"r"} and p.sent(KVReserve) == 2
    assert p.prefix.num_free == num_free and p.sent(KVCommit) == 0


def test_a_chunked_write_whose_grant_is_gone_fails_at_the_renewals_answer():
    p = Pair(layerwise="on", lease_s=30.0)
    job, h = _reserved(p, prompt_len=22)
    p.clock.advance(1)
    p.tx.push_layers([(job, 2)], 2)
    p.rx.receive(PREFILL, KVRelease("r", h.reservation))  # as if its lease had ended there
    p.run_for(12)  # the renewal's answer grants other blocks
    assert p.failed == [
        ("r", "its reservation on decode-0 ended during its prefill")
    ] and p.retryable == {"r"}
    p.run_for(35)
    assert "r" not in p.rx.held and p.pool.prefix_cache.num_free == p.pool.prefix_cache.capacity


def test_the_auto_rule():
    assert is_layerwise("auto", UNMEASURED_BYTES, 0.0)
    assert not is_layerwise("auto", UNMEASURED_BYTES - 1, 0.0)
    assert is_layerwise("auto", 10**6, 10**6 / MIN_HIDDEN_S)
    assert not is_layerwise("auto", 10**6, 2 * 10**6 / MIN_HIDDEN_S)
    assert is_layerwise("on", 1, 1e15) and not is_layerwise("off", 10**12, 1.0)


def test_a_layer_that_cannot_be_written_fails_the_handoff_retryable_and_frees_both_sides():
    p = Pair(layerwise="on")
    num_free = p.prefix.num_free
    job, h = _reserved(p)
    p.tx.push_layers([(job, None)], 1)
    writer = h.peer.writer

    def refuse(rid, first, end, blocks=None):
        raise TransferError("the link broke")

    writer.write_layers = refuse
    p.tx.start_writes([job])  # inside the pass: nothing ends here
    assert h.stage is Stage.CANCELLING and "r" in p.tx.by_id
    p.tx.set_first_token(job, 7, {})
    p.pump()
    assert p.failed == [
        ("r", "KV transfer to decode-0 failed: the link broke")
    ] and p.retryable == {"r"}
    assert p.sent(KVCommit) == 0 and p.sent(KVRelease) == 1 and "r" not in p.rx.held
    assert (
        p.prefix.num_free == num_free
        and p.pool.prefix_cache.num_free == p.pool.prefix_cache.capacity
    )


def test_a_write_whose_pass_never_ends_is_stopped_at_its_deadline():
    p = Pair(layerwise="on", lease_s=30.0)
    num_free = p.prefix.num_free
    job, h = _reserved(p)
    p.tx.push_layers([(job, None)], 1)  # and the pass dies: no start_writes
    p.run_for(15)
    assert h.stage is Stage.WRITING and not p.failed
    p.run_for(12)  # past the write's deadline (5/6 of the lease)
    assert p.failed and "r" not in p.tx.by_id and p.retryable == {"r"}
    assert p.prefix.num_free == num_free and p.sent(KVCommit) == 0
    p.run_for(35)
    assert "r" not in p.rx.held and p.pool.prefix_cache.num_free == p.pool.prefix_cache.capacity


def test_a_backend_with_no_layerwise_form_writes_whole_at_the_end():
    p = Pair()
    job, h = _reserved(p)
    tcp = h.peer.writer
    whole = transfer.WholeWrite(tcp)
    whole.begin("r", h.reservation, job.block_ids, h.dst_block_ids, within_s=10)
    whole.write_layers("r", 0, 1)
    whole.flush()
    assert _frames(p) == [] and whole.poll() == []
    assert (
        whole.end("r") == 2 and whole.poll() == [("r", None)] and _frames(p) == [0]
    )  # one frame, both layers
    assert [m.data.shape[0] for m in p.data.sent if isinstance(m, KVTransfer)] == [2]
    whole.begin("s", h.reservation, job.block_ids, h.dst_block_ids, within_s=10)
    whole.cancel("s")
    assert whole.poll() == [("s", "cancelled")] and whole.name == "tcp" and not whole.is_stalled


# ---- each backend, under a real forward pass ------------------------------------------


@pytest.fixture(scope="module")
def workers(make_model):
    model = make_model(layers=4)
    cfg = WorkerConfig(model=str(model), block_size=16, kv_cache_memory=2 * 2**20)
    with (
        DeviceWorker(cfg) as pw,
        DeviceWorker(dataclasses.replace(cfg, is_cache_in_shm=True)) as dw,
    ):
        yield pw, dw


def _backend_pair(workers, backend: str, prompt_len: int):
    """A decode-side receiver with request "r" reserved on dw, and a writer of backend
    from pw's cache into it: (src blocks, scheduler, sink, receiver, reservation, writer,
    frames sent). pw's blocks hold -7 until computed (a layer not yet computed is no match)."""
    pw, dw = workers
    palloc = BlockAllocator(pw.num_kv_blocks)
    palloc.allocate(3)  # so the two nodes' block ids differ
    src = palloc.allocate(num_blocks_for(prompt_len, 16))
    sched = DecodeScheduler(BlockAllocator(dw.num_kv_blocks), 16, 4)
    sched.prefix_cache.allocate(1)
    sink = _sink(dw, [backend])
    from common.handoff.receiver import Receiver
    from tests.handoff_util import reserve

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
    r = reserve(rx, "r", prompt_len, 12)
    dw.kv_cache[:, :, r.block_ids] = 0
    pw.kv_cache[:, :, src] = -7.0
    frames = []
    writer = transfer.open_writer(
        backend, _wire(sink.welcome("e1")), pw.kv_cache, lambda m: frames.append(_wire(m)) or True
    )
    return src, sched, sink, rx, r, writer, frames


def _land(writer, sink, r, frames) -> None:
    """Drive the write to its end, the decode side taking its frames."""
    done, deadline = [], time.monotonic() + 60
    while not (done and sink.is_landed("r")):
        assert time.monotonic() < deadline, "the write did not complete"
        done += writer.poll()
        for f in frames:
            sink.receive(b"p", f, r.block_ids)
        frames.clear()
        sink.progress()
    assert done == [("r", None)]


@pytest.mark.parametrize("backend", ["ipc", pytest.param("nixl", marks=needs_nixl), "tcp", "dist"])
def test_each_backend_lands_the_layers_as_the_pass_computes_them(workers, backend):
    pw, dw = workers
    num_layers = pw.kv_cache.shape[0]
    prompt = list(range(3, 70))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    src, sched, sink, rx, r, writer, frames = _backend_pair(workers, backend, len(prompt))
    posts = []  # nixl: parts posted, and when
    if backend == "nixl":
        post = writer.agent.transfer
        writer.agent.transfer = lambda handle: posts.append(len(seen)) or post(handle)
    # as each layer's KV is written: (layers written, frames sent, layers landed in the decode
    # cache)
    seen = []

    def on_layers(idx, n):
        if not idx:  # no layer done since the last call: what is held back may move
            return writer.flush()
        assert idx == [0]
        if not seen:
            writer.begin("r", r.name, src, r.block_ids, within_s=30)
        writer.write_layers("r", seen[-1][0] if seen else 0, n)
        writer.flush()
        landed = [
            bool(torch.equal(dw.kv_cache[i][:, r.block_ids], pw.kv_cache[i][:, src]))
            for i in range(num_layers)
        ]
        seen.append((n, len(frames), landed))

    def on_kv_queued():  # as the sender does (writes.write): the layers not yet written, if any
        if seen[-1][0] < num_layers:
            writer.write_layers("r", seen[-1][0], num_layers)
        seen.append(("end", writer.end("r")))

    (first,), _ = pw.prefill(
        [PrefillChunk(prompt, 0, src, params)], on_kv_queued=on_kv_queued, on_layers=on_layers
    )
    # Every layer's, the last one's too, before that layer's attention: all during the pass
    assert [s[0] for s in seen] == [1, 2, 3, 4, "end"]
    num_written = seen[-1][1]
    if backend == "tcp":  # a frame for each layer
        assert [s[1] for s in seen[:4]] == [1, 2, 3, 4]
    if backend == "ipc":  # copied straight into the decode cache as computed
        assert [s[2] for s in seen[:4]] == [
            [True, False, False, False],
            [True, True, False, False],
            [True, True, True, False],
            [True, True, True, True],
        ]
    if backend == "nixl":  # parts posted during the pass (the latest held for the notification)
        assert posts and posts[0] < 4
    if backend == "dist":  # no layer-wise form: one whole write after the pass
        assert all(s[1] == 0 for s in seen[:4])
    _land(writer, sink, r, frames)
    assert torch.equal(dw.kv_cache[:, :, r.block_ids], pw.kv_cache[:, :, src])
    commit_and_decode(pw, dw, rx, sched, r, backend, prompt, params, first, num_written)
    writer.close()
    sink.close()


@pytest.mark.parametrize("backend", ["ipc", pytest.param("nixl", marks=needs_nixl), "tcp", "dist"])
def test_each_backend_lands_a_chunked_prompt_chunk_by_chunk(workers, backend):
    """Two passes, tokens [0, 40) and [40, 67): the first pushes blocks 0-1 (block 2 is not
    whole yet), the second blocks 2-4; the decode node goes on from them token for token."""
    pw, dw = workers
    num_layers = pw.kv_cache.shape[0]
    prompt = list(range(5, 72))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    src, sched, sink, rx, r, writer, frames = _backend_pair(workers, backend, len(prompt))
    writer.begin("r", r.name, src, r.block_ids, within_s=30)
    sent = [0]  # layers of this pass's blocks written

    def run_pass(chunk: PrefillChunk, blocks: range):
        def on_layers(idx, n):
            if idx and n > sent[0]:
                writer.write_layers("r", sent[0], n, blocks)
                sent[0] = n
            writer.flush()

        def on_kv_queued():
            if chunk.params is not None:  # the last chunk
                writer.write_layers("r", sent[0], num_layers, blocks)
                on_kv_queued.num_written = writer.end("r")

        (token,), _ = pw.prefill([chunk], on_kv_queued=on_kv_queued, on_layers=on_layers)
        if chunk.params is None and sent[0] < num_layers:
            writer.write_layers("r", sent[0], num_layers, blocks)
        sent[0] = 0
        return token, getattr(on_kv_queued, "num_written", None)

    run_pass(PrefillChunk(prompt[:40], 0, src[:3]), range(0, 2))
    if backend == "tcp":  # frames of blocks 0-1 only
        assert frames and all(
            f.header.get("first_block", 0) == 0 and f.data.shape[2] == 2 for f in frames
        )
    if backend == "ipc":  # blocks 0-1 copied, every layer; block 2 not yet
        assert torch.equal(dw.kv_cache[:, :, r.block_ids[:2]], pw.kv_cache[:, :, src[:2]])
        assert not dw.kv_cache[:, :, r.block_ids[2:]].any()
    first, num_written = run_pass(PrefillChunk(prompt[40:], 40, src, params), range(2, 5))
    _land(writer, sink, r, frames)
    assert torch.equal(dw.kv_cache[:, :, r.block_ids], pw.kv_cache[:, :, src])
    commit_and_decode(pw, dw, rx, sched, r, backend, prompt, params, first, num_written)
    writer.close()
    sink.close()


@pytest.mark.parametrize("mode, is_early", [("on", False), ("off", True)])
def test_a_prompt_to_push_layer_by_layer_waits_for_its_grant_before_its_pass(mode, is_early):
    """A decode node that granted at once lets the next prompt start before its grant
    (it will be there when the pass ends), but a write pushed during the pass needs it."""
    p = Pair(layerwise=mode)
    _reserved(p, "a")
    job = p.job("b")
    p.tx.begin(job)
    assert job.is_peer_granting is is_early


def test_the_rate_auto_uses_is_timed_to_the_acknowledgement_of_large_whole_writes():
    from types import SimpleNamespace

    f = TransferFigures()
    whole = SimpleNamespace(layers_sent=-1, write_started=10.0)
    writes.observe_ack(whole, f, 10.5, 2**20)  # 1 MiB in 0.5 s
    assert f.bytes_per_s == 2**21
    writes.observe_ack(
        whole, f, 10.001, writes.MIN_RATE_BYTES - 1
    )  # small: its latency, not the link's rate
    writes.observe_ack(
        SimpleNamespace(layers_sent=3, write_started=10.0), f, 99.0, 2**30
    )  # pushed: no rate
    assert f.bytes_per_s == 2**21
    writes.observe_ack(whole, f, 11.0, 2**20)  # a moving average
    assert f.bytes_per_s == 0.8 * 2**21 + 0.2 * 2**20
