"""Moving requests off a node that is lost or drained.

A moved request is routed again, as a new prefill of its prompt and every token
it streamed (RequestState.continuation), under a new node id: what its old
nodes still say under the old id is dropped, and they are told to free it (a
frozen node reads that when it thaws). Sampling is seeded by position, so the
tokens that follow are those of an undisturbed run; the client's stream goes
on, its stop strings and max_tokens counted across the move.

Causes: "dead" (silent past --dead-after), "hung" (its loop stopped turning),
"restarted" (a new process took its name), "handoff" (its prefill node could
not hand the KV to the decode node: that node restarted or went silent, the
write failed, or its KV did not all land), "link" (its node's link to the
frontend was made again and what was in flight on it was lost: a gap in its
tokens, a NodeSync found the node without it or done with it unseen, or the prompt's
logprobs, held for, never came),
"drain" (pdserve drain, or SIGTERM to the node). A request moves at most
--max-migrations times; a moved request waits at most --migration-wait seconds
while no prefill and decode node pair is alive.

A node seen on a new route (its link reset while it lives) is asked which of
the requests routed to it before that it no longer holds (NodeSync): those lost
on the way move; the rest go on where they are.
"""

from __future__ import annotations

from common.base.config import is_loopback_endpoint
from common.base.log import get_logger
from common.base.request import FINISH_ERROR, stop_reason
from common.wire.node import MAX_SYNC_IDS
from common.wire.protocol import (
    Drain,
    DrainReply,
    ErrorReply,
    NodeAbort,
    NodeSync,
    NodeSynced,
    PeerLost,
)
from frontend import router
from frontend.hub import Hub
from frontend.request import RequestState
from frontend.router import NodeState

log = get_logger("frontend")
CAUSES = ("dead", "hung", "restarted", "handoff", "link", "drain")
# What a node's timings say of one of its lives; the rest describe a continuation's TTFT.
_PER_NODE_PARTS = ("num_preemptions", "preempted_ms", "num_draft_tokens", "num_accepted_tokens")


