"""The frontend's node registry: who may register under which name, heartbeats,
and which nodes are alive.

A node registers with NodeReady and is refused if it cannot prove its name (its
messages are tagged NAME/EPOCH, and with keys NAME must be its key's; see
common/wire/channel.py) or if a live node of that name is registered. A node is
its name and epoch, not its connection: a link made again (reset by a
middlebox, say) is the same node on a new route. A node silent past dead_after_s,
or whose loop has not turned for hung_after_s, is dead: it is lost to its requests
(the frontend's callback moves them, or fails them).
A dead node that speaks again is back; one dead past forget_after_s is dropped.
"""

from __future__ import annotations

import time
from typing import Awaitable, Callable

from common.base.config import FrontendConfig
from common.base.log import Throttle, get_logger
from common.base.placement import placement_key, read_placement
from common.wire.channel import node_tag, tag_name
from common.wire.protocol import Heartbeat, NodeReady, ReadyReply
from frontend.router import NodeState, figure

log = get_logger("frontend")
noisy = Throttle(log)
ROLES = ("prefill", "decode")


class NodeRegistry:
    """lost(node, cause, why) tells the frontend a node is gone from what it held;
    relinked(node) that a live node's link was made again (what was in flight on it may
    be lost); wake() tells dispatch that the nodes changed. link (the node channel) is
    set once it is open."""

    def __init__(
        self,
        cfg: FrontendConfig,
        is_keyed: bool,
        lost: Callable[[NodeState, str, str], Awaitable[None]],
        relinked: Callable[[NodeState], Awaitable[None]],
        wake: Callable[[], None],
    ):
        self.cfg, self.is_keyed = cfg, is_keyed
        self.lost, self.relinked, self.wake = lost, relinked, wake
        self.nodes: dict[str, NodeState] = {}
        self.link = None
        self.checked_at = time.monotonic()  # the watchdog's last look (after any stall was excused)

    def claims(self, sender: bytes, name: str, epoch: str, suffix: str = "") -> bool:
        """Whether the sender may speak as node `name` (the process of that epoch): its
        messages are tagged so, and with keys, its key proves the name (on open links a
        name is only as good as the port's reach)."""
        if sender != node_tag(name, epoch, suffix).encode():
            return False
        return not self.is_keyed or self.link.peer_name(sender) == name

    def by_identity(self, sender: bytes) -> NodeState | None:
        """The registered node a (tagged, proven) sender is."""
        node = self.nodes.get(tag_name(sender) or "")
        return node if node is not None and node.identity == sender else None

    def seen(self, node: NodeState) -> None:
        node.last_seen = time.monotonic()
        is_hung = figure(node.stats, "loop_age_s") > self.cfg.hung_after_s
        if not node.is_alive and not is_hung:
            node.is_alive = True
            log.info("%s node %s is back", node.ready.role, node.ready.name)
            self.wake()

    async def on_heartbeat(self, sender: bytes, msg: Heartbeat) -> None:
        """From the node's heartbeat socket."""
        node = self.nodes.get(msg.name)
        if not self.claims(sender, msg.name, msg.epoch, "heartbeat"):
            noisy.warning("dropped a heartbeat for %r from a peer that is not that node", msg.name)
        elif node is None:  # forgotten while silent: ask it to register again
            await self.link.send(ReadyReply(False, "unknown node: register again", True), to=sender)
        elif node.ready.epoch != msg.epoch:
            pass  # NOTE: a restarted node not yet registered (its NodeReady says who it is)
        else:
            self.seen(node)
            node.stats = msg.stats
            # NOTE: read as a beat changes it, not per route (the same text comes every beat)
            if node.placement_key != (key := placement_key(msg.stats)):
                node.placement, node.placement_key = read_placement(msg.stats), key

    async def on_ready(self, sender: bytes, ready: NodeReady) -> None:
        old = self.nodes.get(ready.name)
        if ready.role not in ROLES or (ready.role == "decode") != bool(ready.kv_endpoint):
            reason, is_retryable = (
                f"bad ready: role {ready.role!r} with kv_endpoint {ready.kv_endpoint!r}",
                False,
            )
        elif not self.claims(sender, ready.name, ready.epoch):
            reason, is_retryable = f"this peer may not register as {ready.name!r}", False
        elif old is not None and old.ready.epoch != ready.epoch and not self._may_succeed(old):
            reason, is_retryable = (
                (
                    f"a live {old.ready.role} node named {ready.name!r} is registered "
                    f"(pid {old.ready.pid}); choose another --name"
                ),
                True,
            )
        else:
            reason = None
        if reason:
            noisy.warning("refused a node registering as %r: %s", ready.name, reason)
            await self.link.send(ReadyReply(False, reason, is_retryable), to=sender)
            return
        if old is not None and old.ready.epoch == ready.epoch:
            # The same process again: its link was made again (or it was forgotten).
            old.ready = ready
            self.seen(old)
            await self.relinked(old)
        else:
            if old is not None:
                await self.lost(old, "restarted", f"{old.ready.role} node {ready.name} restarted")
            self.nodes[ready.name] = NodeState(ready, sender, time.monotonic())
            # NOTE: block 0 is the null block, never handed out: as the node counts its blocks
            log.info(
                "%s node %s ready (pid %d, %s, %d KV blocks)",
                ready.role,
                ready.name,
                ready.pid,
                ready.device,
                ready.num_kv_blocks - 1,
            )
        await self.link.send(ReadyReply(True), to=sender)
        self.wake()

    def _may_succeed(self, old: NodeState) -> bool:
        """Whether a new process (another epoch) may take old's name now: once old is dead,
        leaving (draining), or silent for two heartbeats. NOTE: a supervisor restarts a
        node as soon as it dies; waiting for the silence to reach dead_after_s would leave
        the requests moving to its successor refused and routed to a dead process
        meanwhile. A live twin (heartbeating) is still refused."""
        if not old.is_alive or old.is_draining:
            return True
        # NOTE: silence up to the watchdog's last look: a NodeReady read right after the
        # loop was held up comes before the stall is excused, when every node looks silent.
        return self.checked_at - old.last_seen > 2 * self.cfg.links.heartbeat_s

    def excuse(self, seconds: float) -> None:
        """The frontend's loop was held up this long: no node's silence counts it."""
        for node in self.nodes.values():
            node.last_seen += seconds

    async def check(self, now: float) -> None:
        """The watchdog's look at every node: the silent and the hung die (lost to their
        requests), the long dead are forgotten."""
        self.checked_at = now
        for node in list(self.nodes.values()):
            loop_age = figure(node.stats, "loop_age_s")
            if node.is_alive and now - node.last_seen > self.cfg.links.dead_after_s:
                cause, why = "dead", f"{node.role} node {node.name} stopped responding"
                if node.is_draining:
                    log.info("%s node %s has drained and stopped", node.role, node.name)
                else:
                    log.error(
                        "%s node %s silent for %.1fs: it is lost to its requests",
                        node.role,
                        node.name,
                        now - node.last_seen,
                    )
            elif node.is_alive and loop_age > self.cfg.hung_after_s:
                cause = "hung"
                why = (
                    f"{node.role} node {node.name} is hung: "
                    f"its loop has not turned for {loop_age:.0f}s"
                )
                log.error("%s: it is lost to its requests", why)
            else:
                if not node.is_alive and now - node.dead_since > self.cfg.forget_after_s:
                    log.info(
                        "forgetting %s node %s, dead for %.0fs",
                        node.role,
                        node.name,
                        now - node.dead_since,
                    )
                    del self.nodes[node.name]
                continue
            node.is_alive = False
            node.dead_since = now
            node.prefix_keys = set()  # if it comes back, its next full resync restores it
            await self.lost(node, cause, why)

    def stats(self) -> dict:
        """Per node: what the registry knows of it, then its last heartbeat's figures.
        NOTE: a heartbeat names only figures: what the registry says of a node (is it
        alive, its pid, its role, ...) is never taken from the node itself."""
        now = time.monotonic()
        out = {}
        for name, n in self.nodes.items():
            own = {
                "role": n.ready.role,
                "is_alive": n.is_alive,
                "pid": n.ready.pid,
                "device": n.ready.device,
                "kv_transfer": n.ready.kv_transfer,
                "max_batch_size": n.ready.max_batch_size,
                "num_prefix_keys": len(n.prefix_keys),
                "is_draining": n.is_draining,
                "seconds_since_seen": round(now - n.last_seen, 3),
                "num_routed": n.num_routed,
            }
            out[name] = {**{k: v for k, v in n.stats.items() if k not in own}, **own}
        return out
