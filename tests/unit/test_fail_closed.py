"""Fail closed, in one process: whatever a peer, a middlebox or a client does, no
request is decoded from KV that did not all land, nothing is held past its bound,
and no loop does unbounded work for one message. Each test names the defect it
guards (issue "fail closed", items 1-7)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import msgpack
import pytest
import torch
import torch.distributed as dist

from common import transfer
from common.base.request import SamplingParams, validate_prompt
from common.handoff.states import Stage
from common.kv.blocks import BlockAllocator
from common.transfer import dist as dist_backend
from common.wire import codec, protocol
from common.wire.channel import Channel, node_tag, open_context
from common.wire.keys import load_keys, make_keys
from common.wire.protocol import KVCommit, KVReserve, KVTransfer
from decode_node.scheduler import DecodeScheduler
from tests.handoff_util import PREFILL, Pair, commit, receiver, reserve
from tests.tcp_proxy import Proxy


def _handoff(p: Pair, rid: str, **job):
    j = p.job(rid, **job)
    p.tx.begin(j)
    p.pump()
    return j, p.tx.by_id[rid]


# ---- 1. a write that cannot finish ---------------------------------------------------


def test_a_write_the_link_refuses_is_stopped_at_its_deadline_and_frees_both_sides():
    p = Pair(lease_s=30.0, handoff_lease_s=60.0)
    num_free = p.prefix.num_free
    job, h = _handoff(p, "r", prompt_len=10)
    p.link.is_refusing = p.data.is_refusing = True  # the decode host dropped off after granting
    p.tx.start_writes([job])
    p.tx.set_first_token(job, 3, {})
    p.tx.advance()
    assert h.stage is Stage.WRITING
    assert not p.tx.is_writing  # it only waits on its peer: the loop does not spin on it
    deadline = h.lease.write_deadline
    assert deadline == pytest.approx(h.lease.end - 5.0)  # a sixth of the lease before its end
    while p.clock() <= deadline:
        p.clock.advance(1.0)
        p.tx.advance()
        assert "r" in p.tx.by_id
    p.tx.advance()  # the writer drops it; the next turn ends the handoff
    p.tx.advance()
    assert "r" not in p.tx.by_id and "r" in p.retryable and p.prefix.num_free == num_free
    assert p.clock() < h.lease.end  # freed before the decode node may reuse the blocks
    p.link.is_refusing = False  # its release could not be sent: the lease frees it there,
    p.run_for(h.lease.end - p.clock() + 1.0)  # after one more (its writer, never heard, might be
    assert p.rx.held["r"].is_quarantined  # one whose copies land unseen: ipc)
    p.run_for(p.rx.lease_s)
    assert "r" not in p.rx.held


def test_a_dist_send_whose_peer_never_comes_ends_at_its_deadline():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cache = torch.randn(2, 2, 8, 4, 1, 2)
    writer = dist_backend.DistWriter(f"127.0.0.1:{store.port}", cache, lambda m: True)
    try:
        first_group = writer.group
        assert writer.write("r", "g", [1, 2], [3, 4], within_s=1.0) == 1
        t0, ended = time.monotonic(), []
        while not ended:
            assert time.monotonic() - t0 < 10, "the send was never given up"
            ended = writer.poll()
            time.sleep(0.05)
        ((rid, why),) = ended
        assert rid == "r" and "before its reservation could end" in why
        assert writer.group != first_group  # later sends go on a group of their own
    finally:
        writer.close()


# ---- 2. a peer is what it proves, not its connection ------------------------------------------


def test_a_reset_connection_is_the_same_peer_on_a_new_route(tmp_path):
    make_keys(tmp_path, ["decode-0", "prefill-0"])
    server_ctx = open_context(load_keys(tmp_path, "decode-0"))
    client_ctx = open_context(load_keys(tmp_path, "prefill-0"))
    router = Channel(server_ctx, True, "tcp://127.0.0.1:0", domain="nodes")
    port = int(router.sock.getsockopt_string(__import__("zmq").LAST_ENDPOINT).rsplit(":", 1)[1])
    with Proxy(port) as proxy:
        tag = node_tag("prefill-0", "77-abcd")
        dealer = Channel(client_ctx, False, proxy.endpoint, tag=tag, server="decode-0")
        try:

            def round_trip(rid: str) -> bytes:
                assert dealer.send(KVReserve(rid, 4, 4))
                assert router.has_message(10)
                sender, msg = router.recv()
                assert isinstance(msg, KVReserve) and msg.request_id == rid
                assert router.send(protocol.KVReserved(rid, "e", None, True, "full"), to=sender)
                assert dealer.has_message(10), "the reply did not reach the peer's connection"
                assert dealer.recv()[1].request_id == rid
                return sender

            before = round_trip("a")
            assert before == tag.encode() and router.peer_name(before) == "prefill-0"
            assert dealer.take_reconnects() == 0
            assert proxy.reset() == 1
            deadline = time.monotonic() + 10
            while not dealer.take_reconnects():
                assert time.monotonic() < deadline, "the peer did not connect again"
                time.sleep(0.02)
            assert round_trip("b") == before  # the same peer, on a new route
            assert router.take_rerouted() == [before] and router.num_reroutes == 1
            # A peer with another key may not speak under this tag.
            make_keys(tmp_path, ["rogue"])
            rogue_ctx = open_context(load_keys(tmp_path, "rogue"))
            rogue = Channel(rogue_ctx, False, f"tcp://127.0.0.1:{port}", tag=tag, server="decode-0")
            rogue.send(KVReserve("c", 4, 4))
            assert router.has_message(10)
            sender, msg = router.recv()
            assert sender != before and "proved the key of 'rogue'" in msg.error
            rogue.close()
            rogue_ctx.term()
        finally:
            dealer.close()
            router.close()
            client_ctx.term()
            server_ctx.term()


def test_a_data_connection_takes_only_a_few_frames_and_wakes_its_loop_when_it_takes_more():
    """A write's frames wait in the writer once its data connection is full (it picks what
    goes next); the loop's wait ends as soon as the connection can take a frame again."""
    import zmq

    from common.wire.channel import Poller

    ctx = open_context()
    sink = ctx.zmq.socket(zmq.ROUTER)  # a decode node too busy to read: nothing is taken
    sink.setsockopt(zmq.RCVHWM, 1)
    sink.setsockopt(zmq.RCVBUF, 2**16)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    data = Channel(
        ctx, False, f"tcp://127.0.0.1:{port}", tag="prefill-0/1/kv", is_immediate=True, max_queued=2
    )
    poller = Poller(data)
    try:
        frame = KVTransfer("r", "g", "tcp", {"first_layer": 0}, torch.zeros(2**18))  # 1 MiB
        deadline, num_sent = time.monotonic() + 20, 0
        while True:  # until it stays full
            while data.send(frame, block=False):
                num_sent += 1
            if num_sent and not poller.wait(0.3, (data,)):
                break
            assert time.monotonic() < deadline
        # what the kernels' buffers hold, and the queue of max_queued, no more
        assert 2 <= num_sent <= 40, num_sent
        for _ in range(num_sent):  # the decode node reads: room again
            sink.recv_multipart()
            if poller.wait(0.1, (data,)):
                break
        else:
            raise AssertionError("the wait did not end once the connection took frames again")
        assert poller.wait(0.05) == []  # only a wait that asks for it wakes on room
    finally:
        data.close()
        sink.close(linger=0)
        ctx.term()


