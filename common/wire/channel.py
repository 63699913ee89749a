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

from common.wire import protocol
from common.wire.keys import DOMAINS, ClusterKeys
from common.wire.protocol import ProtocolError

MAX_PEER_NAMES = 4096   # routing ids remembered per authenticated socket


@dataclass
class BadMessage:
    """What arrived instead of a message: who sent it and what was wrong."""
    sender: bytes | None
    error: str
    request_id: str | None


class LinkError(RuntimeError):
    """A socket that cannot be opened, said so a user can act on it."""


class _Admit:
    """The ZAP policy: a CURVE peer is admitted to a domain if its public key is in
    the cluster's key directory for that domain (read at each handshake)."""

    def __init__(self, keys: ClusterKeys):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys.members(domain)


class Context:
    """A process's ZeroMQ context; with keys, its server sockets admit only the
    cluster's members (CURVE, checked by an authenticator thread)."""

    def __init__(self, keys: ClusterKeys | None = None, is_async: bool = False):
        self.keys = keys
        self.zmq = zmq.Context()
        self.aio = zmq.asyncio.Context.shadow(self.zmq) if is_async else None
        self._auth = None

    def admit(self) -> None:
        """Start the authenticator once, before the first secured server socket binds."""
        if self._auth is None:
            from zmq.auth.thread import ThreadAuthenticator
            self._auth = ThreadAuthenticator(self.zmq, log=None)
            self._auth.start()
            for domain in DOMAINS:
                self._auth.configure_curve_callback(domain=domain, credentials_provider=_Admit(self.keys))

    def term(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self.zmq.term()


def open_context(keys: ClusterKeys | None = None) -> Context:
    """The process's ZeroMQ context, for the channels it opens."""
    return Context(keys)


def open_async_context(keys: ClusterKeys | None = None) -> Context:
    return Context(keys, is_async=True)


def _open(ctx: Context, sock: zmq.Socket, is_router: bool, endpoint: str, max_message_bytes: int | None,
          identity: str | None, server: str | None, domain: str | None) -> None:
    """Options, security, then bind (router) or connect (dealer); the socket is closed
    if any of it fails. server: a dealer's CURVE server, by key name. domain: whom a
    router admits."""
    try:
        _configure(ctx, sock, is_router, max_message_bytes, identity, server, domain)
        (sock.bind if is_router else sock.connect)(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        why = "the address is in use (another pdserve cluster?): choose another port" \
            if e.errno == zmq.EADDRINUSE else str(e)
        raise LinkError(f"cannot {'bind' if is_router else 'connect to'} {endpoint}: {why}") from None
    except ValueError as e:   # no key for that peer
        sock.close(linger=0)
        raise LinkError(f"cannot open a link to {endpoint}: {e}") from None


def _configure(ctx: Context, sock: zmq.Socket, is_router: bool, max_message_bytes: int | None,
               identity: str | None, server: str | None, domain: str | None) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Token streams are many small messages; a full queue must not drop or block them.
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    if max_message_bytes:
        # A peer that sends more is disconnected by zmq before we read anything.
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    keys = ctx.keys
    if keys is not None and (server or domain):
        public, secret = keys.own()
        sock.curve_publickey, sock.curve_secretkey = public, secret
        if is_router:
            ctx.admit()
            sock.curve_server = True
            sock.zap_domain = domain.encode()
        else:
            sock.curve_serverkey = keys.public(server)
        # Under CURVE names come from keys, not from identities peers choose.
    elif identity:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    # NOTE: no ROUTER_HANDOVER: with it, any peer claiming a live node's identity would take
    # over that node's route. A killed node's connection closes, which frees its identity.


class _Receiver:
    """Frames -> (sender, message or BadMessage), never an exception; counts what it drops
    and remembers the authenticated name behind each routing id."""

    def _init_receiver(self, ctx: Context, is_router: bool, domain: str | None) -> None:
        self.is_router = is_router
        self.num_bad = 0
        self._keys = ctx.keys if is_router and domain else None
        self._domain = domain
        self._members: dict[str, str] = {}
        self.peer_names: dict[bytes, str] = {}

    def peer_name(self, sender: bytes | None) -> str | None:
        """The key name a secured peer proved; None on an open socket."""
        return self.peer_names.get(sender)

    def _unpack(self, frames: list, allowed) -> tuple[bytes | None, object]:
        sender = None
        try:
            if self.is_router:
                sender, frames = frames[0].bytes, frames[1:]
            if self._keys is not None and frames:
                self._learn(sender, frames[0].get("User-Id"))   # NOTE: per message, see _learn
            return sender, protocol.decode(frames, allowed)
        except ProtocolError as e:
            self.num_bad += 1
            return sender, BadMessage(sender, str(e), e.request_id)
        except Exception as e:  # noqa: BLE001 - no input may escape as an exception
            self.num_bad += 1
            return sender, BadMessage(sender, f"undecodable message ({type(e).__name__})", None)

    def _learn(self, sender: bytes, user_id: str) -> None:
        """Name the sender by the key it proved. Read for every message, not cached by
        routing id: a peer may reconnect under a routing id another peer had."""
        name = self._members.get(user_id)
        if name is None:
            self._members = {k.decode(): n for k, n in self._keys.members(self._domain).items()}
            name = self._members.get(user_id)
        if name is None:
            self.peer_names.pop(sender, None)
        elif self.peer_names.get(sender) != name:
            if len(self.peer_names) >= MAX_PEER_NAMES:
                self.peer_names.pop(next(iter(self.peer_names)))
            self.peer_names[sender] = name


class Channel(_Receiver):
    """One socket. ROUTER channels (bind) address peers by identity; DEALER
    channels (connect) have one logical peer. With a keyed context, server names
    the CURVE server a dealer connects to and domain whom a router admits."""

    def __init__(self, ctx: Context, is_router: bool, endpoint: str, *,
                 max_message_bytes: int | None = None, identity: str | None = None,
                 is_immediate: bool = False, server: str | None = None, domain: str | None = None):
        self._init_receiver(ctx, is_router, domain)
        self.endpoint = endpoint
        self.sock = ctx.zmq.socket(zmq.ROUTER if is_router else zmq.DEALER)
        if is_immediate:
            # Queue only to a live connection: sends to a dead peer fail instead of piling up.
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
        _open(ctx, self.sock, is_router, endpoint, max_message_bytes, identity, server, domain)

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
        return self._unpack(self.sock.recv_multipart(copy=False), allowed)

    def close(self, linger_s: float = 0.0) -> None:
        """linger_s: how long queued messages (a client's last aborts) may take to leave."""
        self.sock.close(linger=int(linger_s * 1000))


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


class AsyncChannel(_Receiver):
    """A ROUTER or DEALER channel for asyncio code (the frontend and the async client)."""

    def __init__(self, ctx: Context, is_router: bool, endpoint: str, *,
                 max_message_bytes: int | None = None, server: str | None = None,
                 domain: str | None = None):
        self._init_receiver(ctx, is_router, domain)
        self.sock = ctx.aio.socket(zmq.ROUTER if is_router else zmq.DEALER)
        _open(ctx, self.sock, is_router, endpoint, max_message_bytes, None, server, domain)

    async def send(self, msg, to: bytes | None = None) -> None:
        frames = protocol.encode(msg)
        await self.sock.send_multipart([to, *frames] if self.is_router else frames, copy=False)

    async def recv(self, allowed: tuple[type, ...] | None = None) -> tuple[bytes | None, object]:
        return self._unpack(await self.sock.recv_multipart(copy=False), allowed)

    def close(self, linger_s: float = 0.0) -> None:
        """linger_s: how long queued messages (a client's last aborts) may take to leave."""
        self.sock.close(linger=int(linger_s * 1000))
