"""A ZeroMQ client that cannot take its replies (gone, or not reading): its requests end,
on the frontend's own classes and on a real socket (no node runs)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import zmq

from common.wire.channel import AsyncChannel, open_async_context
from common.wire.protocol import GenerateOutput, GenerateRequest, KVTransfer, StatsRequest
from tests.unit import test_intake
from tests.unit.test_intake import _settled

# test_intake's fixture: a frontend with nodes registered (NodeStates), no process.
make_frontend = test_intake.make_frontend


class Clients:
    """The client socket, as the frontend sees it: what send() says, per client."""

    def __init__(self):
        self.verdicts: dict[bytes, str | None] = {}
        self.sent: list[tuple[bytes, object]] = []
        self.num_bad = self.num_calls = 0

    async def send(self, msg, to: bytes) -> str | None:
        self.num_calls += 1
        why = self.verdicts.get(to)
        if why is None:
            self.sent.append((to, msg))
        return why


class NodeLink:
    async def send(self, msg, to: bytes) -> None:
        pass


async def _dropped(fe) -> None:
    """Every drop under way has ended."""
    while fe.client_link._tasks:
        await asyncio.sleep(0)


@pytest.mark.parametrize("why", ["full", "gone"])
def test_a_client_that_cannot_take_a_reply_has_every_request_aborted(make_frontend, why):
    fe = make_frontend(16)
    fe.clients = Clients()

    async def run():
        await fe.submit(b"a", GenerateRequest("x", prompt_token_ids=[1, 2, 3], max_tokens=9, n=3))
        await fe.submit(b"a", GenerateRequest("y", prompt_token_ids=[4, 5], max_tokens=9))
        await fe.submit(b"b", GenerateRequest("z", prompt_token_ids=[6], max_tokens=9))
        await _settled(fe)
        assert len(fe.requests) == 5 and fe.client_link.num_dropped == 0
        fe.clients.verdicts[b"a"] = why
        await fe.reply(b"a", StatsRequest())  # any reply: a's cannot be taken
        await _dropped(fe)
        # the same again (a's requests are gone): nothing more to drop
        await fe.reply(b"a", StatsRequest())
        await _dropped(fe)

    asyncio.run(run())
    assert fe.client_link.num_dropped == 1
    assert [r.request_id for r in fe.requests.values()] == ["z"]
    assert list(fe.admission.clients) == [b"b"] and fe.admission.items_of(b"a") == []
    assert not [k for k in fe.by_client if k[0] == b"a"]
    assert fe.clients.sent == []  # b's request was not touched: nothing said to it


def test_a_dropped_clients_tokens_still_in_flight_are_not_sent(make_frontend):
    """A reply that fails inside a drop (each aborted request's last message) is not a
    second drop."""
    fe = make_frontend(16)
    fe.clients = Clients()

    async def run():
        await fe.submit(b"a", GenerateRequest("x", prompt_token_ids=[1, 2, 3], max_tokens=9, n=2))
        await _settled(fe)
        fe.clients.verdicts[b"a"] = "gone"
        await fe.client_link.send(b"a", GenerateOutput("x", [7], "a"))
        await _dropped(fe)

    asyncio.run(run())
    assert fe.client_link.num_dropped == 1 and not fe.requests
    assert fe.clients.num_calls == 3  # the output, then each choice's last message, once


def test_a_drop_never_ends_requests_under_a_lost_nodes_walk(make_frontend):
    """Defect: the drop ran inside the reply that was refused, so a lost node's walk over
    its requests, replying to one that could move no more, saw the drop end the next one
    under it and moved a finished request (a KeyError: the frontend's watchdog died)."""
    fe = make_frontend(16)
    fe.clients, fe.node_link = Clients(), NodeLink()

    async def run():
        for rid in ("r1", "r2"):
            await fe.submit(b"a", GenerateRequest(rid, prompt_token_ids=[1, 2, 3], max_tokens=50))
        await _settled(fe)
        while fe.admission.num_waiting:
            assert await fe.dispatcher.send_next()
        r1, r2 = fe.requests.values()
        assert r1.decode_node == r2.decode_node == "decode-0"
        r1.num_migrations = fe.cfg.max_migrations  # moved as often as it may: it fails
        fe.clients.verdicts[b"a"] = "gone"
        await fe.migrations.node_lost(fe.nodes["decode-0"], "dead", "killed")
        await _dropped(fe)
        return r2

    r2 = asyncio.run(run())
    assert not fe.requests and fe.client_link.num_dropped == 1
    assert r2.num_migrations == 1  # moved before the drop (in its own task) ended it


def test_the_client_socket_refuses_a_peer_gone_or_not_reading_without_waiting():
    ctx = open_async_context()
    sink = ctx.zmq.socket(zmq.DEALER)  # a client that never reads
    sink.setsockopt(zmq.RCVHWM, 1)
    sink.setsockopt(zmq.RCVBUF, 2**16)
    sink.setsockopt(zmq.LINGER, 0)

    async def run():
        router = AsyncChannel(ctx, True, "tcp://127.0.0.1:0", max_queued=2)
        try:
            port = router.sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
            sink.connect(f"tcp://127.0.0.1:{port}")
            sink.send(b"hello")  # the router learns its routing id from a message
            route, _ = await asyncio.wait_for(router.recv(), 10)
            assert await router.send(StatsRequest(), to=b"nobody") == "gone"
            frame = KVTransfer("r", "g", "tcp", {"first_layer": 0}, torch.zeros(2**18))  # 1 MiB
            num_sent, deadline = 0, time.monotonic() + 20
            while (why := await router.send(frame, to=route)) is None:
                num_sent += 1
                assert time.monotonic() < deadline
                await asyncio.sleep(0.001)  # the I/O thread moves frames to the kernel
            # what the kernels' buffers hold, and the queue of max_queued, no more
            assert why == "full" and 2 <= num_sent <= 40, (why, num_sent)
        finally:
            router.close()

    try:
        asyncio.run(run())
    finally:
        sink.close()
        ctx.term()


def test_the_client_library_refuses_an_id_the_frontend_would_refuse_unnamed():
    """Review: the frontend refuses an id with a control character (or past 256 characters)
    without naming it, so the async client could not tie the refusal to its request and
    waited out its idle timeout. The library refuses such an id before it sends."""
    from common.wire.protocol import GenerateRequest
    from frontend.client import Client
    from frontend.client_messages import make_request

    assert make_request("hi", request_id="ok id, ünïcode").request_id == "ok id, ünïcode"
    for rid in ("a\nb", "x" * 257, "a\u2028b"):
        with pytest.raises(ValueError, match="no control characters"):
            make_request("hi", request_id=rid)
        with pytest.raises(ValueError, match="no control characters"):  # before any connect
            Client("tcp://127.0.0.1:1").submit(GenerateRequest(request_id=rid, prompt="hi"))
