"""Which prefill node and which decode node serve a request (xPyD: any to any).

Prefill: the fewest prompt tokens routed there and not yet prefilled. Decode:
the fewest requests routed there and not yet finished, then the most KV blocks
free after reservations (from its last heartbeat). Both counts are kept here,
at routing time, so a burst of requests spreads at once instead of waiting for
the next heartbeat. A node that joins or dies changes the choice at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.protocol import NodeReady


@dataclass
class NodeState:
    ready: NodeReady
    identity: bytes
    last_seen: float
    stats: dict = field(default_factory=dict)
    is_alive: bool = True
    dead_since: float = 0.0       # monotonic; a node dead past the grace period is forgotten
    num_routed: int = 0           # requests ever sent here
    num_active: int = 0           # decode: routed, not finished
    num_queued_tokens: int = 0    # prefill: prompt tokens routed, not yet prefilled

    @property
    def role(self) -> str:
        return self.ready.role

    @property
    def name(self) -> str:
        return self.ready.name


def has_room(node: NodeState, max_queued_tokens: int) -> bool:
    """Whether a node takes another request now. A prefill node: while fewer than
    max_queued_tokens prompt tokens wait there. A decode node: while its requests
    fill its batch rows and half as many again (enough to keep the batch full
    while the next prompts are prefilled)."""
    if node.role == "prefill":
        return node.num_queued_tokens < max_queued_tokens
    rows = node.ready.max_batch_size
    return not rows or node.num_active < rows + max(rows // 2, 8)


def choose(nodes: dict[str, NodeState], max_queued_tokens: int | None = None
           ) -> tuple[NodeState, NodeState] | None:
    """(prefill node, decode node), or None if either role has no live node (with
    max_queued_tokens: no live node with room)."""
    live = [n for n in nodes.values() if n.is_alive and
            (max_queued_tokens is None or has_room(n, max_queued_tokens))]
    prefills = [n for n in live if n.role == "prefill"]
    decodes = [n for n in live if n.role == "decode" and n.ready.kv_endpoint]
    if not prefills or not decodes:
        return None
    prefill = min(prefills, key=lambda n: (n.num_queued_tokens, n.num_routed))
    decode = min(decodes, key=lambda n: (n.num_active, -figure(n.stats, "num_available_blocks"),
                                         n.num_routed))
    return prefill, decode


def figure(stats: dict, key: str) -> float:
    """A number from a heartbeat, 0 if absent or not a number."""
    v = stats.get(key)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def routed(prefill: NodeState, decode: NodeState, prompt_len: int) -> None:
    prefill.num_routed += 1
    prefill.num_queued_tokens += prompt_len
    decode.num_routed += 1
    decode.num_active += 1


def prefill_done(prefill: NodeState | None, prompt_len: int) -> None:
    if prefill is not None:
        prefill.num_queued_tokens = max(prefill.num_queued_tokens - prompt_len, 0)


def decode_done(decode: NodeState | None) -> None:
    if decode is not None:
        decode.num_active = max(decode.num_active - 1, 0)
