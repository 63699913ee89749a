"""The frontend's node link, inbound: what nodes say (registration, heartbeats, tokens,
failures, syncs, drains, prefix updates), each checked against who says it: a node
speaks only for the requests routed to it, and only under the name it proved.
Tokens are detokenized and streamed to their clients, one message per client per
TokenBatch; an update that skips tokens moves its request on (migrate.py)."""

from __future__ import annotations

import time

from common.base.log import Throttle, get_logger
from common.base.request import FINISH_ERROR, FINISH_STOP
from common.wire.channel import BadMessage
from common.wire.protocol import (
    NODE_TO_FRONTEND,
    GenerateOutput,
    Heartbeat,
    NodeAbort,
    NodeDraining,
    NodeReady,
    NodeSynced,
    OutputBatch,
    PrefixUpdate,
    RequestFailed,
    TokenBatch,
    TokenUpdate,
)
from frontend import router
from frontend.hub import Hub
from frontend.migrate import Migrations
from frontend.request import LostTokens
from frontend.router import NodeState

log = get_logger("frontend")
noisy = Throttle(log)


class NodeMessages:
    def __init__(self, frontend: Hub, migrations: Migrations):
        self.fe, self.migrations = frontend, migrations

    async def run(self) -> None:
        fe = self.fe
        while True:
            sender, msg = await fe.node_link.recv(NODE_TO_FRONTEND)
            try:
                await self.on_message(sender, msg)
                for tag in fe.node_link.take_rerouted():  # a node's link was made again
                    node = fe.registry.by_identity(tag)
                    if node is not None and node.is_alive:
                        await self.migrations.sync(node)
            except Exception:
                log.exception("error while handling a %s from a node", type(msg).__name__)

    async def on_message(self, sender: bytes, msg) -> None:
        fe = self.fe
        if isinstance(msg, BadMessage):
            noisy.warning("dropped a malformed message from %r: %s", sender, msg.error)
            return
        if isinstance(msg, NodeReady):
            await fe.registry.on_ready(sender, msg)
            return
        if isinstance(msg, Heartbeat):
            await fe.registry.on_heartbeat(sender, msg)
            return
        node = fe.registry.by_identity(sender)
        if node is None:
            noisy.warning("message from unregistered node %r ignored", sender)
            return
        fe.registry.seen(node)
        if isinstance(msg, RequestFailed):
            req = fe.requests.get(msg.request_id)
            if req is None or node.name not in (req.prefill_node, req.decode_node):
                return
            if msg.is_retryable:  # its KV's way was cut, or its KV did not land whole
                # NOTE: or the prefill node's own fault (a grammar it could not compile): the
                # log names who said so, not only the decode node it leaves
                why = msg.error if node.name == req.decode_node else f"{node.name}: {msg.error}"
                await self.migrations.move_or_fail(req, req.decode_node, "handoff", why)
            else:
                status = 400 if msg.is_bad_request else 500
                await fe.finish(req, FINISH_ERROR, msg.error, status=status)
        elif isinstance(msg, NodeSynced):
            await self.migrations.on_synced(node, msg)
        elif isinstance(msg, NodeDraining):
            if msg.name == node.name and msg.pid == node.ready.pid:
                await self.migrations.drain(node)
        elif isinstance(msg, TokenBatch):
            fe.outbox = {}
            try:
                for u in msg.updates:
                    await self.on_tokens(node, u)
            finally:
                outbox = fe.outbox
                fe.outbox = None
                # NOTE: one client's failure is not another's
                for client, outputs in outbox.items():
                    try:
                        await fe.client_link.send(
                            client, outputs[0] if len(outputs) == 1 else OutputBatch(outputs)
                        )
                    except Exception:
                        log.exception("could not send %d outputs to a client", len(outputs))
        elif isinstance(msg, PrefixUpdate) and node.ready.pid == msg.pid:
            router.update_prefix(node, msg.added, msg.removed, msg.is_reset)

    async def on_tokens(self, node: NodeState, u: TokenUpdate) -> None:
        fe = self.fe
        req = fe.requests.get(u.request_id)
        if req is None or node.name not in (req.prefill_node, req.decode_node):
            # Finished here already (the node should drop it too), or not this node's to report.
            if u.prompt_logprobs is not None:
                # NOTE: its request's other choices may wait for these (watchdog: they prefill
                # again); said, so that a wait is explained in the log.
                noisy.warning(
                    "the prompt's logprobs for %s came from %s node %s after it ended or moved",
                    u.request_id,
                    node.role,
                    node.name,
                )
            await fe.node_link.send(NodeAbort(u.request_id), to=node.identity)
            return
        if any(t >= fe.spec.vocab_size for t in u.token_ids):
            await fe.finish(
                req,
                FINISH_ERROR,
                f"{node.role} node {node.name} sent a token outside the vocabulary",
                status=502,
            )
            return
        if (
            u.prompt_logprobs is not None
            and node.name == req.prefill_node
            and req.prompt_logprobs is None
        ):
            num_lps, num_prompt = len(u.prompt_logprobs), len(req.prompt_ids)
            if num_lps != num_prompt - 1:  # one per prompt token after the first
                why = f"{num_lps} prompt logprobs for a prompt of {num_prompt} tokens"
                await fe.fail_request(req, f"prefill node {node.name} sent {why}", 502)
                return
            # Sent once per request (with choice 0's update): every choice routed with it has them.
            # NOTE: a copy: a choice released here ends, and finish() drops it from the list
            for choice in list(fe.by_client.get((req.client, req.request_id), [req])):
                if choice.prefill_node == node.name and choice.prompt_logprobs is None:
                    choice.prompt_logprobs = u.prompt_logprobs
                    if choice is not req:
                        await self._release_held(choice)
            if fe.requests.get(u.request_id) is not req:
                return  # NOTE: ended or moved while the releases awaited
        if req.is_waiting_prompt_logprobs(node.name):
            size = req.held_size_of(u)
            if req.is_held_full(size):
                # NOTE: held updates are kept unread: past what the choice's tokens explain,
                # the node is not serving it (a hostile one would spend our memory)
                why = f"{node.role} node {node.name} sent more than the choice can make"
                why += f" before the prompt's logprobs ({len(req.held) + 1} updates, size"
                why += f" {req.held_size + size}: updates, tokens and logprob entries)"
                await fe.finish(req, FINISH_ERROR, why, status=502)
                return
            req.held.append((node, u))
            req.held_size += size
            req.held_since = req.held_since or time.monotonic()
            return
        await self._on_tokens(req, node, u)
        if fe.requests.get(u.request_id) is req:
            await self._release_held(req)

    async def _release_held(self, req) -> None:
        """Its nodes' updates that waited for the prompt's logprobs, now they are here."""
        fe = self.fe
        if req.held and req.prompt_logprobs is not None:
            for held_node, h in req.take_held():  # in the order they came
                if fe.requests.get(h.request_id) is req and held_node.name in (
                    req.prefill_node,
                    req.decode_node,
                ):
                    await self._on_tokens(req, held_node, h)

    async def _on_tokens(self, req, node: NodeState, u: TokenUpdate) -> None:
        fe = self.fe
        try:
            num_known = req.num_known(node.name, u.index, u.token_ids, u.finish_reason)
        except LostTokens as e:
            await self.migrations.move_or_fail(req, node.name, "link", str(e))
            return
        except ValueError as e:
            await fe.finish(req, FINISH_ERROR, str(e), status=502)
            return
        if num_known is None:
            return
        token_ids = u.token_ids[num_known:]
        logprobs = u.logprobs[num_known:] if u.logprobs is not None else None
        if not req.is_prefilled:
            req.is_prefilled = True
            router.prefill_done(fe.nodes.get(req.prefill_node), req.work_tokens)
            fe.wake_dispatch()
        is_first = req.num_tokens == 0 and bool(token_ids)
        if is_first:
            req.first_token_at = time.monotonic()
        if u.timings:  # the first updates': TTFT parts; a preempted request's last: its preemptions
            parts = dict(u.timings)
            cached = parts.pop("cached_tokens", None)  # a count that rides with them: usage's
            if isinstance(cached, int) and not req.num_migrations:
                req.num_cached_tokens = min(cached, len(req.prompt_ids))
            if (
                node.name == req.decode_node
                and req.timings.get("path") == "disaggregated"
                and "kv_transfer_ms" in parts  # NOTE: a last update's counts are no handoff
            ):
                handoff_ms = sum(
                    v
                    for k in ("kv_transfer_ms", "decode_admission_ms")
                    if isinstance(v := parts.get(k), (int, float)) and not isinstance(v, bool)
                )
                fe.paths.observe_handoff(node.name, len(req.prompt_ids), handoff_ms / 1e3)
            req.timings.update(self.migrations.timings(req, parts))
        if is_first:
            req.timings["ttft_ms"] = round((time.time() - req.arrival_time) * 1e3, 3)
        if req.is_prompt_only and token_ids:  # max_tokens 0: its one token is not shown
            await fe.finish(req, "length", None)
            return
        if not token_ids and not u.finish_reason:
            return  # the repeated first token alone: nothing new for the client
        token_ids, logprobs = req.add_output(token_ids, logprobs)
        if req.detok.is_stopped:
            await fe.finish(req, FINISH_STOP, None, token_ids, logprobs=logprobs)
        elif u.finish_reason:
            reason = u.finish_reason if u.finish_reason in ("stop", "length") else FINISH_ERROR
            await fe.finish(req, reason, None, token_ids, is_node_done=True, logprobs=logprobs)
        else:
            await fe.reply(
                req.client,
                GenerateOutput(
                    req.request_id,
                    token_ids,
                    req.detok.take(),
                    timings=req.timings if is_first else None,
                    logprobs=logprobs,
                    **req.take_prompt_logprobs(),
                    index=req.index,
                ),
            )
