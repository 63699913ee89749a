"""The prefill node's KV links, one per decode node: opening one, the hello and
the welcome that open a transfer writer into that node's cache, a link made
again (a reset), the messages waiting on a link, and what each link is used
for. The handoffs that travel over them are sender.py's.

A link is two connections to the decode node's KV socket: control (hellos,
reservations, commits, releases, and transfers' announcements) and data (the
KV itself, tagged "NAME/EPOCH/kv"), opened when a writer first sends KV. So a
short request's reservation and commit never queue behind another's bulk, and
the data connection takes at most MAX_FRAMES_QUEUED frames: the rest wait in
the writer, which picks what goes next (common/transfer/tcp.py)."""

from __future__ import annotations

import time
from typing import Callable, Iterator

from common.base.log import get_logger
from common.handoff.lease import INF
from common.handoff.states import DATA, DecodePeer, Link, Stage
from common.kv.blocks import is_cache_shape, num_cache_blocks
from common.transfer import KVWriter, TransferError
from common.wire.protocol import DECODE_TO_PREFILL, KVHello, KVTransfer, KVWelcome

log = get_logger("prefill")
HELLO_EVERY_S = 1.0
MAX_FRAMES_QUEUED = 2  # on the data connection, besides the one going out


def say_reset(what: str, act: str, handoffs: list, is_data: bool) -> None:
    """A link made again (reset or dropped). A decode node that restarted (after a drain,
    say) is met at most by asks, which are simply asked again: nothing for an operator to
    do. Handoffs under way (past their ask; on the data connection, writing or written)
    are asked again or fail over; resets that cut them and recur point at the network."""
    if is_data:
        cut = [h for h in handoffs if h.stage in (Stage.WRITING, Stage.WRITTEN, Stage.COMMITTED)]
    else:
        cut = [h for h in handoffs if h.stage is not Stage.ASKING]
    if cut:
        log.warning(
            "%s: %s %d handoffs (%d under way); if this recurs, check the network "
            "between the nodes",
            what,
            act,
            len(handoffs),
            len(cut),
        )
    else:
        log.info("%s: %s %d handoffs, none under way", what, act, len(handoffs))


class KVLinks:
    """connect(name, endpoint, suffix, max_queued) opens a connection to a decode node's
    KV socket (suffix "": control); open_writer(welcome, send) a transfer writer into its cache."""

    def __init__(
        self,
        name: str,
        connect: Callable[[str, str, str, int | None], Link],
        open_writer: Callable[[KVWelcome, Callable], KVWriter],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name = name
        self.connect = connect
        self.open_writer = open_writer
        self.clock = clock
        self.peers: dict[str, DecodePeer] = {}  # by KV endpoint
        self.num_stray = 0  # messages that came back on a data connection

    def peer_for(self, name: str, endpoint: str) -> DecodePeer:
        peer = self.peers.get(endpoint)
        if peer is None:
            peer = self.peers[endpoint] = DecodePeer(
                name, endpoint, self.connect(name, endpoint, "", None)
            )
        peer.name = name
        return peer

    def hello(self, peer: DecodePeer, is_now: bool = False) -> None:
        """Ask for its welcome (at most once a second unless is_now)."""
        now = self.clock()
        if (is_now or now - peer.hello_at >= HELLO_EVERY_S) and peer.link.send(
            KVHello(self.name), block=False
        ):
            peer.hello_at = now

    def open(self, peer: DecodePeer, w: KVWelcome) -> None:
        """A welcome from a new life of that node: its old writer is closed (waiting for
        its copies) and one is opened from the welcome, or peer.error says why not."""
        if peer.writer is not None:
            peer.writer.close()
        peer.writer = None
        peer.epoch = w.epoch
        peer.error = None
        peer.num_blocks = num_cache_blocks(w.cache_shape) if is_cache_shape(w.cache_shape) else 0
        peer.is_layerwise = w.is_layerwise
        try:
            peer.writer = self.open_writer(w, lambda m: self._send(peer, m))
            log.info("KV link to %s (%s): %s transfer", peer.name, peer.endpoint, peer.writer.name)
        except TransferError as e:
            peer.error = f"cannot hand KV to decode node {peer.name}: {e}"
            log.error("%s", peer.error)

    def _send(self, peer: DecodePeer, msg) -> bool:
        """What a writer sends: KV on the data connection, an announcement (no KV) on
        control, in order with the commit that follows it."""
        if not (isinstance(msg, KVTransfer) and msg.data.numel()):
            return peer.link.send(msg, block=False)
        if peer.data_link is None:
            peer.data_link = self.connect(peer.name, peer.endpoint, DATA, MAX_FRAMES_QUEUED)
        return peer.data_link.send(msg, block=False)

    def waiting_to_send(self) -> tuple[Link, ...]:
        """Data connections a writer waits on (full, or not connected yet): the loop wakes
        when one can take a frame again."""
        return tuple(
            p.data_link
            for p in self.peers.values()
            if p.data_link is not None and p.writer is not None and p.writer.is_stalled
        )

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

    def take_data_resets(self) -> list[DecodePeer]:
        """Peers whose data connection was made again since the last call: KV sent on the
        old one may be lost."""
        return [
            p
            for p in self.peers.values()
            if p.data_link is not None and p.data_link.take_reconnects()
        ]

    def messages(self, link: Link) -> Iterator[tuple[DecodePeer, object]]:
        """Everything waiting on one link, with the peer it comes from."""
        peer = next((p for p in self.peers.values() if p.link is link), None)
        if peer is None:  # a data connection: nothing is answered on it
            while link.has_message():
                link.recv(DECODE_TO_PREFILL)
                self.num_stray += 1
            return
        while link.has_message():
            yield peer, link.recv(DECODE_TO_PREFILL)[1]

    @property
    def num_bad(self) -> int:
        return self.num_stray + sum(p.link.num_bad for p in self.peers.values())

    def describe(self) -> dict[str, str]:
        """Each decode node's name: the transfer in use, why none, or "connecting"."""
        return {
            p.name: (p.writer.name if p.writer else p.error or "connecting")
            for p in list(self.peers.values())
        }

    def close(self) -> None:
        for peer in self.peers.values():
            if peer.writer is not None:
                peer.writer.close()
            for link in (peer.link, peer.data_link):
                if link is not None:
                    link.close()
        self.peers.clear()
