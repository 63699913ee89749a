"""Where a request's time went on the cluster, for HTTP clients: queue, prefill, KV
transfer, decode admission, decode (first token to last) and the total, so a client
that misses an SLO (AIPerf's, GuideLLM's) can tell which phase took the time. A whole
response carries them in a Server-Timing header (W3C: `queue;dur=0.5, prefill;dur=31`,
milliseconds); a stream in `timings` on its last chunk (docs/openai_api.md)."""

from __future__ import annotations

# Server-Timing's name for each phase -> its key in a request's timings.
PHASES = (
    ("queue", "queue_ms"),
    ("prefill", "prefill_ms"),
    ("kv_transfer", "kv_transfer_ms"),
    ("decode_admission", "decode_admission_ms"),
    ("decode", "decode_ms"),
    ("total", "total_ms"),
)


def _ms(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return float(value) if ok else None


def with_decode(timings: dict | None) -> dict:
    """A finished request's timings, with decode_ms: its first token to its last."""
    out = dict(timings or {})
    total, ttft = _ms(out.get("total_ms")), _ms(out.get("ttft_ms"))
    if total is not None and ttft is not None:
        out["decode_ms"] = round(max(total - ttft, 0.0), 3)
    return out


def headers(timings: dict | None) -> dict[str, str]:
    """The Server-Timing header of a whole response (none when nothing was timed)."""
    t = with_decode(timings)
    parts = [f"{name};dur={_ms(t[key]):.3f}" for name, key in PHASES if _ms(t.get(key)) is not None]
    return {"Server-Timing": ", ".join(parts)} if parts else {}
