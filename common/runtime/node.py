"""What every node does besides its work: the frontend channel, registration and
its ready message, the heartbeat, draining, shutdown and the exit code. A node
loop calls on_control() for the frontend's control messages and turn() once per
turn.

Draining (the frontend's Drain, or the first SIGTERM: stop.drain, see
process.py): the node tells the frontend, which routes nothing more here and
moves what it can to other nodes; the node stops once it holds nothing, or
after drain_timeout_s. A second SIGTERM stops it at once."""

from __future__ import annotations

import os
import secrets
import time
from typing import Callable

from common.base.config import NodeLinks
from common.base.env import read_env
from common.runtime.heartbeat import HeartbeatThread, Registration
from common.runtime.process import StopEvent
from common.wire.channel import Channel, node_tag, open_context
from common.wire.keys import load_keys
from common.wire.protocol import Drain, NodeDraining, ReadyReply, Shutdown


class NodeRuntime:
    def __init__(
        self,
        role: str,
        name: str,
        frontend_endpoint: str,
        keys_dir: str | None,
        links: NodeLinks,
        stop: StopEvent,
        log,
        drain_timeout_s: float = 30.0,
    ):
        self.role = role
        self.name = name
        self.links = links
        self.stop = stop
        self.log = log
        self.drain_timeout_s = drain_timeout_s
        self.drain_asked = stop.drain
        self.drain_until: float | None = None  # monotonic; set while draining
        self.exit_code = 0
        # New in each process: with the node's name, who it is on every link (wire/peers.py).
        self.epoch = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.tag = node_tag(name, self.epoch)
        self.ctx = open_context(load_keys(keys_dir, name))
        self.frontend = Channel(
            self.ctx,
            False,
            frontend_endpoint,
            tag=self.tag,
            max_message_bytes=links.max_message_bytes,
            server="frontend",
        )
        self.num_link_resets = 0  # times the frontend link was made again while this process ran
        self._endpoint = frontend_endpoint
        self.registration: Registration | None = None
        self.heartbeat: HeartbeatThread | None = None
        self._stats: Callable[[], dict] | None = None
        self._is_empty: Callable[[], bool] = lambda: True
        self._is_ready_told = False

    def start(
        self,
        send_ready: Callable[[], bool],
        stats: Callable[[], dict],
        is_empty: Callable[[], bool],
    ) -> None:
        """Register (ready is sent until accepted) and start the heartbeat, fed by
        stats() snapshots that the loop takes in turn(), never the heartbeat thread.
        is_empty(): the node holds no request (a draining node may stop)."""
        self._stats = stats
        self._is_empty = is_empty
        self.registration = Registration(send_ready, 2 * self.links.dead_after_s + 5)
        self.registration.tick()
        self.heartbeat = HeartbeatThread(
            self.ctx,
            self._endpoint,
            self.role,
            self.name,
            self.epoch,
            stats(),
            self.links.heartbeat_s,
            self.registration.is_forgotten,
        ).start()

    @property
    def is_registered(self) -> bool:
        return self.registration is not None and self.registration.is_accepted

    def on_control(self, msg) -> bool:
        """Handle the frontend's ready reply or shutdown; False for any other message."""
        if isinstance(msg, ReadyReply):
            self.quit(self.registration.on_reply(msg))
            if self.registration.is_accepted and not self._is_ready_told:
                self._tell_ready()
        elif isinstance(msg, Shutdown):
            self.log.info("shutdown requested by the frontend")
            self.stop.set()
        elif isinstance(msg, Drain):
            self.drain_asked.set()
        else:
            return False
        return True

    def quit(self, reason: str | None) -> None:
        """Stop with exit code 1 for this reason (None: nothing to do)."""
        if reason:
            self.log.error("stopping: %s", reason)
            self.exit_code = 1
            self.stop.set()

    def _tell_ready(self) -> None:
        """The first acceptance: logged, and written to PDSERVE_READY_FILE for a
        launcher that has no client link to the frontend (start_cluster.sh --join)."""
        self._is_ready_told = True
        self.log.info("registered with the frontend at %s", self._endpoint)
        path = read_env().ready_file
        if path is not None:
            try:
                path.write_text(f"{self.name}\n")
            except OSError as e:
                self.log.warning("could not write the ready file %s: %s", path, e.strerror)

    @property
    def is_draining(self) -> bool:
        return self.drain_until is not None

    def take_link_reset(self) -> bool:
        """Whether the frontend link was made again since the last call. The node then says
        itself at once (ready, and draining if it is), so the frontend learns its new route
        and reconciles what was in flight (NodeSync)."""
        if not self.frontend.take_reconnects():
            return False
        self.num_link_resets += 1
        self.log.warning(
            "the link to the frontend was made again (reset or dropped): saying who this node is"
        )
        self.registration.resend()
        if self.is_draining:
            self.send(NodeDraining(self.name, os.getpid()))
        return True

    def turn(self) -> None:
        """Once per loop turn: the loop is alive, registration is kept, the heartbeat
        gets a fresh stats snapshot when it has sent the last one, and a drain goes on."""
        self.heartbeat.mark_turn()
        self.take_link_reset()
        if self.heartbeat.wants_stats.is_set():
            self.heartbeat.wants_stats.clear()
            # stats_at (wall clock): when the figures were taken, so a reader knows what they count
            self.heartbeat.publish({**self._stats(), "stats_at": round(time.time(), 3)})
        self.quit(self.registration.tick())
        if self.drain_asked.is_set() and not self.is_draining:
            self.drain_until = time.monotonic() + self.drain_timeout_s
            self.log.info(
                "draining: no new requests; stopping once those held have moved or "
                "finished (at most %.0fs)",
                self.drain_timeout_s,
            )
            self.send(NodeDraining(self.name, os.getpid()))
        if self.is_draining:
            if self._is_empty():
                self.log.info("drained: nothing is held here")
                self.stop.set()
            elif time.monotonic() > self.drain_until:
                self.log.warning(
                    "drain timeout (%.0fs) with requests still here: stopping", self.drain_timeout_s
                )
                self.stop.set()

    def send(self, msg) -> bool:
        """To the frontend without blocking; a full queue drops the message, loudly."""
        if self.frontend.send(msg, block=False):
            return True
        self.log.error("frontend queue full: dropped a %s message", type(msg).__name__)
        return False

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.frontend.close()

    def term(self) -> None:
        """After every other socket on the context is closed."""
        self.ctx.term()
        self.log.info("stopped")