class Migrations:
    def __init__(self, frontend: Hub):
        self.fe = frontend
        self.num_moved = dict.fromkeys(CAUSES, 0)
        self.num_failed = 0  # could not move: over --max-migrations, or no node in time
        self.num_syncs = 0
        self.syncs: dict[
            int, tuple[str, set[str]]
        ] = {}  # sync id -> (node, the node ids asked about)

    # ---- moving -------------------------------------------------------------

    async def node_lost(self, node: NodeState, cause: str, why: str) -> None:
        """A node died, hung or restarted: what it held moves, or fails with why. A lost
        prefill node's reservations on decode nodes are freed there at once (as far as
        that is safe: common/handoff/receiver.py drop_peer)."""
        for req in list(self.fe.requests.values()):
            if self.fe.requests.get(req.node_id) is not req:
                continue  # NOTE: ended or moved by another task while this loop awaited
            if req.decode_node == node.name or (
                req.prefill_node == node.name and not req.is_decoding
            ):
                await self.move_or_fail(req, node.name, cause, why)
        if node.role == "prefill":
            # NOTE: a restarted node's predecessor exited: the launcher restarts only a
            # process that exited (its successor may come once it is silent, before it
            # counts as dead: frontend/nodes.py). One draining may still run.
            is_exited = cause == "restarted" and not (node.is_alive and node.is_draining)
            lost = PeerLost(node.name, node.ready.epoch, is_exited)
            for peer in self.fe.nodes.values():
                if peer.role == "decode" and peer.is_alive:
                    await self.fe.node_link.send(lost, to=peer.identity)

    async def move_or_fail(self, req: RequestState, lost: str, cause: str, why: str) -> None:
        """Node lost is lost to it (cause, why): continue it elsewhere, or end it."""
        fe = self.fe
        limit = fe.cfg.max_migrations
        done = self._is_done(req)
        if done:  # every token it may have was streamed; only its ending was lost
            await fe.finish(req, done, None)
        elif req.num_migrations >= limit:
            if limit:
                self.num_failed += 1
                why = (
                    f"{why} (it had moved {req.num_migrations} times, the limit: --max-migrations)"
                )
            await fe.finish(req, FINISH_ERROR, why, status=503)
        else:
            await self._move(req, lost, cause, why)

    def _is_done(self, req: RequestState) -> str | None:
        if not req.output_ids:
            return None
        spec = self.fe.spec
        return stop_reason(
            req.params,
            req.output_ids[-1],
            len(req.output_ids),
            len(req.prompt_ids),
            spec.eos_token_ids,
            self.fe.max_model_len,
        )

    async def _move(self, req: RequestState, lost: str, cause: str, why: str) -> None:
        fe = self.fe
        old_id, old_nodes = req.node_id, (req.prefill_node, req.decode_node)
        fe.unroute(req)
        for name in dict.fromkeys(n for n in old_nodes if n is not None):
            node = fe.nodes.get(name)
            if node is not None:  # NOTE: dead too: a frozen node reads it when it thaws
                await fe.node_link.send(NodeAbort(old_id), to=node.identity)
        del fe.requests[old_id]
        for k in _PER_NODE_PARTS:  # what its earlier lives said of themselves stays counted
            if k in req.timings:
                req.earlier_parts[k] = req.timings[k]
        base = old_id.split(".")[0]
        req.move(f"{base}.{req.num_migrations + 1}", f"{lost} ({why})")
        fe.requests[req.node_id] = req
        fe.admission.requeue(req.client, req)
        self.num_moved[cause] += 1
        log.warning(
            "request %s of a client (node id %s) moves off %s: %s; %d of its tokens streamed, "
            "move %d of at most %d",
            req.request_id,
            old_id,
            lost,
            why,
            len(req.output_ids),
            req.num_migrations,
            fe.cfg.max_migrations,
        )
        fe.wake_dispatch()

    def routed(self, req: RequestState, pair: str) -> None:
        """A moved request is routed again."""
        log.info(
            "request %s continues on %s as %s, after %d tokens (it left %s)",
            req.request_id,
            pair,
            req.node_id,
            len(req.output_ids),
            req.moved_from,
        )
        req.moved_at = None

    def timings(self, req: RequestState, parts: dict) -> dict:
        """A node's timings for this request that still hold: after a move, not the
        continuation's TTFT parts (the client's first token came long before); the
        per-node counts added to those of its earlier lives."""
        own = {
            k: round(v + req.earlier_parts.get(k, 0), 3)
            for k, v in parts.items()
            if k in _PER_NODE_PARTS
        }
        return {**(parts if not req.num_migrations else {}), **own}

    # ---- a node's link made again ------------------------------------------------

    async def sync(self, node: NodeState) -> None:
        """Ask a node seen on a new route which of its requests it no longer holds."""
        fe = self.fe
        asked = [
            r.node_id for r in fe.requests.values() if node.name in (r.prefill_node, r.decode_node)
        ]
        if not asked:
            return
        log.warning(
            "%s node %s is back on a new link (its connection was made again): checking its "
            "%d requests",
            node.role,
            node.name,
            len(asked),
        )
        for i in range(0, len(asked), MAX_SYNC_IDS):
            self.num_syncs += 1
            part = asked[i : i + MAX_SYNC_IDS]
            self.syncs[self.num_syncs] = (node.name, set(part))
            while len(self.syncs) > 64:  # a node that never answers leaves nothing behind
                self.syncs.pop(next(iter(self.syncs)))
            await fe.node_link.send(NodeSync(self.num_syncs, part), to=node.identity)

    async def on_synced(self, node: NodeState, msg: NodeSynced) -> None:
        """A node's answer: what was lost on its old link moves on from where it is."""
        name, asked = self.syncs.get(msg.sync_id, (None, set()))
        if name != node.name:
            return
        del self.syncs[msg.sync_id]
        missing, ended = set(msg.missing) & asked, set(msg.ended) & asked
        for rid in missing | ended:
            req = self.fe.requests.get(rid)
            if req is None:
                continue
            if node.name == req.decode_node:
                is_lost = rid in ended or req.is_decoding
            else:
                is_lost = node.name == req.prefill_node and rid in missing and not req.is_decoding
            if is_lost:
                why = f"{node.role} node {node.name} " + (
                    "ended it, and its end was lost on the link"
                    if rid in ended
                    else "does not hold it: it was lost on the link"
                )
                await self.move_or_fail(req, node.name, "link", why)

    async def check_wait(self, req: RequestState, now: float) -> None:
        """The watchdog, for a moved request not yet routed again: it fails once it has
        found no node pair for --migration-wait."""
        fe = self.fe
        if now - req.moved_at <= fe.cfg.migration_wait_s or router.choose(fe.nodes) is not None:
            return
        self.num_failed += 1
        await fe.finish(
            req,
            FINISH_ERROR,
            f"no live prefill and decode node pair to continue on within "
            f"{fe.cfg.migration_wait_s:.0f}s (--migration-wait) after it "
            f"left {req.moved_from}",
            status=503,
        )

    # ---- draining ----------------------------------------------------------------

    async def on_drain_request(self, name: str) -> tuple[DrainReply | ErrorReply, int | None]:
        """A client's `pdserve drain NAME`: the reply, and its HTTP status."""
        fe = self.fe
        # NOTE: a drain stops a node: only a client the operator vouches for may ask.
        if not (fe.cfg.is_client_auth or is_loopback_endpoint(fe.cfg.client_endpoint)):
            return ErrorReply(
                "drain is refused: clients of this frontend are neither local nor keyed "
                "(--client-keys)"
            ), 403
        node = fe.nodes.get(name)
        if node is None or not node.is_alive:
            return ErrorReply(f"no live node named {name!r}"), 404
        return await self.drain(node, is_asked=True), None

    async def drain(self, node: NodeState, is_asked: bool = False) -> DrainReply:
        """Route nothing more to node and move what it holds where another node of its
        role can take it (what cannot move finishes there); is_asked: tell the node."""
        fe = self.fe
        if not node.is_draining:
            node.is_draining = True
            log.info("draining %s node %s: no new requests go there", node.role, node.name)
        if is_asked:
            await fe.node_link.send(Drain(), to=node.identity)
        has_peer = any(
            n.is_alive and not n.is_draining and n.role == node.role for n in fe.nodes.values()
        )
        num_moved = num_staying = 0
        for req in list(fe.requests.values()):
            holds = (
                req.decode_node == node.name
                if node.role == "decode"
                else req.prefill_node == node.name and not req.is_prefilled
            )
            if (
                holds
                and has_peer
                and req.num_migrations < fe.cfg.max_migrations
                and not self._is_done(req)
            ):
                await self._move(
                    req, node.name, "drain", f"{node.role} node {node.name} is draining"
                )
                num_moved += 1
            elif holds:  # no other node of its role, moved too often, or done: it ends there
                num_staying += 1
        fe.wake_dispatch()
        return DrainReply(node.name, num_moved, num_staying, has_peer)

    def counts(self) -> dict:
        return {**self.num_moved, "failed": self.num_failed, "syncs": self.num_syncs}
