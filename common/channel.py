"""Typed channels over ZeroMQ. Nodes and the frontend send and receive messages
through these; nothing else touches zmq or msgpack.

Topology (every endpoint derives from one base port, see launch/start_cluster.sh):
    clients  --DEALER-->  ROUTER  frontend client endpoint   (base + 0)
    nodes    --DEALER-->  ROUTER  frontend node endpoint     (base + 1)
    prefill  --DEALER-->  ROUTER  decode node's KV endpoint  (base + 2)
"""
from __future__ import annotations

from dataclasses import dataclass

import zmq
import zmq.asyncio

from common import protocol
from common.protocol import ProtocolError


@dataclass
class BadMessage:
    """What arrived instead of a message: who sent it and what was wrong."""
    sender: bytes | None
    error: str
    request_id: str | None


def _configure(sock: zmq.Socket, max_message_bytes: int | None, identity: str | None) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Token streams are many small messages; a full queue must not drop or block them.
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    if max_message_bytes:
        # A peer that sends more is disconnected by zmq before we read anything.
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    if sock.type == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted node takes its name back


def _unpack(frames: list, is_router: bool, allowed) -> tuple[bytes | None, object]:
    """(sender, message or BadMessage) from received frames; a ROUTER's first frame names the sender."""
    sender = None
    if is_router:
        sender, frames = frames[0].bytes, frames[1:]
    try:
        return sender, protocol.decode(frames, allowed)
    except ProtocolError as e:
        return sender, BadMessage(sender, str(e), e.request_id)


def open_context() -> zmq.Context:
    """The process's ZeroMQ context, for the channels it opens."""
    return zmq.Context()


def open_async_context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context()


class Channel:
    """One socket. ROUTER channels (bind) address peers by identity; DEALER
    channels (connect) have one logical peer."""

    def __init__(self, ctx: zmq.Context, is_router: bool, endpoint: str, *,
                 max_message_bytes: int | None = None, identity: str | None = None,
                 is_immediate: bool = False):
        self.is_router = is_router
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.ROUTER if is_router else zmq.DEALER)
        _configure(self.sock, max_message_bytes, identity)
        if is_immediate:
            # Queue only to a live connection: sends to a dead peer fail instead of piling up.
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
        (self.sock.bind if is_router else self.sock.connect)(endpoint)

    def send(self, msg, to: bytes | None = None, block: bool = True) -> bool:
        """False if the message could not be queued without blocking."""
        frames = protocol.encode(msg)
        if self.is_router:
            frames = [to, *frames]
        try:
            self.sock.send_multipart(frames, copy=False, flags=0 if block else zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def has_message(self, timeout_s: float = 0.0) -> bool:
        """Whether a message waits, after waiting at most timeout_s for one."""
        return bool(self.sock.poll(int(timeout_s * 1000)))

    def recv(self, allowed: tuple[type, ...] | None = None) -> tuple[bytes | None, object]:
        """(sender, message or BadMessage). Blocks; poll first to avoid that."""
        return _unpack(self.sock.recv_multipart(copy=False), self.is_router, allowed)

    def close(self) -> None:
        self.sock.close(linger=0)


class Poller:
    def __init__(self, *channels: Channel):
        self._poller = zmq.Poller()
        self._by_sock = {}
        for ch in channels:
            self.add(ch)

    def add(self, ch: Channel) -> None:
        self._poller.register(ch.sock, zmq.POLLIN)
        self._by_sock[ch.sock] = ch

    def wait(self, timeout_s: float) -> list[Channel]:
        """Channels with a message waiting, after at most timeout_s."""
        return [self._by_sock[s] for s, _ in self._poller.poll(int(timeout_s * 1000))]


class AsyncChannel:
    """A ROUTER or DEALER channel for asyncio code (the frontend and the async client)."""

    def __init__(self, ctx: zmq.asyncio.Context, is_router: bool, endpoint: str, *,
                 max_message_bytes: int | None = None):
        self.is_router = is_router
        self.sock = ctx.socket(zmq.ROUTER if is_router else zmq.DEALER)
        _configure(self.sock, max_message_bytes, None)
        (self.sock.bind if is_router else self.sock.connect)(endpoint)

    async def send(self, msg, to: bytes | None = None) -> None:
        frames = protocol.encode(msg)
        await self.sock.send_multipart([to, *frames] if self.is_router else frames, copy=False)

    async def recv(self, allowed: tuple[type, ...] | None = None) -> tuple[bytes | None, object]:
        return _unpack(await self.sock.recv_multipart(copy=False), self.is_router, allowed)

    def close(self) -> None:
        self.sock.close(linger=0)