def test_a_reservation_stays_its_prefill_nodes_across_a_reset_of_the_link():
    p = Pair()
    job, h = _handoff(p, "r", prompt_len=10)
    granted = p.rx.held["r"].name
    p.link.reset()  # an ask, an answer, anything on the way is lost
    p.pump()  # the link made again: asked at once, answered the same
    assert p.tx.num_link_resets == 1 and h.stage is Stage.RESERVED
    assert p.rx.held["r"].name == granted and h.reservation == granted
    p.tx.start_writes([job])
    p.tx.set_first_token(job, 3, {})
    p.pump()
    assert p.rx.next_ready().error is None and not p.failed


def test_a_commit_repeated_after_a_reset_is_the_same_commit():
    p = Pair()
    job, h = _handoff(p, "r", prompt_len=10)
    p.tx.start_writes([job])
    p.pump()
    p.tx.set_first_token(job, 3, {})
    p.rx.receive(PREFILL, protocol.decode(p.link.to_decode.popleft(), protocol.PREFILL_TO_DECODE))
    p.link.reset()  # the ack is lost; the commit goes again
    p.pump()
    assert "r" not in p.tx.by_id and not p.failed and p.tx.num_handoffs == 1
    assert p.rx.next_ready().request_id == "r"


# ---- 3. a client cannot make a loop walk millions of items ---------------------------------------


