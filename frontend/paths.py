"""Which path a request takes (--disaggregate): prefilled on a prefill node and its KV
handed to the decode node (disaggregated, `always`), or prefilled on the decode node
itself (local; decode_node/local.py) where `auto` predicts that its first tokens come
sooner that way and the decode node has the time to spare (`never`: local whenever it
can serve the request, for comparisons and tests).

Both predictions are built from what the nodes measure and report in their stats:
  disaggregated: first token = (prompt tokens queued on the prefill node + this prompt's
    un-cached tokens) / the prefill node's rate; first decoded token = that + the KV
    transfer left exposed (its bytes over the rate measured to that backend, less the
    prefill time a layer-wise push hides: common/base/layerwise.py's rule) + one decode step.
  local: first token = (prompt tokens queued on the decode node + this prompt's tokens
    its prefix cache lacks: a chat's next turn finds its history there) / its prefill rate
    (the prefill node's until it has measured its own) + one decode step per chunk while
    it has sequences running (its chunks alternate with their steps); first decoded
    token = that + one step.
The path whose sum of the two is smaller wins. A local prompt costs the decode node's
running sequences its compute time: over any LOCAL_WINDOW_S, the prompts routed to one decode
node with sequences running may take at most LOCAL_SHARE of it, which bounds how much
their time per output token grows (the decode node holds to it too, as measured:
decode_node/local.py). Where the two nodes share cores that no launcher shares out (one
machine, two launchers: common/base/placement.py), a local prompt takes cores the prefill
node's work takes too, at the decode node's priority, and gives nothing back to its steps:
only a prompt of one local chunk goes local, and only while no sequence runs there. A
request local prefill cannot serve (n > 1, prompt logprobs, a grammar) and any request
before the rates are measured is disaggregated.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass

from common.base.frontend_config import DISAGGREGATE
from common.base.layerwise import is_layerwise
from common.base.placement import is_core_shared
from common.base.request import LOCAL_CHUNK_TOKENS, LOCAL_SHARE, LOCAL_WINDOW_S

SHORT_PROMPT = 256  # a handoff of a prompt this short times its fixed cost, not its bytes
MAX_TOKEN_BYTES = 2**30  # KV bytes a token: a node's figure past this is not a model's


@dataclass(frozen=True)
class Figures:
    """What the rule reads for one request; rates 0 where not measured yet."""

    prompt_len: int
    prefill_cached: int = 0  # tokens the prefill node's prefix cache holds
    prefill_queued: int = 0  # prompt tokens routed there, not yet prefilled
    prefill_rate: float = 0.0  # prompt tokens/s
    kv_token_bytes: int = 0  # KV bytes per token
    link_rate: float = 0.0  # bytes/s measured to the decode node's backend
    is_layerwise: bool = False  # the write would be pushed layer by layer
    handoff_s: float = 0.0  # the handoff's fixed cost to that decode node
    decode_queued: int = 0  # prompt tokens routed to the decode node to prefill, not yet done
    decode_cached: int = 0  # tokens the decode node's prefix cache holds (a chat's history)
    decode_rate: float = 0.0  # prompt tokens/s prefilled on the decode node
    step_s: float = 0.0  # the decode node's step
    num_running: int = 0  # requests on the decode node
    is_core_shared: bool = False  # the two nodes' launchers both use some of the same cores


@dataclass(frozen=True)
class Choice:
    path: str  # "local" or "disaggregated"
    why: str
    local_s: float = math.nan  # predicted first + first decoded token, local
    disaggregated_s: float = math.nan
    local_cost_s: float = 0.0  # the decode node's time it takes (local)

    def timings(self) -> dict:
        out = {"path": self.path, "path_why": self.why}
        for k, v in (
            ("predicted_local_ms", self.local_s),
            ("predicted_disaggregated_ms", self.disaggregated_s),
        ):
            if math.isfinite(v):
                out[k] = round(v * 1e3, 3)
        return out


def predict(f: Figures) -> tuple[tuple[float, float], tuple[float, float], float]:
    """((first, first decoded) disaggregated, (first, first decoded) local, the decode node's
    compute for the prompt), in seconds. Needs f.prefill_rate > 0."""
    work = max(f.prompt_len - f.prefill_cached, 1)
    prefill_s = work / f.prefill_rate
    first = (f.prefill_queued + work) / f.prefill_rate
    transfer_s = f.prompt_len * f.kv_token_bytes / f.link_rate if f.link_rate > 0 else 0.0
    exposed = max(transfer_s - prefill_s, 0.0) if f.is_layerwise else transfer_s
    disaggregated = (first, first + f.handoff_s + exposed + f.step_s)
    rate = f.decode_rate if f.decode_rate > 0 else f.prefill_rate
    local_work = max(f.prompt_len - f.decode_cached, 1)
    cost = local_work / rate
    local_first = (f.decode_queued + local_work) / rate
    if f.num_running:
        local_first += math.ceil((f.decode_queued + local_work) / LOCAL_CHUNK_TOKENS) * f.step_s
    return disaggregated, (local_first, local_first + f.step_s), cost


class PathChooser:
    """The rule, and what it decided: each decode node's recent local compute (the
    window), and counts by path and reason for the stats. clock: monotonic seconds."""

    def __init__(self, mode: str, clock):
        if mode not in DISAGGREGATE:
            raise ValueError(f"disaggregate must be one of {DISAGGREGATE}, got {mode!r}")
        self.mode, self.clock = mode, clock
        self.recent: dict[str, deque] = {}  # decode node -> (when, its compute) of local prompts
        self.counts: dict[str, int] = {}  # "path: why" -> requests
        # decode node -> short prompts' handoff time (smoothed)
        self.handoff_s: dict[str, float] = {}

    def observe_handoff(self, decode: str, prompt_len: int, seconds: float) -> None:
        """A handoff to decode ended (prefill's end to the decode node's admission)."""
        if prompt_len <= SHORT_PROMPT and math.isfinite(seconds) and seconds >= 0:
            old = self.handoff_s.get(decode)
            self.handoff_s[decode] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def local_load_s(self, decode: str, now: float) -> float:
        q = self.recent.get(decode)
        while q and q[0][0] < now - LOCAL_WINDOW_S:
            q.popleft()
        return sum(s for _, s in q) if q else 0.0

    def decide(self, f: Figures, decode: str, can_local: bool = True) -> Choice:
        """The path for a request to that decode node (nothing is counted)."""
        return self._choose(
            dataclasses.replace(f, handoff_s=self.handoff_s.get(decode, 0.0)), decode, can_local
        )

    def record(self, choice: Choice, decode: str) -> None:
        """The request went that way: counted, and a local one's cost in that node's window."""
        key = f"{choice.path}: {choice.why}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if choice.path == "local":
            self.recent.setdefault(decode, deque()).append((self.clock(), choice.local_cost_s))

    def _choose(self, f: Figures, decode: str, can_local: bool) -> Choice:
        if self.mode == "always":
            return Choice("disaggregated", "--disaggregate always")
        if not can_local:
            return Choice(
                "disaggregated", "needs a prefill node (n > 1, prompt logprobs or a grammar)"
            )
        if self.mode == "never":
            return Choice("local", "--disaggregate never")
        if f.prefill_rate <= 0:
            return Choice("disaggregated", "no prefill rate measured yet")
        (d_first, d_second), (l_first, l_second), cost = predict(f)
        d, loc = d_first + d_second, l_first + l_second
        if loc >= d:
            return Choice("disaggregated", "sooner through the prefill node", loc, d)
        if f.is_core_shared and (
            f.num_running or f.prompt_len - f.decode_cached > LOCAL_CHUNK_TOKENS
        ):
            # NOTE: the prefill node's launcher runs its passes on these cores either way: a
            # local prompt only adds to what running sequences wait behind, and one of more
            # than a chunk holds the node's loop from those that arrive meanwhile.
            return Choice(
                "disaggregated", "the decode node shares its cores with the prefill node", loc, d
            )
        if (
            f.num_running
            and self.local_load_s(decode, self.clock()) + cost > LOCAL_SHARE * LOCAL_WINDOW_S
        ):
            return Choice("disaggregated", "the decode node has no time to spare", loc, d)
        return Choice("local", "sooner on the decode node", loc, d, cost)

    def stats(self) -> dict:
        return {
            "mode": self.mode,
            "decisions": dict(self.counts),
            "handoff_ms": {k: round(v * 1e3, 3) for k, v in self.handoff_s.items()},
        }


def figures(prompt_len: int, work_tokens: int, local_tokens: int, prefill, decode) -> Figures:
    """The rule's figures for a prompt, from two nodes' last stats (frontend/router.py's
    NodeState): rates are totals over busy time; the link's is the backend's in use.
    work_tokens, local_tokens: what each node's prefix cache leaves to compute."""
    ps, ds = prefill.stats, decode.stats
    backend = (
        ps.get("kv_links", {}).get(decode.name) if isinstance(ps.get("kv_links"), dict) else None
    )
    backend = backend if isinstance(backend, str) else None  # NOTE: a peer's figure: any type
    writes = ps.get("kv_writes", {}).get(backend) if isinstance(ps.get("kv_writes"), dict) else None
    link_rate = _number(writes, "bytes_per_s") if isinstance(writes, dict) else 0.0
    # NOTE: a peer's figure: an int past a float's range would overflow in the rule
    token_bytes = int(min(_number(ps, "kv_token_bytes"), MAX_TOKEN_BYTES))
    # NOTE: the prefill node's own rule; with no rate measured, predict() takes the transfer
    # as free either way.
    mode = ps.get("kv_layerwise")
    is_pushed = isinstance(mode, str) and is_layerwise(mode, prompt_len * token_bytes, link_rate)
    return Figures(
        prompt_len,
        prefill_cached=prompt_len - work_tokens,
        prefill_queued=prefill.num_queued_tokens,
        prefill_rate=_rate(ps, "num_prefill_tokens", "prefill_busy_s"),
        kv_token_bytes=token_bytes,
        link_rate=link_rate,
        is_layerwise=is_pushed,
        decode_queued=decode.num_queued_tokens,
        decode_cached=prompt_len - local_tokens,
        decode_rate=_rate(ds, "num_local_prefill_tokens", "local_prefill_busy_s"),
        step_s=_rate(ds, "device_busy_s", "num_decode_steps"),
        num_running=decode.num_active,
        is_core_shared=is_core_shared(prefill.placement, decode.placement),
    )


def _number(d: dict, key: str) -> float:
    v = d.get(key)
    return (
        float(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        else 0.0
    )


def _rate(d: dict, num: str, den: str) -> float:
    n, t = _number(d, num), _number(d, den)
    return n / t if n and t else 0.0
