"""A node's heartbeat, sent from its own thread and socket so that a long forward
pass (or a first-time kernel compile) never makes a live node look dead."""
from __future__ import annotations

import threading
import time
from typing import Callable

from common.channel import Channel
from common.protocol import Heartbeat


class HeartbeatThread:
    def __init__(self, ctx, endpoint: str, role: str, name: str,
                 stats: Callable[[], dict], interval_s: float):
        self._args = (ctx, endpoint, role, name, stats, interval_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-heartbeat", daemon=True)
        self.last_turn = time.monotonic()   # the node loop's last turn, set by the loop

    def start(self) -> "HeartbeatThread":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        ctx, endpoint, role, name, stats, interval_s = self._args
        # NOTE: a zmq socket belongs to the thread that made it.
        ch = Channel(ctx, False, endpoint, identity=f"{name}.heartbeat")
        try:
            while True:
                try:
                    figures = {**stats(), "loop_age_s": round(time.monotonic() - self.last_turn, 3)}
                except RuntimeError:  # a container changed size under us: skip this beat
                    figures = None
                if figures is not None:
                    ch.send(Heartbeat(role, name, figures), block=False)
                if self._stop.wait(interval_s):
                    break
        finally:
            ch.close()
