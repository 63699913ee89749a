"""Which prefill node and which decode node serve a request (xPyD: any to any).

Prefill: the least work before this prompt's prefill ends there: the prompt
tokens routed there and not yet prefilled, plus this prompt's tokens minus the
prefix that node already caches (cache-aware: nodes report the blocks they
cache, and a repeated prefix goes where it is, unless that node is busier by
more than the prefix saves). Decode:
the fewest requests routed there and not yet finished, then the most KV blocks
free after reservations (from its last heartbeat); where a decode node may prefill
the prompt itself (--disaggregate auto or never), every DECODE_CACHE_TOKENS of it
that node caches (a chat's history, kept from its last turn) count as one request
fewer there. Both counts are kept here,
at routing time, so a burst of requests spreads at once instead of waiting for
the next heartbeat. A node that joins or dies changes the choice at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.base.placement import Placement
from common.kv.prefix import block_hashes, num_reusable_blocks, route_key
from common.wire.protocol import NodeReady

DECODE_CACHE_TOKENS = 128


@dataclass
class NodeState:
    ready: NodeReady
    identity: bytes
    last_seen: float
    stats: dict = field(default_factory=dict)
    is_alive: bool = True
    is_draining: bool = False  # routed nothing more; it leaves once what it holds is gone
    dead_since: float = 0.0  # monotonic; a node dead past the grace period is forgotten
    num_routed: int = 0  # requests ever sent here
    num_active: int = 0  # decode: routed, not finished
    # prompt tokens routed here to prefill, not yet prefilled (less cached ones)
    num_queued_tokens: int = 0
    prefix_keys: set[int] = field(default_factory=set)  # route keys of its cached blocks
    placement: Placement | None = None  # from its last heartbeat (common/base/placement.py)
    placement_key: tuple = ()  # the figures it was read from

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


def cached_tokens(node: NodeState, prompt_len: int, keys: dict[int, list[int]] | None) -> int:
    """Prompt tokens the node can take from its prefix cache. keys: block size -> the
    route keys of the prompt's full blocks (common/prefix.py)."""
    bs = node.ready.block_size
    if not keys or not node.prefix_keys or bs not in keys:
        return 0
    n = 0
    for k in keys[bs][: num_reusable_blocks(prompt_len, bs)]:
        if k not in node.prefix_keys:
            break
        n += 1
    return n * bs


def has_rows(node: NodeState, num_rows: int) -> bool:
    """Whether a decode node's batch holds num_rows sequences at once (a request's n
    choices run side by side there); one that did not say its rows is taken at its word."""
    return not node.ready.max_batch_size or node.ready.max_batch_size >= num_rows


def max_rows(nodes: dict[str, NodeState]) -> int | None:
    """The most rows a registered decode node's batch has; None where no decode node has
    registered, or one did not say (no request is refused for its n then)."""
    rows = [n.ready.max_batch_size for n in nodes.values() if n.role == "decode"]
    return max(rows) if rows and all(rows) else None


def choose(
    nodes: dict[str, NodeState],
    max_queued_tokens: int | None = None,
    prompt_len: int = 0,
    keys: dict[int, list[int]] | None = None,
    is_decode_cache: bool = False,
    is_prefill_full_ok: bool = False,
    num_rows: int = 1,
) -> tuple[NodeState, NodeState] | None:
    """(prefill node, decode node), or None if either role has no live node (with
    max_queued_tokens: no live node with room; is_prefill_full_ok: a prefill node needs none;
    num_rows: no live decode node whose batch holds that many sequences).
    is_decode_cache: decode nodes' caches count."""
    live = [
        n
        for n in nodes.values()
        if n.is_alive
        and not n.is_draining
        and (
            max_queued_tokens is None
            or has_room(n, max_queued_tokens)
            or (is_prefill_full_ok and n.role == "prefill")
        )
    ]
    prefills = [n for n in live if n.role == "prefill"]
    decodes = [
        n for n in live if n.role == "decode" and n.ready.kv_endpoint and has_rows(n, num_rows)
    ]
    if not prefills or not decodes:
        return None
    prefill = min(
        prefills,
        key=lambda n: (
            n.num_queued_tokens + prompt_len - cached_tokens(n, prompt_len, keys),
            n.num_queued_tokens,
            n.num_routed,
        ),
    )
    decode = min(
        decodes,
        key=lambda n: (
            n.num_active
            - (cached_tokens(n, prompt_len, keys) / DECODE_CACHE_TOKENS if is_decode_cache else 0),
            -figure(n.stats, "num_available_blocks"),
            n.num_routed,
        ),
    )
    return prefill, decode


