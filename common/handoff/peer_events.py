"""What happens to a prefill node's handoffs when their decode node restarts (its welcome
names a new epoch) or their KV link is made again (a reset): functions of the Sender's
(sender.py), which calls them with itself.

A restart: writes under way there fail when their writer closes (closing waits for their
copies); reservations there are void, so those not yet written ask again, and KV written
there is lost (those handoffs fail, retryable). A reset: asks, renewals and commits in
flight may be lost, and are sent again; a reset of the data connection may have lost KV,
so the handoffs that sent any fail now (retryable) and release, rather than wait out
their lease."""

from __future__ import annotations

from common.handoff.links import say_reset
from common.handoff.states import DecodePeer, Stage
from common.wire.protocol import KVWelcome


def on_restart(tx, peer: DecodePeer, w: KVWelcome) -> None:
    """peer's welcome w names a new epoch (tx: the Sender)."""
    epoch = w.epoch
    mine = [h for h in tx.by_id.values() if h.peer is peer]
    for h in mine:
        if h.stage in (Stage.WRITING, Stage.CANCELLING):
            tx.count_failed(peer)
            h.stage = Stage.CANCELLED
            h.is_retryable = True
            h.error = h.error or f"decode node {peer.name} restarted during the KV write"
    tx.links.open(peer, w)
    for h in mine:
        if h.stage in (
            Stage.QUEUED,
            Stage.RESERVED,
            Stage.WRITTEN,
            Stage.COMMITTED,
        ) and h.epoch not in (None, epoch):
            if h.stage in (Stage.QUEUED, Stage.RESERVED):
                h.drop_reservation(tx.clock())
            else:
                h.stage = Stage.CANCELLED
                h.is_retryable = True
                h.error = f"decode node {peer.name} restarted before the handoff was committed"


def on_reconnect(tx, peer: DecodePeer, is_data: bool = False) -> None:
    """peer's KV link (is_data: its data connection, links.py) was made again."""
    tx.num_link_resets += 1
    handoffs = [h for h in tx.by_id.values() if h.peer is peer]
    what, act = ("link's data connection", "checking") if is_data else ("link", "asking again for")
    say_reset(f"the KV {what} to {peer.name} was made again", act, handoffs, is_data)
    now = tx.clock()
    for h in handoffs:
        if is_data:
            if h.stage in (Stage.WRITING, Stage.WRITTEN, Stage.COMMITTED):
                tx.end_handoff(
                    h,
                    f"its KV to {peer.name} may be lost (the KV link's data connection was made "
                    f"again)",
                    release=True,
                    is_retryable=True,
                )
        elif h.stage in (Stage.ASKING, Stage.QUEUED, Stage.RESERVED, Stage.WRITING, Stage.WRITTEN):
            h.next_ask_at = min(h.next_ask_at, now)
        elif h.stage is Stage.COMMITTED:
            tx.send_commit(h)
    if peer.epoch is None:
        tx.links.hello(peer)
