"""What every node does besides its work: the frontend channel, registration and
its ready message, the heartbeat, shutdown and the exit code. A node loop calls
on_control() for the frontend's control messages and turn() once per turn."""
from __future__ import annotations

import os
import threading
from typing import Callable

from common.wire.channel import Channel, open_context
from common.base.config import NodeLinks
from common.runtime.heartbeat import HeartbeatThread, Registration
from common.wire.keys import load_keys
from common.wire.protocol import ReadyReply, Shutdown


class NodeRuntime:
    def __init__(self, role: str, name: str, frontend_endpoint: str, keys_dir: str | None,
                 links: NodeLinks, stop: threading.Event, log):
        self.role, self.name, self.links, self.stop, self.log = role, name, links, stop, log
        self.exit_code = 0
        self.ctx = open_context(load_keys(keys_dir, name))
        self.frontend = Channel(self.ctx, False, frontend_endpoint, identity=f"{name}/{os.getpid()}",
                                max_message_bytes=links.max_message_bytes, server="frontend")
        self._endpoint = frontend_endpoint
        self.registration: Registration | None = None
        self.heartbeat: HeartbeatThread | None = None
        self._stats: Callable[[], dict] | None = None

    def start(self, send_ready: Callable[[], bool], stats: Callable[[], dict]) -> None:
        """Register (ready is sent until accepted) and start the heartbeat, fed by
        stats() snapshots that the loop takes in turn(), never the heartbeat thread."""
        self._stats = stats
        self.registration = Registration(send_ready, 2 * self.links.dead_after_s + 5)
        self.registration.tick()
        self.heartbeat = HeartbeatThread(self.ctx, self._endpoint, self.role, self.name, stats(),
                                         self.links.heartbeat_s, self.registration.is_forgotten).start()

    @property
    def is_registered(self) -> bool:
        return self.registration is not None and self.registration.is_accepted

    def on_control(self, msg) -> bool:
        """Handle the frontend's ready reply or shutdown; False for any other message."""
        if isinstance(msg, ReadyReply):
            self.quit(self.registration.on_reply(msg))
        elif isinstance(msg, Shutdown):
            self.log.info("shutdown requested by the frontend")
            self.stop.set()
        else:
            return False
        return True

    def quit(self, reason: str | None) -> None:
        """Stop with exit code 1 for this reason (None: nothing to do)."""
        if reason:
            self.log.error("stopping: %s", reason)
            self.exit_code = 1
            self.stop.set()

    def turn(self) -> None:
        """Once per loop turn: the loop is alive, registration is kept, and the heartbeat
        gets a fresh stats snapshot when it has sent the last one."""
        self.heartbeat.mark_turn()
        if self.heartbeat.wants_stats.is_set():
            self.heartbeat.wants_stats.clear()
            self.heartbeat.publish(self._stats())
        self.quit(self.registration.tick())

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
