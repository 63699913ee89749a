"""A node's standing with the frontend: its registration, and its heartbeat, sent
from its own thread and socket so that a long forward pass (or a first-time
kernel compile) never makes a live node look dead. common/runtime.py drives both."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable

from common.base.placement import placement
from common.wire.channel import Channel, node_tag
from common.wire.protocol import FRONTEND_TO_HEARTBEAT, Heartbeat, ReadyReply

HOST = socket.gethostname()  # in each beat: the machine the node runs on (its stats' "host")

READY_EVERY_S = 1.0  # a ready not yet answered is sent again this often
SILENCE_LIMIT_S = 120.0  # registering this long with no answer at all: give up, loudly
STATS_LEAD_S = 0.05  # a heartbeat asks the loop for its stats this long before it is due


class Registration:
    """Ready is sent until the frontend accepts it. A refusal that cannot change (a bad
    name, no right to it) stops the node; a retryable one (a live node holds the name,
    perhaps this node's dead predecessor not yet noticed) is retried for give_up_s."""

    def __init__(self, send_ready: Callable[[], bool], give_up_s: float):
        self.send_ready = send_ready
        self.give_up_s = give_up_s
        self.is_accepted = False
        self._sent_at = 0.0
        self._refused_since: float | None = None
        self._asked_since = time.monotonic()
        self.reason: str | None = None
        self.is_forgotten = threading.Event()  # set by the heartbeat thread: register anew

    def on_reply(self, reply: ReadyReply) -> str | None:
        """The reason to stop, if the frontend refused this node for good."""
        if reply.is_accepted:
            self.is_accepted = True
            self._refused_since = None
            self.reason = None
            return None
        self.is_accepted = False
        self.reason = reply.reason
        if not reply.is_retryable:
            return f"the frontend refused this node: {reply.reason}"
        if self._refused_since is None:
            self._refused_since = time.monotonic()
        return None

    def resend(self) -> None:
        """Say ready again now (the link was made again: the frontend learns the new route)."""
        self._sent_at = 0.0
        if self.is_accepted and self.send_ready():
            self._sent_at = time.monotonic()

    def tick(self) -> str | None:
        """Send ready again when due; the reason to stop if refusals lasted past give_up_s."""
        now = time.monotonic()
        if self.is_forgotten.is_set():  # the frontend forgot us (or restarted)
            self.is_forgotten.clear()
            self.is_accepted = False
            self._sent_at = 0.0
            self._asked_since = now
        if self.is_accepted:
            return None
        if self._refused_since is not None and now - self._refused_since > self.give_up_s:
            return f"the frontend refused this node for {self.give_up_s:.0f}s: {self.reason}"
        if self._refused_since is None and now - self._asked_since > SILENCE_LIMIT_S:
            return (
                f"no answer from the frontend in {SILENCE_LIMIT_S:.0f}s: is it running at that "
                f"endpoint, and (with --keys) does it hold the same key directory?"
            )
        if now - self._sent_at >= READY_EVERY_S and self.send_ready():
            self._sent_at = now
        return None


class HeartbeatThread:
    """Sends the last stats snapshot the node loop published, with the loop's age.
    NOTE: it never reads the loop's containers: a snapshot is a dict the loop made
    and no longer touches, replaced whole by publish()."""

    def __init__(
        self,
        ctx,
        endpoint: str,
        role: str,
        name: str,
        epoch: str,
        first_stats: dict,
        interval_s: float,
        is_forgotten: threading.Event,
    ):
        self._args = (ctx, endpoint, role, name, epoch, interval_s)
        self.is_forgotten = is_forgotten  # set when the frontend asks us to register again
        self.wants_stats = threading.Event()  # set shortly before each beat
        self._stats = first_stats
        self._where = placement()  # NOTE: the node's thread, once: its CPUs as it started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-heartbeat", daemon=True)
        self._last_turn = time.monotonic()

    def start(self) -> "HeartbeatThread":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def mark_turn(self) -> None:
        """The node loop took a turn (a loop stuck in one turn ages in each beat)."""
        self._last_turn = time.monotonic()

    def publish(self, stats: dict) -> None:
        self._stats = stats

    def _run(self) -> None:
        ctx, endpoint, role, name, epoch, interval_s = self._args
        lead_s = min(STATS_LEAD_S, interval_s / 4)
        # NOTE: a zmq socket belongs to the thread that made it.
        ch = Channel(
            ctx, False, endpoint, tag=node_tag(name, epoch, "heartbeat"), server="frontend"
        )
        try:
            while True:
                figures = {
                    **self._stats,
                    "host": HOST,
                    **self._where,
                    "loop_age_s": round(time.monotonic() - self._last_turn, 3),
                }
                ch.send(Heartbeat(role, name, figures, os.getpid(), epoch), block=False)
                while ch.has_message():
                    _, reply = ch.recv(FRONTEND_TO_HEARTBEAT)
                    if isinstance(reply, ReadyReply) and not reply.is_accepted:
                        self.is_forgotten.set()
                # Ask for a snapshot shortly before the next beat, so it goes out fresh.
                if self._stop.wait(interval_s - lead_s):
                    break
                self.wants_stats.set()
                if self._stop.wait(lead_s):
                    break
        finally:
            ch.close()
