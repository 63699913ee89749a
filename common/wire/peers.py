"""Who sent a message, as a channel's receiving end knows it (channel.py).

A ROUTER knows a peer by its ZeroMQ routing id, which changes on every reconnect (a
connection reset by a middlebox, say) while the process lives on. A node's DEALER
therefore tags every message "NAME/EPOCH" (its name, and an epoch new in each process),
and the ROUTER names the sender by that tag: the same peer across reconnects, a new one
after a restart. With keys the tag's NAME must be the name of the key the peer proved, or
the message is refused; on open links the tag is as good as the port's reach. Replies go
to the route the peer last spoke from; `rerouted` lists peers seen on a new route (their
connection was replaced: what was in flight on the old one may be lost), and a DEALER's
take_reconnects() says when its own connection was replaced. Clients send no tag: a
client is its routing id, and a ROUTER of clients (takes_tags False) refuses a tagged
message: a tag there would let one client speak, and be answered, as another.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.wire import codec, protocol
from common.wire.keys import ClusterKeys
from common.wire.protocol import ProtocolError

MAX_PEER_NAMES = 4096  # peers remembered per ROUTER (their proven names and routes)
MAX_REROUTED = 1024  # reroutes remembered until taken


def node_tag(name: str, epoch: str, suffix: str = "") -> str:
    """What a node's messages say of who sends them: "NAME/EPOCH[/SUFFIX]"."""
    return f"{name}/{epoch}{'/' + suffix if suffix else ''}"


def tag_name(tag: bytes | str | None) -> str | None:
    """The NAME of a "NAME/EPOCH..." sender."""
    if tag is None:
        return None
    text = tag.decode("utf-8", "replace") if isinstance(tag, bytes) else tag
    return text.split("/", 1)[0] if "/" in text else None


@dataclass
class BadMessage:
    """What arrived instead of a message: who sent it and what was wrong."""

    sender: bytes | None
    error: str
    request_id: str | None


class Inbound:
    """Frames -> (sender, message or BadMessage), never an exception; counts what it drops.
    A ROUTER's sender is the peer's tag (or, untagged, its routing id); see the module.
    Channel and AsyncChannel (channel.py) are each one: they call _init_receiver() first."""

    def _init_receiver(
        self,
        keys: ClusterKeys | None,
        is_router: bool,
        domain: str | None,
        max_list_len: int | None,
        takes_tags: bool = True,
    ) -> None:
        """keys: the context's (None: open links); domain: whom a router admits;
        takes_tags: whether its peers are nodes, named by their tags (else: clients)."""
        self.is_router = is_router
        self.takes_tags = takes_tags
        self.num_bad = 0
        self.num_reroutes = 0
        self.max_list_len = max_list_len or codec.MAX_LIST_LEN
        self._keys = keys if is_router and domain else None
        self._domain = domain
        self._members: dict[str, str] = {}
        self.peer_names: dict[bytes, str] = {}  # sender -> the key name it proved
        self._routes: dict[bytes, bytes] = {}  # tagged sender -> the routing id it last spoke from
        self.rerouted: list[bytes] = []  # tagged senders seen on a new route, until taken

    def peer_name(self, sender: bytes | None) -> str | None:
        """The key name a secured peer proved; None on an open socket."""
        return self.peer_names.get(sender)

    def route(self, sender: bytes) -> bytes:
        """Where a reply to sender goes: the route a tagged peer last spoke from."""
        return self._routes.get(sender, sender)

    def take_rerouted(self) -> list[bytes]:
        out, self.rerouted = self.rerouted, []
        return out

    def _unpack(self, frames: list, allowed) -> tuple[bytes | None, object]:
        route = None
        if self.is_router:
            route, frames = frames[0].bytes, frames[1:]
        proven = (
            self._proven(frames[0].get("User-Id")) if self._keys is not None and frames else None
        )
        try:
            msg, tag = protocol.decode_from(frames, allowed, self.max_list_len)
        except ProtocolError as e:
            self.num_bad += 1
            tag = codec.sender_of(frames) if self.takes_tags else None
            return self._sender(route, tag, proven), BadMessage(route, str(e), e.request_id)
        except Exception as e:  # noqa: BLE001 - no input may escape as an exception
            self.num_bad += 1
            return route, BadMessage(route, f"undecodable message ({type(e).__name__})", None)
        if not self.is_router:
            return None, msg
        if tag is not None and not self.takes_tags:
            self.num_bad += 1
            return route, BadMessage(
                route,
                "a client's message carries no 'from' tag (a client is its connection)",
                getattr(msg, "request_id", None),
            )
        if tag is not None and self._keys is not None and tag_name(tag) != proven:
            self.num_bad += 1
            return route, BadMessage(
                route,
                f"a peer that proved the key of {proven!r} sent as {tag[:64]!r}",
                getattr(msg, "request_id", None),
            )
        sender = self._sender(route, tag, proven)
        return sender, msg

    def _sender(self, route: bytes | None, tag: str | None, proven: str | None) -> bytes | None:
        """Who sent it: a tag that holds (its key proved its name), else the routing id."""
        if route is None:
            return None
        sender = route
        if tag is not None and self.takes_tags and (self._keys is None or tag_name(tag) == proven):
            sender = tag.encode()
            old = self._routes.pop(sender, None)
            if old is not None and old != route:
                self.num_reroutes += 1
                if len(self.rerouted) < MAX_REROUTED:
                    self.rerouted.append(sender)
            self._remember(self._routes, sender, route)
        if self._keys is not None:
            if proven is None:
                self.peer_names.pop(sender, None)
            elif self.peer_names.get(sender) != proven:
                self._remember(self.peer_names, sender, proven)
        return sender

    @staticmethod
    def _remember(table: dict, key, value) -> None:
        if key not in table and len(table) >= MAX_PEER_NAMES:
            table.pop(next(iter(table)))  # the oldest
        table[key] = value

    def _proven(self, user_id: str | None) -> str | None:
        """The name of the key a message was sent with. Read for every message, not cached
        by routing id: a peer may reconnect under a routing id another peer had."""
        name = self._members.get(user_id)
        if name is None and user_id is not None:
            self._members = {k.decode(): n for k, n in self._keys.members(self._domain).items()}
            name = self._members.get(user_id)
        return name