def prefix_keys(
    nodes: dict[str, NodeState], prompt_ids: list[int], known: dict[int, list[int]]
) -> dict[int, list[int]] | None:
    """Route keys of the prompt's full blocks, per block size of the nodes that report
    a prefix cache (None when none does), added to known: hashed once per request and
    size, as a request waiting for room is tried again at every wake."""
    for n in nodes.values():
        bs = n.ready.block_size
        if n.prefix_keys and bs not in known:
            known[bs] = [route_key(h) for h in block_hashes(prompt_ids, bs)]
    return known or None


def assign(
    nodes: dict[str, NodeState],
    max_queued_tokens: int,
    prompt_ids: list[int],
    known_keys: dict[int, list[int]],
    is_local=None,
    num_rows: int = 1,
) -> tuple[NodeState, NodeState, int] | None:
    """Route a request now: (the node that prefills it, decode node, prompt tokens it is
    expected to compute), counted as routed; None while no pair has room. is_local(prefill
    node, decode node, tokens to compute on each): whether the decode node prefills it
    instead (None: never; decode nodes' caches then do not count). num_rows: the sequences
    it runs as on its decode node (its n choices, sent together)."""
    keys = prefix_keys(nodes, prompt_ids, known_keys)
    n, may_be_local = len(prompt_ids), is_local is not None
    route = choose(
        nodes, max_queued_tokens, n, keys, is_decode_cache=may_be_local, num_rows=num_rows
    )
    # NOTE: every prefill node full: a prompt its decode node may take goes on there.
    is_full = route is None and may_be_local
    if is_full:
        route = choose(
            nodes,
            max_queued_tokens,
            n,
            keys,
            is_decode_cache=True,
            is_prefill_full_ok=True,
            num_rows=num_rows,
        )
    if route is None:
        return None
    prefill, decode = route
    work_tokens = n - cached_tokens(prefill, n, keys)
    local_tokens = n - cached_tokens(decode, n, keys)
    if may_be_local and is_local(prefill, decode, work_tokens, local_tokens):
        prefill, work_tokens = decode, local_tokens
    elif is_full:
        return None
    routed(prefill, decode, work_tokens)
    return prefill, decode, work_tokens


def figure(stats: dict, key: str) -> float:
    """A number from a heartbeat, 0 if absent or not a number."""
    v = stats.get(key)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def routed(prefill: NodeState, decode: NodeState, work_tokens: int) -> None:
    """work_tokens: the prompt tokens the prefill node is expected to compute (prefill is
    decode for a prompt the decode node prefills: its count of them)."""
    prefill.num_routed += prefill is not decode
    prefill.num_queued_tokens += work_tokens
    decode.num_routed += 1
    decode.num_active += 1


def prefill_done(prefill: NodeState | None, work_tokens: int) -> None:
    if prefill is not None:
        prefill.num_queued_tokens = max(prefill.num_queued_tokens - work_tokens, 0)


def update_prefix(node: NodeState, added: list[int], removed: list[int], is_reset: bool) -> None:
    if is_reset:
        node.prefix_keys = set(added)
        return
    node.prefix_keys.difference_update(removed)
    node.prefix_keys.update(added)


def decode_done(decode: NodeState | None) -> None:
    if decode is not None:
        decode.num_active = max(decode.num_active - 1, 0)
