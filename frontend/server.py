"""The frontend: an asyncio service between clients and the nodes.

client loop:  receive a request -> validate, tokenize -> route to a prefill node
node loop:    tokens from decode -> detokenize, stop strings -> stream to the client
watchdog:     nodes silent past dead_after_s fail their requests; deadlines abort
"""
from __future__ import annotations

import asyncio
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.channel import AsyncChannel, BadMessage, open_async_context
from common.config import FrontendConfig
from common.log import get_logger
from common.model_spec import load_spec
from common.protocol import (CLIENT_TO_FRONTEND, NODE_TO_FRONTEND, AbortRequest, ErrorReply, GenerateOutput, GenerateRequest,
                             Heartbeat, NodeAbort, NodeReady, PrefillRequest, RequestFailed,
                             StatsReply, StatsRequest, TokenBatch)
from common.sampling import SamplingParams, validate_prompt
from common.sequence import FINISH_ABORT, FINISH_ERROR, FINISH_STOP
from frontend import router
from frontend.detok import IncrementalDetokenizer
from frontend.router import NodeState

log = get_logger("frontend")


@dataclass
class RequestState:
    request_id: str
    client: bytes
    prompt_len: int
    detok: IncrementalDetokenizer
    arrival_time: float          # wall clock, comparable with the nodes' stamps
    deadline: float              # monotonic
    prefill_node: str
    decode_node: str
    num_tokens: int = 0
    timings: dict = field(default_factory=dict)
    is_prefilled: bool = False   # its first token came back (or it ended)