def test_lists_are_refused_by_their_length_before_their_items():
    ids = [-1] + list(range(2_000_000))  # its first item is bad too
    frames = [
        msgpack.packb({"v": 2, "type": "generate", "request_id": "big", "prompt_token_ids": ids})
    ]
    with pytest.raises(
        codec.ProtocolError, match="prompt_token_ids holds more than 65536 items"
    ) as e:
        protocol.decode_from(frames, protocol.CLIENT_TO_FRONTEND, max_list_len=65536)
    assert e.value.request_id == "big"  # the error reaches its request
    with pytest.raises(codec.ProtocolError, match="longer than 64"):
        protocol.decode(
            [
                msgpack.packb(
                    {
                        "v": 2,
                        "type": "generate",
                        "request_id": "s",
                        "prompt": "x",
                        "stop": [1] * 20_000,
                    }
                )
            ]
        )
    with pytest.raises(ValueError, match="exceeds the model's maximum length"):
        validate_prompt([-1] * 5000, 16, 512, 1024)  # the length is said, not the first bad id


def test_text_no_model_length_can_take_is_refused_unread(tiny_model):
    from transformers import AutoTokenizer

    from frontend.prompts import check_size, max_prompt_chars

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    cap = max_prompt_chars(tok, 1024)
    longest = max(len(tok.convert_tokens_to_string([t])) for t in tok.get_vocab())
    assert cap >= 1024 * longest  # nothing that fits is refused
    req = protocol.GenerateRequest("r", prompt="x" * (cap + 1))
    with pytest.raises(ValueError, match="characters"):
        check_size(req, cap)
    with pytest.raises(ValueError, match="stop strings"):
        check_size(protocol.GenerateRequest("r", prompt="x", stop=["y" * 1000] * 17), cap)


def test_a_loop_held_up_does_not_make_live_nodes_dead():
    from frontend.nodes import NodeRegistry

    reg = NodeRegistry(
        SimpleNamespace(
            links=SimpleNamespace(dead_after_s=3.0), hung_after_s=30.0, forget_after_s=60.0
        ),
        False,
        None,
        None,
        lambda: None,
    )
    node = SimpleNamespace(last_seen=100.0)
    reg.nodes = {"decode-0": node}
    reg.excuse(5.0)  # the loop was held up 5 s: no heartbeat was read
    assert node.last_seen == 105.0


def test_a_restarted_node_takes_its_name_once_its_predecessor_misses_two_heartbeats():
    """Defect: a node restarted by its supervisor was refused ("a live decode node named ...
    is registered") until its dead predecessor had been silent for --dead-after: the
    requests moving to it meanwhile were routed to the dead process."""
    import asyncio

    from common.wire.protocol import NodeReady
    from frontend.nodes import NodeRegistry
    from frontend.router import NodeState

    lost, replies = [], []

    async def on_lost(node, cause, why):
        lost.append((node.ready.pid, cause))

    async def send(msg, to):
        replies.append(msg)

    cfg = SimpleNamespace(
        links=SimpleNamespace(dead_after_s=3.0, heartbeat_s=0.5),
        hung_after_s=30.0,
        forget_after_s=60.0,
    )
    reg = NodeRegistry(cfg, False, on_lost, None, lambda: None)
    reg.link = SimpleNamespace(send=send)

    def ready(pid):
        return NodeReady(
            "decode", "decode-0", pid, str(pid), "cpu", 8, 16, 256, kv_endpoint="tcp://127.0.0.1:1"
        )

    now = time.monotonic()
    reg.nodes["decode-0"] = NodeState(ready(1), b"decode-0/1", now)
    asyncio.run(reg.on_ready(b"decode-0/2", ready(2)))  # a twin while the first beats: refused
    assert not replies[-1].is_accepted and "is registered" in replies[-1].reason and not lost
    reg.nodes["decode-0"].last_seen = now - 1.2  # two heartbeats missed ...
    reg.checked_at = now - 1.0  # ... but the loop was held up since
    asyncio.run(reg.on_ready(b"decode-0/3", ready(3)))  # its last look: not judged yet
    assert not replies[-1].is_accepted and not lost
    reg.checked_at = now  # the watchdog's look: it is gone
    asyncio.run(reg.on_ready(b"decode-0/3", ready(3)))
    assert (
        replies[-1].is_accepted
        and lost == [(1, "restarted")]
        and reg.nodes["decode-0"].ready.pid == 3
    )


