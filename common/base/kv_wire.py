"""The wire's format of a prompt's KV (--kv-wire-dtype), chosen per write on the prefill
node: as the cache holds it, or each (token, head) row as 8-bit values and its scale
(kernels/kv_quant.py), which the decode node dequantizes into its pages as they land.

Only a backend whose receiver lands what it is sent can carry it (tcp, dist: a one-sided
write, ipc's or nixl's, lands in the peer's pages as they are), and only between caches in
the model's dtype (an 8-bit cache already sends its pages as they are). `auto` sends int8
where the link time the smaller bytes save is at least MIN_SAVED_S and COST_MARGIN times
the cost of quantizing and dequantizing (bytes / the round-trip rate measured on this
node's device). With T = bytes / link rate and T8 = wire bytes / link rate, a whole write
saves T - T8; one pushed layer by layer during a prefill of P seconds hides up to P of its
transfer, so it saves max(T - P, 0) - max(T8 - P, 0). Until a link rate is measured
(common/handoff/writes.py), the KV crosses as it is.

NOTE: int8 on the wire is lossy: the decode node decodes from KV quantized once, as an
int8 cache would hold it; the default (`same`) keeps the model's dtype end to end."""

from __future__ import annotations

from dataclasses import dataclass

KV_WIRE_DTYPES = ("same", "auto", "int8")  # what --kv-wire-dtype takes
# NOTE: the link rate is measured from a write's start to its acknowledgement, each write's
# fixed latency (a few ms) included: below a fast link's own rate, so the saving it predicts
# is high, and one of a few ms may not be there at all.
COST_MARGIN = 2.0
MIN_SAVED_S = 0.01

# Why a write crossed as it did: its index is what a request's timings carry (numbers only).
WHY = (
    "--kv-wire-dtype same",
    "--kv-wire-dtype int8",
    "auto: no link rate measured yet",
    "auto: the link time saved outweighs quantizing",
    "auto: the link time saved does not repay quantizing",
    "auto: the prefill hides the transfer either way",
)


@dataclass(frozen=True)
class WireChoice:
    dtype: str  # "same" or "int8"
    why: int  # an index into WHY
    saved_s: float = 0.0  # auto: the link time int8 would save
    cost_s: float = 0.0  # auto: the quantize and dequantize it would cost

    def stamps(self) -> dict:
        """What a request's timings carry of it (common/wire/node.py: wire_parts)."""
        out = {"kv_wire_int8": int(self.dtype == "int8"), "kv_wire_why": self.why}
        if self.why in (3, 4):
            out |= {"kv_wire_saved_ms": self.saved_s * 1e3, "kv_wire_cost_ms": self.cost_s * 1e3}
        return out


def choose(
    mode: str,
    num_bytes: int,
    wire_bytes: int,
    link_bytes_per_s: float,
    round_trip_bytes_per_s,
    hidden_s: float = 0.0,
) -> WireChoice:
    """mode: --kv-wire-dtype; num_bytes: the write in the cache's format, wire_bytes in int8;
    link_bytes_per_s: the link's measured rate (0: none yet); round_trip_bytes_per_s: a
    callable -> the rate of quantizing and dequantizing, in bytes of the cache's format (only
    called when it matters: the first call measures it); hidden_s: the prefill a write
    pushed layer by layer runs beside (0: a whole write)."""
    if mode != "auto":
        return WireChoice(mode, WHY.index(f"--kv-wire-dtype {mode}"))
    if link_bytes_per_s <= 0:
        return WireChoice("same", 2)
    full_s, int8_s = num_bytes / link_bytes_per_s, wire_bytes / link_bytes_per_s
    saved_s = max(full_s - hidden_s, 0.0) - max(int8_s - hidden_s, 0.0)
    if saved_s <= 0:
        return WireChoice("same", 5)
    cost_s = num_bytes / max(round_trip_bytes_per_s(), 1.0)
    is_int8 = saved_s >= max(COST_MARGIN * cost_s, MIN_SAVED_S)
    return WireChoice("int8" if is_int8 else "same", 3 if is_int8 else 4, saved_s, cost_s)


def describe(stamps: dict) -> dict:
    """A request's stamps -> its timings' parts: the wire's format and why ({} if no write
    of its crossed a link that could carry int8). Stamps come off the wire: checked."""
    is_int8, why = stamps.get("kv_wire_int8"), stamps.get("kv_wire_why")
    if is_int8 not in (0, 1) or not isinstance(why, int) or not 0 <= why < len(WHY):
        return {}
    parts = {"kv_wire": "int8" if is_int8 else "same", "kv_wire_why": WHY[why]}
    for key in ("kv_wire_saved_ms", "kv_wire_cost_ms"):
        value = stamps.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts[key] = round(value, 3)
    return parts
