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
    num_routed: int = 0           # requests ever sent here
    num_active: int = 0           # decode: routed, not finished
    num_queued_tokens: int = 0    # prefill: prompt tokens routed, not yet prefilled

    @property
    def role(self) -> str:
        return self.ready.role

    @property
    def name(self) -> str:
        return self.ready.name


def choose(nodes: dict[str, NodeState]) -> tuple[NodeState, NodeState] | None:
    """(prefill node, decode node), or None if either role has no live node."""
    live = [n for n in nodes.values() if n.is_alive]
    prefills = [n for n in live if n.role == "prefill"]
    decodes = [n for n in live if n.role == "decode" and n.ready.kv_endpoint]
    if not prefills or not decodes:
        return None
    prefill = min(prefills, key=lambda n: (n.num_queued_tokens, n.num_routed))
    decode = min(decodes, key=lambda n: (n.num_active, -n.stats.get("num_available_blocks", 0),
                                         n.num_routed))
    return prefill, decode


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