# ---- 4. a commit without all of its KV, or for another grant ------------------------------------


def _deliver_control(p: Pair) -> None:
    """Only what is on the control connection arrives (a commit overtakes the KV on the data
    one)."""
    while p.link.to_decode:
        p.rx.receive(
            PREFILL, protocol.decode(p.link.to_decode.popleft(), protocol.PREFILL_TO_DECODE)
        )


def test_a_commit_that_overtakes_its_kv_waits_for_it():
    p = Pair()
    job, h = _handoff(p, "r", prompt_len=10)
    src = p.src[:, :, job.block_ids].clone()
    p.tx.start_writes([job])
    p.tx.advance()  # the frames are on the data connection ...
    assert p.data.sent and all(isinstance(m, KVTransfer) for m in p.data.sent)
    assert not any(isinstance(m, KVTransfer) for m in p.link.sent)
    p.tx.set_first_token(job, 3, {})
    _deliver_control(p)  # ... and the commit comes first: held, not refused
    assert (
        p.rx.held["r"].commit is not None and p.rx.num_early_commits == 1 and not p.link.to_prefill
    )
    assert p.rx.next_ready() is None
    p.pump()  # the KV lands: the commit is taken
    assert "r" not in p.tx.by_id and not p.failed and p.rx.num_incomplete == 0
    r = p.rx.next_ready()
    assert r.request_id == "r" and r.error is None and torch.equal(p.dst[:, :, r.block_ids], src)


def test_a_reset_of_the_data_connection_fails_what_it_carried_at_once():
    p = Pair(lease_s=30.0, handoff_lease_s=60.0)
    num_free, num_decode_free = p.prefix.num_free, p.pool.prefix_cache.num_free
    job, h = _handoff(p, "r", prompt_len=10)
    p.tx.start_writes([job])
    p.tx.advance()  # the frames are on the data connection ...
    p.data.to_decode.clear()  # ... and lost: a middlebox reset it, and it is made again
    p.data.reset()
    p.tx.set_first_token(job, 3, {})
    p.pump()  # no lease has to end
    assert "r" not in p.tx.by_id and "r" in p.retryable  # it moves on
    assert any("may be lost" in e for _, e in p.failed) and p.tx.num_link_resets == 1
    assert (
        "r" not in p.rx.held
        and p.prefix.num_free == num_free
        and p.pool.prefix_cache.num_free == num_decode_free
    )
    assert p.rx.next_ready() is None  # never decoded


def test_kv_that_never_comes_fails_its_commit_when_the_lease_ends():
    p = Pair(lease_s=5.0, handoff_lease_s=60.0)
    num_decode_free = p.pool.prefix_cache.num_free
    job, h = _handoff(p, "r", prompt_len=10)
    p.tx.start_writes([job])
    p.tx.advance()
    p.data.to_decode.clear()  # lost with nothing said (no reset seen)
    p.tx.set_first_token(job, 3, {})
    p.pump()
    assert p.rx.held["r"].commit is not None and "r" in p.tx.by_id
    p.run_for(6.0)
    assert "r" not in p.tx.by_id and "r" in p.retryable
    assert any("did not all arrive within 5s of its commit" in e for _, e in p.failed)
    assert (
        "r" not in p.rx.held
        and p.pool.prefix_cache.num_free == num_decode_free
        and p.rx.next_ready() is None
    )


