"""The layer-wise rule: whether a prompt's KV is pushed to its decode node layer by layer
while its prefill computes the rest (--kv-layerwise), or written whole after it.

The prefill node applies it to each write (common/handoff/writes.py); the frontend applies
it to predict how much of a transfer a prefill hides (frontend/paths.py). Layer by layer,
the transfer hides behind the pass, at the cost of more, smaller writes: a short prompt's
transfer does not repay them. `auto` pushes layer by layer where the KV would take at
least MIN_HIDDEN_S at the rate measured on that link, or, before one is measured, where
it is at least UNMEASURED_BYTES."""

from __future__ import annotations

KV_LAYERWISE = ("auto", "on", "off")  # what --kv-layerwise takes
MIN_HIDDEN_S = 0.01
UNMEASURED_BYTES = 4 * 2**20


def is_layerwise(mode: str, num_bytes: int, bytes_per_s: float) -> bool:
    """mode: --kv-layerwise; bytes_per_s: the link's measured rate (0: none yet)."""
    if mode != "auto":
        return mode == "on"
    if bytes_per_s <= 0:
        return num_bytes >= UNMEASURED_BYTES
    return num_bytes / bytes_per_s >= MIN_HIDDEN_S
