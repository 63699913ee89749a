"""A reservation's lease, as both halves of a handoff count it.

The decode node frees a reservation neither renewed nor committed within
lease_s of the last KVReserve for it that reached it. The prefill node counts
the same lease from when it sent the KVReserve that was answered, so its view
ends no later than the decode node's. It renews every third of the lease, so a
lost renewal still leaves time, and starts no write in the last third: a write
must land before the blocks can be given to another request. A write still
under way at write_deadline (half-way through that last third) is stopped, so
whatever a peer does, the prefill side holds nothing past the lease's end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INF = math.inf


@dataclass(frozen=True)
class Lease:
    start: float = -INF  # monotonic: when the KVReserve it answers was sent (or arrived)
    lease_s: float = 0.0  # 0: held until released

    @property
    def end(self) -> float:
        return self.start + self.lease_s if self.lease_s > 0 else INF

    @property
    def renew_at(self) -> float:
        return self.start + self.lease_s / 3 if self.lease_s > 0 else INF

    @property
    def write_by(self) -> float:
        """No write starts from here on."""
        return self.end - self.lease_s / 3 if self.lease_s > 0 else INF

    @property
    def write_deadline(self) -> float:
        """A write not done by then is stopped: a sixth of the lease before the decode
        node may free the blocks."""
        return self.end - self.lease_s / 6 if self.lease_s > 0 else INF

    def is_over(self, now: float) -> bool:
        return now > self.end
