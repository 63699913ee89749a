"""The prefill node's KV links, one per decode node: opening one, the hello and
the welcome that open a transfer writer into that node's cache, a link made
again (a reset), the messages waiting on a link, and what each link is used
for. The handoffs that travel over them are sender.py's."""
from __future__ import annotations

import time
from typing import Callable, Iterator

from common.base.log import get_logger
from common.handoff.lease import INF
from common.handoff.states import DecodePeer, Link
from common.kv.blocks import is_cache_shape, num_cache_blocks
from common.transfer import KVWriter, TransferError
from common.wire.protocol import DECODE_TO_PREFILL, KVHello, KVWelcome

log = get_logger("prefill")
HELLO_EVERY_S = 1.0


class KVLinks:
    """connect(name, endpoint) opens the link to a decode node; open_writer(welcome, send)
    a transfer writer into its cache."""

    def __init__(self, name: str, connect: Callable[[str, str], Link],
                 open_writer: Callable[[KVWelcome, Callable], KVWriter], clock: Callable[[], float] = time.monotonic):
        self.name, self.connect, self.open_writer, self.clock = name, connect, open_writer, clock
        self.peers: dict[str, DecodePeer] = {}      # by KV endpoint

    def peer_for(self, name: str, endpoint: str) -> DecodePeer:
        peer = self.peers.get(endpoint)
        if peer is None:
            peer = self.peers[endpoint] = DecodePeer(name, endpoint, self.connect(name, endpoint))
        peer.name = name
        return peer

    def hello(self, peer: DecodePeer, is_now: bool = False) -> None:
        """Ask for its welcome (at most once a second unless is_now)."""
        now = self.clock()
        if (is_now or now - peer.hello_at >= HELLO_EVERY_S) and peer.link.send(KVHello(self.name), block=False):
            peer.hello_at = now

    def open(self, peer: DecodePeer, w: KVWelcome) -> None:
        """A welcome from a new life of that node: its old writer is closed (waiting for
        its copies) and one is opened from the welcome, or peer.error says why not."""
        if peer.writer is not None:
            peer.writer.close()
        peer.writer, peer.epoch, peer.error = None, w.epoch, None
        peer.num_blocks = num_cache_blocks(w.cache_shape) if is_cache_shape(w.cache_shape) else 0
        peer.is_layerwise = w.is_layerwise
        try:
            peer.writer = self.open_writer(w, lambda m: peer.link.send(m, block=False))
            log.info("KV link to %s (%s): %s transfer", peer.name, peer.endpoint, peer.writer.name)
        except TransferError as e:
            peer.error = f"cannot hand KV to decode node {peer.name}: {e}"
            log.error("%s", peer.error)

    def flush(self) -> None:
        """Every writer sends what is ready (nothing ends)."""
        for peer in self.peers.values():
            if peer.writer is not None:
                peer.writer.flush()

    def take_reconnected(self) -> list[DecodePeer]:
        """Peers whose link was made again since the last call (what was on the way may be lost)."""
        out = [p for p in self.peers.values() if p.link.take_reconnects()]
        for peer in out:
            peer.hello_at = -INF
        return out

    def messages(self, link: Link) -> Iterator[tuple[DecodePeer, object]]:
        """Everything waiting on one link, with the peer it comes from."""
        peer = next(p for p in self.peers.values() if p.link is link)
        while link.has_message():
            yield peer, link.recv(DECODE_TO_PREFILL)[1]

    @property
    def num_bad(self) -> int:
        return sum(p.link.num_bad for p in self.peers.values())

    def describe(self) -> dict[str, str]:
        """Each decode node's name: the transfer in use, why none, or "connecting"."""
        return {p.name: (p.writer.name if p.writer else p.error or "connecting")
                for p in list(self.peers.values())}

    def close(self) -> None:
        for peer in self.peers.values():
            if peer.writer is not None:
                peer.writer.close()
            peer.link.close()
        self.peers.clear()