def test_a_commit_saying_less_than_a_whole_write_is_refused_at_once():
    p = Pair()
    reserve(p.rx, "r", 8, 4, sender=PREFILL)
    r = p.rx.held["r"]
    p.rx.receive(
        PREFILL, KVCommit("r", 8, 1, SamplingParams(max_tokens=4), {}, "tcp", [1] * 8, r.name, 1)
    )
    assert "r" not in p.rx.held and p.rx.num_incomplete == 1 and p.rx.num_early_commits == 0


def test_only_kv_is_taken_from_a_data_connection():
    p = Pair()
    reserve(p.rx, "r", 8, 4, sender=PREFILL)
    name = p.rx.held["r"].name
    p.rx.receive(
        PREFILL + b"/kv",
        KVCommit("r", 8, 1, SamplingParams(max_tokens=4), {}, "tcp", [1] * 8, name, 2),
    )
    assert p.rx.held["r"].commit is None and p.rx.num_early_commits == 0  # dropped: not its to say


def test_a_commit_for_a_grant_of_an_earlier_life_is_refused():
    """A decode node restarted between a renewal and a write: the renewal reached the new
    process, which granted blocks of its own; the commit names the old grant."""
    p = Pair()
    job, h = _handoff(p, "r", prompt_len=10)
    old_grant = h.reservation
    rx = p.start_decode("e2")
    r = reserve(rx, "r", 10, 4, sender=PREFILL)
    assert r.name != old_grant
    c = rx.sink.cache
    rx.receive(
        PREFILL,
        KVTransfer(
            "r",
            old_grant,
            "tcp",
            {"first_layer": 0},
            torch.zeros(c.shape[0], 2, len(r.block_ids), *c.shape[3:]),
        ),
    )
    rx.receive(
        PREFILL,
        KVCommit(
            "r", 10, 1, SamplingParams(max_tokens=4), {}, "tcp", [1] * 10, old_grant, c.shape[0]
        ),
    )
    assert "r" not in rx.held and rx.num_incomplete == 1 and rx.next_ready() is None


def test_kv_verify_refuses_blocks_that_do_not_hold_what_was_written():
    p = Pair()
    p.tx.checksums = lambda ids, wire: transfer.block_checksums(p.src, ids, wire)
    p.rx.is_verifying = True
    for rid, is_corrupt in (("good", False), ("bad", True)):
        job, h = _handoff(p, rid, prompt_len=10)
        p.tx.start_writes([job])
        p.tx.set_first_token(job, 3, {})
        p.pump()
        if is_corrupt:  # a mix-up of blocks after they landed
            r = p.rx.held[rid]
            p.dst[:, :, r.block_ids[1]] = p.dst[:, :, r.block_ids[0]]
        got = p.rx.next_ready()
        assert (got.error is not None) == is_corrupt, got.error
    assert "differ" in got.error and p.rx.num_verify_failures == 1
    # A commit with no checksums at all is refused by a verifying decode node.
    rx = receiver(DecodeScheduler(BlockAllocator(9), 4, 4, True))
    rx.is_verifying = True
    reserve(rx, "x", 8, 4)
    commit(rx, "x", 8, 4)
    assert "x" not in rx.held and rx.num_incomplete == 1


# ---- 5. nixl stops a late write before its blocks can be reused --------------------------------


def test_writes_are_given_the_write_deadline_not_the_leases_end():
    p = Pair(lease_s=30.0)
    job, h = _handoff(p, "r", prompt_len=10)
    seen = {}
    writer = h.peer.writer
    real = writer.write
    writer.write = lambda *a, within_s, **kw: (
        seen.setdefault("within_s", within_s) and real(*a, within_s=within_s, **kw)
    )
    p.tx.start_writes([job])
    assert seen["within_s"] == pytest.approx(h.lease.write_deadline - p.clock())
    assert seen["within_s"] <= h.lease.end - p.clock() - 30.0 / 6


