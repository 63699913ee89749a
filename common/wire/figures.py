"""A prefill node's running counts per KV transfer backend, as its stats carry them
(`kv_writes`: backend -> these) and, through the frontend, /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

# Upper bounds (seconds) of the write-time histogram: a write's start to its completion.
WRITE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class TransferFigures:
    num_transfers: int = 0  # writes completed
    num_bytes: int = 0  # in those, as they crossed the link
    num_int8: int = 0  # of those, crossed as int8 rows (--kv-wire-dtype)
    num_failed: int = 0  # writes refused at the start, or cut by the decode node's restart
    write_s_sum: float = 0.0
    num_layerwise: int = 0  # of those, pushed layer by layer during the prefill
    num_chunked: int = 0  # of those, pushed over the passes of a chunked prompt
    bytes_per_s: float = (
        0.0  # whole writes' rate, start to acknowledgement (moving average; 0: none)
    )
    # Layer-wise writes' bytes over their tail (what the pass did not hide): the link's rate
    # where the link is the bound, above it where the pass hid part (moving average; 0: none)
    tail_bytes_per_s: float = 0.0
    write_s_counts: list[int] = field(default_factory=lambda: [0] * (len(WRITE_BUCKETS_S) + 1))
    # write_s_counts[i]: writes that took at most WRITE_BUCKETS_S[i] and more than the bucket
    # before; the last entry: longer than every bound.

    def observe(
        self,
        seconds: float,
        num_bytes: int,
        is_layerwise: bool = False,
        is_chunked: bool = False,
        wire: str = "same",
    ) -> None:
        """is_layerwise: pushed during the pass (is_chunked: passes), seconds the tail after it;
        wire: the format it crossed in."""
        self.num_transfers += 1
        self.num_int8 += wire == "int8"
        self.num_layerwise += is_layerwise
        self.num_chunked += is_chunked
        self.num_bytes += num_bytes
        self.write_s_sum += seconds
        self.write_s_counts[
            next((i for i, b in enumerate(WRITE_BUCKETS_S) if seconds <= b), len(WRITE_BUCKETS_S))
        ] += 1

    def observe_rate(self, rate: float, is_tail: bool = False) -> None:
        if is_tail:
            old = self.tail_bytes_per_s
            self.tail_bytes_per_s = rate if old <= 0 else 0.8 * old + 0.2 * rate
        else:
            self.bytes_per_s = (
                rate if self.bytes_per_s <= 0 else 0.8 * self.bytes_per_s + 0.2 * rate
            )

    def as_dict(self) -> dict:
        # NOTE: the bucket counts are keys, not a list: a heartbeat's figures nest three
        # levels at most (common/wire/codec.py), and stats > kv_writes > backend takes them.
        return {
            "num_transfers": self.num_transfers,
            "num_bytes": self.num_bytes,
            "num_int8": self.num_int8,
            "num_failed": self.num_failed,
            "write_s_sum": round(self.write_s_sum, 6),
            "num_layerwise": self.num_layerwise,
            "num_chunked": self.num_chunked,
            "bytes_per_s": round(self.bytes_per_s),
            "tail_bytes_per_s": round(self.tail_bytes_per_s),
            **dict(zip(BUCKET_KEYS, self.write_s_counts)),
        }


# The histogram's counts in the stats, one key per bucket (not cumulative).
BUCKET_KEYS = (*(f"write_s_le_{b:g}" for b in WRITE_BUCKETS_S), "write_s_le_inf")
