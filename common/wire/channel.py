"""Typed channels over ZeroMQ. Nodes and the frontend send and receive messages
through these; nothing else touches zmq or msgpack.

Topology (every endpoint derives from one base port, see launch/start_cluster.sh):
    clients  --DEALER-->  ROUTER  frontend client endpoint   (base + 0)
    nodes    --DEALER-->  ROUTER  frontend node endpoint     (base + 1)
    prefill  --DEALER-->  ROUTER  decode node's KV endpoint  (base + 2)

Who a peer is (a node's "NAME/EPOCH" tag, its route, the key it proved) is
peers.py's: a channel's receiving end names the sender of each message it reads.
"""

from __future__ import annotations

import zmq
import zmq.asyncio

from common.wire import protocol
from common.wire.keys import DOMAINS, ClusterKeys
from common.wire.peers import BadMessage, Inbound, node_tag, tag_name

# What nodes and the frontend import from here; who a peer is comes from peers.py.
__all__ = [
    "AsyncChannel",
    "BadMessage",
    "Channel",
    "Context",
    "LinkError",
    "Poller",
    "node_tag",
    "open_async_context",
    "open_context",
    "tag_name",
]

HEARTBEAT_IVL_MS = 1000  # ZMTP pings on an idle connection
HEARTBEAT_TIMEOUT_MS = 5000  # no traffic for this long: the connection is dropped


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
                self._auth.configure_curve_callback(
                    domain=domain, credentials_provider=_Admit(self.keys)
                )

    def term(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self.zmq.term()


def open_context(keys: ClusterKeys | None = None) -> Context:
    """The process's ZeroMQ context, for the channels it opens."""
    return Context(keys)


def open_async_context(keys: ClusterKeys | None = None) -> Context:
    return Context(keys, is_async=True)


def _open(
    ctx: Context,
    sock: zmq.Socket,
    is_router: bool,
    endpoint: str,
    max_message_bytes: int | None,
    server: str | None,
    domain: str | None,
    tag: str | None = None,
    max_queued: int | None = None,
) -> None:
    """Options, security, then bind (router) or connect (dealer); the socket is closed
    if any of it fails. server: a dealer's CURVE server, by key name. domain: whom a
    router admits."""
    try:
        _configure(ctx, sock, is_router, max_message_bytes, server, domain, tag, max_queued)
        (sock.bind if is_router else sock.connect)(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        why = (
            "the address is in use (another pdserve cluster?): choose another port"
            if e.errno == zmq.EADDRINUSE
            else str(e)
        )
        raise LinkError(
            f"cannot {'bind' if is_router else 'connect to'} {endpoint}: {why}"
        ) from None
    except ValueError as e:  # no key for that peer
        sock.close(linger=0)
        raise LinkError(f"cannot open a link to {endpoint}: {e}") from None


def _configure(
    ctx: Context,
    sock: zmq.Socket,
    is_router: bool,
    max_message_bytes: int | None,
    server: str | None,
    domain: str | None,
    tag: str | None,
    max_queued: int | None = None,
) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Token streams are many small messages; a full queue must not drop or block them.
    sock.setsockopt(zmq.SNDHWM, max_queued or 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    # A connection that carries nothing for HEARTBEAT_TIMEOUT is dropped (and a DEALER
    # connects again): a peer behind a middlebox that lost the connection's state, or a
    # stalled one, is noticed instead of taken for connected forever.
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
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
    elif tag:
        # Open links: the tag is also the socket identity, so libzmq refuses a second
        # connection under it while the first lives (a peer that names itself so does not
        # take over a live node's route). NOTE: never with keys: there the key proves the
        # name, and a routing id a peer chose must not decide where replies go.
        sock.setsockopt(zmq.IDENTITY, tag.encode())


class Channel(Inbound):
    """One socket. ROUTER channels (bind) address peers by identity; DEALER
    channels (connect) have one logical peer. With a keyed context, server names
    the CURVE server a dealer connects to and domain whom a router admits."""

    def __init__(
        self,
        ctx: Context,
        is_router: bool,
        endpoint: str,
        *,
        max_message_bytes: int | None = None,
        tag: str | None = None,
        is_immediate: bool = False,
        server: str | None = None,
        domain: str | None = None,
        max_list_len: int | None = None,
        max_queued: int | None = None,
    ):
        """tag: a node's DEALER, "NAME/EPOCH" (node_tag). max_list_len: the longest list or
        map a message may hold (refused unread past it). max_queued: sends past this many
        messages queued here are refused (bulk whose sender picks what goes next)."""
        self._init_receiver(ctx.keys, is_router, domain, max_list_len)
        self.endpoint = endpoint
        self.tag = tag
        self.sock = ctx.zmq.socket(zmq.ROUTER if is_router else zmq.DEALER)
        if is_immediate:
            # Queue only to a live connection: sends to a dead peer fail instead of piling up.
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
        self._monitor = None
        self._num_connects = 0
        if not is_router:
            # NOTE: made before connecting, so the first handshake is seen too.
            self._monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            _open(
                ctx,
                self.sock,
                is_router,
                endpoint,
                max_message_bytes,
                server,
                domain,
                tag,
                max_queued,
            )
        except LinkError:
            self._close_monitor()
            raise

    def take_reconnects(self) -> int:
        """A DEALER: how many times its connection was made again since the last call (a
        reset or a restarted peer): what was in flight on the old one may be lost."""
        if self._monitor is None:
            return 0
        num_before = self._num_connects
        while self._monitor.poll(0):
            self._monitor.recv_multipart()
            self._num_connects += 1
        return max(self._num_connects - max(num_before, 1), 0)

    def _close_monitor(self) -> None:
        if self._monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
            self._monitor = None

    def send(self, msg, to: bytes | None = None, block: bool = True) -> bool:
        """False if the message could not be queued without blocking."""
        frames = protocol.encode(msg, self.tag)
        if self.is_router:
            frames = [self.route(to), *frames]
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
        self._close_monitor()
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

    def wait(self, timeout_s: float, writable: tuple[Channel, ...] = ()) -> list[Channel]:
        """Channels with a message waiting, or among `writable` one that can take a send
        again, after at most timeout_s."""
        for ch in writable:
            self._poller.modify(ch.sock, zmq.POLLIN | zmq.POLLOUT)
        try:
            return [self._by_sock[s] for s, _ in self._poller.poll(int(timeout_s * 1000))]
        finally:
            for ch in writable:
                self._poller.modify(ch.sock, zmq.POLLIN)


class AsyncChannel(Inbound):
    """A ROUTER or DEALER channel for asyncio code (the frontend and the async client)."""

    def __init__(
        self,
        ctx: Context,
        is_router: bool,
        endpoint: str,
        *,
        max_message_bytes: int | None = None,
        server: str | None = None,
        domain: str | None = None,
        max_list_len: int | None = None,
        max_queued: int | None = None,
        takes_tags: bool = True,
    ):
        """max_queued (a ROUTER): the messages a peer may leave unread; past them, or to a
        peer that is gone, send() refuses at once (ROUTER_MANDATORY) instead of dropping.
        takes_tags: False on a ROUTER of clients (peers.py: a tagged message is refused)."""
        self._init_receiver(ctx.keys, is_router, domain, max_list_len, takes_tags)
        self.sock = ctx.aio.socket(zmq.ROUTER if is_router else zmq.DEALER)
        self.is_mandatory = bool(is_router and max_queued)
        if self.is_mandatory:
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        _open(
            ctx, self.sock, is_router, endpoint, max_message_bytes, server, domain, None, max_queued
        )

    async def send(self, msg, to: bytes | None = None) -> str | None:
        """None once queued; with max_queued, why it was not: "gone" (no connection under
        that route) or "full" (its peer left max_queued messages unread)."""
        frames = protocol.encode(msg)
        if not self.is_mandatory:
            await self.sock.send_multipart(
                [self.route(to), *frames] if self.is_router else frames, copy=False
            )
            return None
        try:
            # NOTE: never waits: a wait for one peer's room would hold every other peer's.
            await self.sock.send_multipart([self.route(to), *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return "full"
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return "gone"
        return None

    async def recv(self, allowed: tuple[type, ...] | None = None) -> tuple[bytes | None, object]:
        return self._unpack(await self.sock.recv_multipart(copy=False), allowed)

    def close(self, linger_s: float = 0.0) -> None:
        """linger_s: how long queued messages (a client's last aborts) may take to leave."""
        self.sock.close(linger=int(linger_s * 1000))