def test_a_posted_nixl_write_past_its_deadline_is_stopped_before_it_is_driven():
    from common.transfer.nixl import NixlWriter, _Part, _Write

    calls = []
    agent = SimpleNamespace(
        check_xfer_state=lambda handle: calls.append("driven") or "DONE",
        transfer=lambda handle: calls.append("posted") or "PROC",
        remove_remote_agent=lambda remote: calls.append("dropped"),
    )
    w = NixlWriter.__new__(NixlWriter)
    w.agent, w.remote, w.desc = agent, "decode-agent", SimpleNamespace(agent="decode-agent")
    handle = SimpleNamespace(release=lambda: None)
    w._writes = {
        "r": _Write(
            [],
            [],
            "g",
            time.monotonic() - 0.1,
            [_Part(handle, None, True, is_posted=True)],
            is_open=False,
            is_announced=True,
            is_posted=True,
        )
    }
    assert w.poll() == [("r", "it did not complete before its reservation could end")]
    assert calls == ["dropped"] and w.remote is None  # never driven on: its connection is dropped


# ---- 6. a lost prefill node's reservations go at once ------------------------------------------


def test_a_lost_prefill_nodes_reservations_are_freed_as_far_as_is_safe():
    rx = receiver(DecodeScheduler(BlockAllocator(33), 4, 8, True))
    a, b = node_tag("prefill-0", "1-aa").encode(), node_tag("prefill-1", "2-bb").encode()
    for rid, sender in (("a1", a), ("a2", a), ("b1", b)):
        reserve(rx, rid, 8, 4, sender=sender)
    commit(rx, "a2", 8, 4, sender=a)  # committed: its request is the decode node's
    assert rx.drop_peer(a, is_exited=False) == 1  # it wrote with tcp: no late write can land
    assert set(rx.held) == {"a2", "b1"}
    reserve(rx, "b2", 8, 4, sender=b)  # b never wrote: its backend could be one-sided
    assert rx.drop_peer(b, is_exited=False) == 0 and {"b1", "b2"} <= set(rx.held)
    assert rx.drop_peer(b, is_exited=True) == 2 and set(rx.held) == {"a2"}


# ---- 7. the smaller ones ------------------------------------------------------------------------


def test_a_moved_request_keeps_the_preemptions_of_its_earlier_lives():
    from frontend.migrate import Migrations

    m = Migrations(SimpleNamespace())
    req = SimpleNamespace(num_migrations=0, earlier_parts={}, timings={})
    req.timings.update(
        m.timings(req, {"queue_ms": 1.0, "num_preemptions": 2, "preempted_ms": 40.0})
    )
    req.earlier_parts = {
        k: req.timings[k] for k in ("num_preemptions", "preempted_ms")
    }  # as _move does
    req.num_migrations = 1
    req.timings.update(m.timings(req, {"queue_ms": 9.0, "num_preemptions": 1, "preempted_ms": 5.0}))
    assert req.timings == {"queue_ms": 1.0, "num_preemptions": 3, "preempted_ms": 45.0}


def test_dist_receive_buffers_are_made_one_at_a_time_not_per_announcement(tiny_model):
    cache = torch.zeros(2, 2, 40, 4, 1, 2)
    r = dist_backend.DistReceiver(transfer.LocalCache(cache, "127.0.0.1"))
    try:
        for i in range(30):
            r.receive(
                b"p",
                KVTransfer(
                    f"r{i}",
                    "g",
                    "dist",
                    {"group": "grp", "tag": i},
                    torch.empty(0, dtype=torch.uint8),
                ),
                [1, 2, 3],
            )
        assert all(recv.buf is None for recv in r._recvs.values())  # nothing allocated ahead
        assert sum(r.num_received(f"r{i}") for i in range(30)) == 30
    finally:
        r.close()


