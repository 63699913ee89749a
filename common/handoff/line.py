"""The decode node's waiting line: reservations that did not fit when asked for
(WAITING), first come, first served. The head is granted its blocks unasked as they free
up (receiver.py's turn); a place is kept by asking again within the lease, and lost when
the prefill node stops asking, releases it, or is lost."""

from __future__ import annotations

from collections import deque

from common.handoff.states import Reservation


class Line:
    def __init__(self, max_len: int):
        self.max_len = max_len
        self._queue: deque[Reservation] = deque()  # oldest first

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self):
        return iter(self._queue)

    @property
    def is_full(self) -> bool:
        return len(self._queue) >= self.max_len

    def find(self, request_id: str) -> Reservation | None:
        return next((w for w in self._queue if w.request_id == request_id), None)

    def add(self, w: Reservation) -> None:
        self._queue.append(w)

    def head(self) -> Reservation | None:
        return self._queue[0] if self._queue else None

    def pop_head(self) -> Reservation:
        return self._queue.popleft()

    def drop(self, request_id: str, sender: bytes | None = None) -> bool:
        """Its place goes (only if sender, when given, holds it)."""
        w = self.find(request_id)
        if w is None or (sender is not None and w.sender != sender):
            return False
        self._queue.remove(w)
        return True

    def drop_expired(self, now: float) -> list[Reservation]:
        """The places not asked for again within their lease, gone."""
        gone = [w for w in self._queue if w.lease.is_over(now)]
        for w in gone:
            self._queue.remove(w)
        return gone

    def drop_sender(self, sender: bytes) -> None:
        """Every place a prefill node holds (it is lost)."""
        self._queue = deque(w for w in self._queue if w.sender != sender)