class Frontend:
    def __init__(self, cfg: FrontendConfig):
        from transformers import AutoTokenizer
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.spec = load_spec(cfg.model)
        self.max_model_len = min(cfg.max_model_len or self.spec.max_position_embeddings,
                                 self.spec.max_position_embeddings)
        self.nodes: dict[str, NodeState] = {}
        self.requests: dict[str, RequestState] = {}
        self.num_served = 0

    # ---- life cycle ---------------------------------------------------------

    async def run(self) -> None:
        ctx = open_async_context()
        limit = self.cfg.links.max_message_bytes
        self.clients = AsyncChannel(ctx, True, self.cfg.client_endpoint, max_message_bytes=limit)
        self.node_link = AsyncChannel(ctx, True, self.cfg.node_endpoint, max_message_bytes=limit)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("serving clients at %s, nodes at %s", self.cfg.client_endpoint, self.cfg.node_endpoint)
        tasks = [asyncio.create_task(c) for c in
                 (self._client_loop(), self._node_loop(), self._watchdog_loop())]
        await stop.wait()
        log.info("stopping: %d requests in flight are aborted", len(self.requests))
        for req in list(self.requests.values()):
            await self._finish(req, FINISH_ABORT, "the frontend is shutting down")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.clients.close()
        self.node_link.close()
        ctx.term()

    # ---- clients ------------------------------------------------------------

    async def _client_loop(self) -> None:
        while True:
            client, msg = await self.clients.recv(CLIENT_TO_FRONTEND)
            try:
                if isinstance(msg, BadMessage):
                    await self._reply_error(client, msg.request_id, msg.error)
                elif isinstance(msg, GenerateRequest):
                    await self._on_generate(client, msg)
                elif isinstance(msg, AbortRequest):
                    await self._on_abort(client, msg.request_id)
                elif isinstance(msg, StatsRequest):
                    await self.clients.send(StatsReply(self.is_ready(), self.node_stats(),
                                                       self.model_info()), to=client)
            except Exception:  # one bad request must not stop the service
                log.exception("error while handling a %s", type(msg).__name__)
                rid = getattr(msg, "request_id", None)
                if rid in self.requests:
                    await self._finish(self.requests[rid], FINISH_ERROR, "internal error")

    async def _reply_error(self, client: bytes, request_id: str | None, error: str) -> None:
        log.info("rejected request %s: %s", request_id, error)
        if request_id is not None and request_id not in self.requests:
            await self.clients.send(GenerateOutput(request_id, [], "", True, FINISH_ERROR, error),
                                    to=client)
        else:
            await self.clients.send(ErrorReply(error, request_id), to=client)

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        given = [x is not None for x in (req.prompt, req.prompt_token_ids, req.messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        if req.prompt is not None:
            return self.tokenizer.encode(req.prompt)
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        for m in req.messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string role and string content")
        ids = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                                 tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # an encoding or a list

    async def _on_generate(self, client: bytes, req: GenerateRequest) -> None:
        if not req.request_id:
            await self._reply_error(client, None, "request_id must be a non-empty string")
            return
        if req.request_id in self.requests:
            await self.clients.send(ErrorReply(f"duplicate request_id {req.request_id!r}: that "
                                               f"request is still running", req.request_id), to=client)
            return
        try:
            if req.timeout_s is not None and not req.timeout_s > 0:
                raise ValueError(f"timeout_s must be positive, got {req.timeout_s}")
            if not all(isinstance(s, str) for s in req.stop):
                raise ValueError("stop must be a list of strings")
            params = SamplingParams(
                max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                top_k=req.top_k, seed=req.seed if req.seed is not None else random.getrandbits(63),
                stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos)
            params.validate(self.spec.vocab_size)
            ids = self._prompt_ids(req)
            validate_prompt(ids, params.max_tokens, self.spec.vocab_size, self.max_model_len)
        except ValueError as e:
            await self._reply_error(client, req.request_id, str(e))
            return
        route = router.choose(self.nodes)
        if route is None:
            await self._reply_error(client, req.request_id,
                                    "no live prefill and decode node pair is available")
            return
        prefill, decode = route
        timeout = req.timeout_s or self.cfg.default_timeout_s
        state = RequestState(req.request_id, client, len(ids),
                             IncrementalDetokenizer(self.tokenizer, req.stop), time.time(),
                             time.monotonic() + timeout, prefill.ready.name, decode.ready.name)
        self.requests[req.request_id] = state
        router.routed(prefill, decode, len(ids))
        await self.node_link.send(PrefillRequest(req.request_id, ids, params, state.arrival_time,
                                                 decode.ready.name, decode.ready.kv_endpoint),
                                  to=prefill.identity)

    async def _on_abort(self, client: bytes, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.client != client:
            await self.clients.send(ErrorReply(f"unknown request_id {request_id!r}", request_id),
                                    to=client)
            return
        await self._finish(req, FINISH_ABORT, "cancelled by the client")

    # ---- routing --------------------------------------------------------------

    def is_ready(self) -> bool:
        return router.choose(self.nodes) is not None

    def model_info(self) -> dict:
        return {"name": Path(self.cfg.model).name, "vocab_size": self.spec.vocab_size,
                "max_model_len": self.max_model_len}

    def node_stats(self) -> dict:
        now = time.monotonic()
        return {name: {"role": n.ready.role, "is_alive": n.is_alive, "pid": n.ready.pid,
                       "device": n.ready.device, "kv_transfer": n.ready.kv_transfer,
                       "seconds_since_seen": round(now - n.last_seen, 3),
                       "num_routed": n.num_routed, **n.stats} for name, n in self.nodes.items()}

    # ---- nodes ----------------------------------------------------------------

    async def _node_loop(self) -> None:
        while True:
            sender, msg = await self.node_link.recv(NODE_TO_FRONTEND)
            try:
                await self._on_node_message(sender, msg)
            except Exception:
                log.exception("error while handling a %s from a node", type(msg).__name__)

    async def _on_node_message(self, sender: bytes, msg) -> None:
        if isinstance(msg, BadMessage):
            log.warning("dropped a malformed message from %r: %s", sender, msg.error)
            return
        if isinstance(msg, NodeReady):
            await self._on_ready(sender, msg)
            return
        if isinstance(msg, Heartbeat):  # from the node's heartbeat socket: known by name
            node = self.nodes.get(msg.name)
            if node is not None:
                self._seen(node)
                node.stats = msg.stats
            return
        node = next((n for n in self.nodes.values() if n.identity == sender), None)
        if node is None:
            log.warning("message from unregistered node %r ignored", sender)
            return
        self._seen(node)
        if isinstance(msg, RequestFailed):
            req = self.requests.get(msg.request_id)
            if req is not None:
                await self._finish(req, FINISH_ERROR, msg.error)
        elif isinstance(msg, TokenBatch):
            for u in msg.updates:
                await self._on_tokens(node, u)

    def _seen(self, node: NodeState) -> None:
        node.last_seen = time.monotonic()
        if not node.is_alive:
            node.is_alive = True
            log.info("%s node %s is back", node.ready.role, node.ready.name)

    async def _on_ready(self, sender: bytes, ready: NodeReady) -> None:
        old = self.nodes.get(ready.name)
        if old is not None and old.ready.pid != ready.pid:
            await self._fail_node_requests(old, f"{old.ready.role} node {ready.name} restarted")
        self.nodes[ready.name] = NodeState(ready, sender, time.monotonic())
        log.info("%s node %s ready (pid %d, %s, %d KV blocks)", ready.role, ready.name, ready.pid,
                 ready.device, ready.num_kv_blocks)

    async def _on_tokens(self, node: NodeState, u) -> None:
        req = self.requests.get(u.request_id)
        if req is None:  # finished or failed here already: the node should drop it too
            await self.node_link.send(NodeAbort(u.request_id), to=node.identity)
            return
        if not req.is_prefilled:
            req.is_prefilled = True
            router.prefill_done(self.nodes.get(req.prefill_node), req.prompt_len)
        if u.timings:
            req.timings.update(u.timings)
            req.timings["ttft_ms"] = round((time.time() - req.arrival_time) * 1e3, 3)
        req.num_tokens += len(u.token_ids)
        req.detok.add(u.token_ids)
        if req.detok.is_stopped:
            await self._finish(req, FINISH_STOP, None, u.token_ids)
        elif u.finish_reason:
            await self._finish(req, u.finish_reason, None, u.token_ids, is_node_done=True)
        else:
            await self.clients.send(GenerateOutput(req.request_id, u.token_ids, req.detok.take(),
                                                   timings=req.timings if u.timings else None),
                                    to=req.client)

    async def _finish(self, req: RequestState, reason: str, error: str | None,
                      token_ids: list[int] = (), is_node_done: bool = False) -> None:
        """The last message of a request; the nodes drop it unless they ended it themselves."""
        if self.requests.pop(req.request_id, None) is None:
            return
        if not req.is_prefilled:
            req.is_prefilled = True
            router.prefill_done(self.nodes.get(req.prefill_node), req.prompt_len)
        router.decode_done(self.nodes.get(req.decode_node))
        if not is_node_done:
            for name in (req.prefill_node, req.decode_node):
                node = self.nodes.get(name)
                if node is not None and node.is_alive:
                    await self.node_link.send(NodeAbort(req.request_id), to=node.identity)
        req.timings["total_ms"] = round((time.time() - req.arrival_time) * 1e3, 3)
        usage = {"prompt_tokens": req.prompt_len, "completion_tokens": req.num_tokens}
        self.num_served += 1
        await self.clients.send(GenerateOutput(req.request_id, list(token_ids), req.detok.take(True),
                                               True, reason, error, usage, req.timings),
                                to=req.client)

    async def _fail_node_requests(self, node: NodeState, error: str) -> None:
        name = node.ready.name
        for req in list(self.requests.values()):
            if req.decode_node == name or (req.prefill_node == name and req.num_tokens == 0):
                await self._finish(req, FINISH_ERROR, error)

    # ---- watchdog -------------------------------------------------------------

    async def _watchdog_loop(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            for node in self.nodes.values():
                if node.is_alive and now - node.last_seen > self.cfg.links.dead_after_s:
                    node.is_alive = False
                    log.error("%s node %s silent for %.1fs: failing its requests",
                              node.ready.role, node.ready.name, now - node.last_seen)
                    await self._fail_node_requests(
                        node, f"{node.ready.role} node {node.ready.name} stopped responding")
            for req in list(self.requests.values()):
                if now > req.deadline:
                    await self._finish(req, FINISH_ABORT, "deadline exceeded")