def test_shared_segments_of_another_pid_namespace_are_left_alone():
    from common.engine import platform_cpu as platform

    ns = platform._pid_namespace()
    dead = 2**22 + 12345  # beyond pid_max: no such process
    ours, theirs = f"{platform.SHM_PREFIX}-{ns}-{dead}-test", f"{platform.SHM_PREFIX}-1-{dead}-test"
    for name in (ours, theirs):
        open(f"/dev/shm/{name}", "wb").close()
    try:
        platform._remove_stale_segments()
        assert not os.path.exists(f"/dev/shm/{ours}") and os.path.exists(f"/dev/shm/{theirs}")
    finally:
        for name in (ours, theirs):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_a_whole_write_refused_as_it_ends_a_pushed_one_is_ended_and_frees_its_blocks():
    """A writer with no layer-wise form (dist) starts a write begun during the pass at its
    end; refused then (its process group broke), the handoff still ends: failed, retryable,
    its blocks freed on this side, not held until the decode node restarts."""
    from common.transfer.backend import WholeWrite

    class Broken:  # a WholeWriter whose pipe failed
        name, is_stalled, wire_dtypes = "tcp", True, ()

        def __init__(self, src):
            self.src = src

        def write(self, *a, **kw):
            raise transfer.TransferError("the KV process group failed")

        def poll(self):
            return []

        def cancel(self, request_id):
            pass

        def close(self):
            pass

    class BrokenPair(Pair):
        def _open_writer(self, welcome, send):
            return WholeWrite(Broken(self.src))

    p = BrokenPair(layerwise="on")
    num_free = p.prefix.num_free
    job = p.job("r", prompt_len=10)
    p.tx.begin(job)
    p.pump()
    p.tx.push_layers([(job, None)], 1)  # begun during the pass
    p.tx.start_writes([job])  # ended: the inner write is refused
    p.tx.set_first_token(job, 3, {})
    p.run_for(5.0)
    assert [rid for rid, _ in p.failed] == ["r"] and "r" in p.retryable
    assert "process group failed" in p.failed[0][1]
    assert p.prefix.num_free == num_free and not p.tx.by_id


def test_a_client_cannot_speak_or_be_answered_as_another_by_a_from_tag():
    """Defect (hunt): the client port named a sender by its message's "from" tag, as a node
    link does, so one client could abort another's request, take its replies (they went
    to the tagging connection, for good) and pass for many clients under the per-client
    limits. A ROUTER of clients refuses a tagged message and names every client by its
    connection; a node link still names its peer by the tag."""
    import asyncio

    import zmq

    from common.wire.channel import AsyncChannel, open_async_context
    from common.wire.protocol import CLIENT_TO_FRONTEND, AbortRequest

    def tagged(msg, tag: str) -> list[bytes]:
        frames = protocol.encode(msg)
        header = msgpack.unpackb(frames[0], raw=False)
        return [msgpack.packb({**header, "from": tag}, use_bin_type=True), *frames[1:]]

    async def run(takes_tags: bool):
        ctx = open_async_context()
        router = AsyncChannel(ctx, True, "tcp://127.0.0.1:0", takes_tags=takes_tags)
        endpoint = router.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        raw = zmq.Context()
        victim, attacker = raw.socket(zmq.DEALER), raw.socket(zmq.DEALER)
        victim.setsockopt(zmq.IDENTITY, b"victim")
        try:
            for s in (victim, attacker):
                s.connect(endpoint)
            victim.send_multipart(protocol.encode(AbortRequest("v1")))
            attacker.send_multipart(tagged(AbortRequest("v1"), "victim"))
            seen = [await asyncio.wait_for(router.recv(CLIENT_TO_FRONTEND), 10) for _ in "ab"]
        finally:
            victim.close(0)
            attacker.close(0)
            raw.term()
            router.close()
            ctx.term()
        return seen, router.num_bad

    seen, num_bad = asyncio.run(run(takes_tags=False))
    senders = {sender for sender, _ in seen}
    assert b"victim" in senders and len(senders) == 2 and num_bad == 1
    refused = next(msg for sender, msg in seen if sender != b"victim")
    assert "carries no 'from' tag" in refused.error and refused.request_id == "v1"
    seen, num_bad = asyncio.run(run(takes_tags=True))  # a node link: the tag names the peer
    assert {sender for sender, _ in seen} == {b"victim"} and num_bad == 0
