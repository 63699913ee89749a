"""The frontend: an asyncio service between clients and the nodes.

client loop:  receive a request -> check, tokenize (a long prompt off the loop:
              prompts.py) -> admit under its client's limits (intake.py)
dispatch:     clients take turns; a request goes to a prefill/decode pair with room
              (dispatch.py)
node loop:    tokens from decode -> detokenize, stop strings -> stream to the client
              (node_link.py)
watchdog:     silent or hung nodes are lost (their requests move: migrate.py); deadlines
              abort; the dead are forgotten

Request ids are the client's own, scoped to its connection; nodes see ids made
here, so no client can name another's request. A node may speak only for the
requests routed to it, and (with keys) only under the name its key proves.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path
from typing import Callable

from common.base.config import FrontendConfig, clamp_model_len
from common.base.log import Throttle, get_logger
from common.base.model_spec import load_spec
from common.base.request import FINISH_ABORT, FINISH_ERROR
from common.runtime.process import describe_threads
from common.wire.channel import AsyncChannel, BadMessage, open_async_context
from common.wire.client import MAX_MESSAGES
from common.wire.keys import FRONTEND, load_keys
from common.wire.protocol import (
    CLIENT_TO_FRONTEND,
    AbortRequest,
    DrainRequest,
    ErrorReply,
    GenerateOutput,
    GenerateRequest,
    NodeAbort,
    StatsReply,
    StatsRequest,
)
from frontend import activity, http, paths, router, watchdog
from frontend.admission import Admission
from frontend.client_link import MAX_QUEUED, ClientLink
from frontend.dispatch import Dispatcher
from frontend.intake import Intake
from frontend.metrics import Metrics
from frontend.migrate import Migrations
from frontend.node_link import NodeMessages
from frontend.nodes import NodeRegistry
from frontend.prompts import Prompts
from frontend.request import ClientKey, RequestState

log = get_logger("frontend")
noisy = Throttle(log)  # lines about what clients and peers send


class Frontend:
    def __init__(self, cfg: FrontendConfig):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.keys = load_keys(cfg.keys_dir, FRONTEND)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.spec = load_spec(cfg.model)
        self.served_model = cfg.served_model_name or Path(cfg.model).name
        self.max_model_len = clamp_model_len(cfg.max_model_len, self.spec.max_position_embeddings)
        self.prompts = Prompts(
            cfg.model,
            self.tokenizer,
            self.spec,
            self.max_model_len,
            cfg.logprobs_mode == "processed_logprobs",
        )
        self.intake = Intake(self)
        self.migrations = Migrations(self)
        self.node_messages = NodeMessages(self, self.migrations)
        self.client_link = ClientLink(self)
        self.registry = NodeRegistry(
            cfg,
            self.keys is not None,
            self.migrations.node_lost,
            self.migrations.sync,
            self.wake_dispatch,
        )
        self.nodes = self.registry.nodes  # by name
        self.requests: dict[str, RequestState] = {}  # by node id
        # (client, its id) -> its n choices
        self.by_client: dict[tuple[ClientKey, str], list[RequestState]] = {}
        self.admission = Admission(
            cfg.max_requests_per_client,
            cfg.max_kv_tokens_per_client,
            cfg.max_waiting_tokens,
            lambda req: len(req.prompt_ids),
        )
        self.num_served = 0
        self.is_draining = False
        self.paths = paths.PathChooser(cfg.disaggregate, time.monotonic)
        self.dispatcher = Dispatcher(self)
        self.metrics = Metrics(self)
        self.activity = activity.ActivityLog(self, cfg.links.log_interval_s)  # the periodic line
        # In-process clients' replies: local_sink(client, message, http_status).
        self.local_sink: Callable[[ClientKey, object, int | None], None] | None = None
        # ZeroMQ clients' outputs while a TokenBatch is handled: sent as one message each.
        self.outbox: dict[bytes, list[GenerateOutput]] | None = None

    # ---- life cycle ---------------------------------------------------------

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT (then drain) or a task fails (then exit 1, loudly)."""
        ctx = open_async_context(self.keys)
        limit = self.cfg.links.max_message_bytes
        # NOTE: no list in a client's message may be longer than the model: refused unread.
        self.clients = AsyncChannel(
            ctx,
            True,
            self.cfg.client_endpoint,
            max_message_bytes=limit,
            domain="clients" if self.cfg.is_client_auth else None,
            max_list_len=max(self.max_model_len, MAX_MESSAGES) + 1,
            max_queued=MAX_QUEUED,
            takes_tags=False,
        )
        self.node_link = AsyncChannel(
            ctx, True, self.cfg.node_endpoint, max_message_bytes=limit, domain="nodes"
        )
        self.registry.link = self.node_link
        web = None
        try:
            web = await http.serve(self, self.cfg)
            return await self._serve()
        finally:
            self.prompts.close()
            if web is not None:
                await web.cleanup()
            self.clients.close()
            self.node_link.close()
            ctx.term()

    async def _serve(self) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        self._wake = asyncio.Event()
        log.info(
            "serving clients at %s, nodes at %s (%s; %s); the nodes know its requests as %s-N",
            self.cfg.client_endpoint,
            self.cfg.node_endpoint,
            f"CURVE keys from {self.cfg.keys_dir}"
            if self.keys
            else "open links: anyone who reaches the node port can join",
            describe_threads(),
            self.intake.life,
        )
        loops = (
            self._client_loop(),
            self.node_messages.run(),
            self._dispatch_loop(),
            watchdog.watchdog_loop(self),
            self.activity.run(),
        )
        tasks = [asyncio.create_task(c, name=c.__name__) for c in loops]
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
        rc = 0
        for t in done:
            if t is not stopped:  # NOTE: a loop never ends by itself; if it did, say so and exit
                rc = 1
                log.error(
                    "the %s task died: the frontend stops",
                    t.get_name(),
                    exc_info=t.exception() if not t.cancelled() else None,
                )
        if rc == 0:
            await self._drain()
        log.info("stopping: %d requests in flight are aborted", len(self.requests))
        for req in list(self.requests.values()):
            await self.finish(req, FINISH_ABORT, "the frontend is shutting down", status=503)
        for t in [*tasks, stopped]:
            t.cancel()
        await asyncio.gather(*tasks, stopped, return_exceptions=True)
        return rc

    async def _drain(self) -> None:
        """Take no new requests; let running ones finish within drain_timeout_s."""
        self.is_draining = True
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        if self.requests:
            log.info(
                "draining: %d requests in flight get up to %.0fs to finish",
                len(self.requests),
                self.cfg.drain_timeout_s,
            )
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    # ---- clients ------------------------------------------------------------

    async def _client_loop(self) -> None:
        while True:
            client, msg = await self.clients.recv(CLIENT_TO_FRONTEND)
            try:
                if isinstance(msg, BadMessage):
                    await self.reply_error(client, msg.request_id, msg.error)
                elif isinstance(msg, GenerateRequest):
                    await self.submit(client, msg)
                elif isinstance(msg, AbortRequest):
                    await self.abort(client, msg.request_id)
                elif isinstance(msg, StatsRequest):
                    await self.reply(
                        client,
                        StatsReply(
                            self.is_ready(),
                            self.registry.stats(),
                            self.model_info(),
                            self.frontend_stats(),
                        ),
                    )
                elif isinstance(msg, DrainRequest):
                    await self.reply(client, *await self.migrations.on_drain_request(msg.node))
            except Exception:  # one bad request must not stop the service
                log.exception("error while handling a %s", type(msg).__name__)
                for req in self.by_client.get((client, getattr(msg, "request_id", None)), [])[:1]:
                    await self.fail_request(req, "internal error", 500)

    async def reply(self, client: ClientKey, msg, status: int | None = None) -> None:
        """To a ZeroMQ client (its routing id) or an in-process one (the HTTP server's
        key); status is the HTTP status an error maps to."""
        if isinstance(client, bytes):
            if self.outbox is not None and isinstance(msg, GenerateOutput):
                self.outbox.setdefault(client, []).append(msg)
            else:
                await self.client_link.send(client, msg)
        elif self.local_sink is not None:
            self.local_sink(client, msg, status)

    async def reply_error(
        self, client: ClientKey, request_id: str | None, error: str, status: int = 400
    ) -> None:
        """An error for a request of that id that ends it; where one of that id runs or is
        being prepared, an error beside it (it is not that request's: a duplicate id)."""
        noisy.info("rejected request %s: %s", request_id, error)
        key = (client, request_id)
        if request_id is not None and not (key in self.by_client or self.intake.is_preparing(key)):
            # index -1: every choice of it ends with this
            await self.reply(
                client,
                GenerateOutput(request_id, [], "", True, FINISH_ERROR, error, index=-1),
                status,
            )
        else:
            await self.reply(client, ErrorReply(error, request_id), status)

    async def submit(self, client: ClientKey, req: GenerateRequest) -> None:
        """Take a request from a client: admitted, or answered with an error (intake.py)."""
        await self.intake.submit(client, [req])

    async def submit_group(self, client: ClientKey, reqs: list[GenerateRequest]) -> None:
        """Requests admitted together or refused together (an HTTP batch of prompts)."""
        await self.intake.submit(client, reqs)

    async def abort(self, client: ClientKey, request_id: str) -> None:
        choices = self.by_client.get((client, request_id))
        if choices is None and self.intake.cancel((client, request_id)):
            return  # answered once its tokenizing ends
        if choices is None:
            await self.reply(
                client, ErrorReply(f"unknown request_id {request_id!r}", request_id), 404
            )
            return
        for req in list(choices):
            await self.finish(req, FINISH_ABORT, "cancelled by the client")

    # ---- dispatch -----------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        """Send waiting requests, clients in turn, while a node pair has room. Woken by
        arrivals, by requests that leave a node, and by the watchdog's tick."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.admission.num_waiting:
                if not await self.dispatcher.send_next():
                    break  # no pair has room: wait for the next wake

    # ---- figures --------------------------------------------------------------

    def is_ready(self) -> bool:
        return router.choose(self.nodes) is not None and not self.is_draining

    def model_info(self) -> dict:
        return {
            "name": self.served_model,
            "vocab_size": self.spec.vocab_size,
            "max_model_len": self.max_model_len,
        }

    def frontend_stats(self) -> dict:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "cpu_s": round(time.process_time(), 3),
            "is_draining": self.is_draining,
            "is_authenticated": bool(self.keys),
            "num_waiting": self.admission.num_waiting,
            "num_waiting_tokens": self.admission.num_waiting_tokens,
            "num_running": len(self.requests) - self.admission.num_waiting,
            "num_clients": len(self.admission.clients),
            "num_served": self.num_served,
            "num_overloaded": self.admission.num_refused,
            "num_bad_client_messages": self.clients.num_bad,
            "num_clients_dropped": self.client_link.num_dropped,
            "num_bad_node_messages": self.node_link.num_bad,
            "num_node_link_resets": self.node_link.num_reroutes,
            "routes": dict(self.dispatcher.num_routes),
            "migrations": self.migrations.counts(),
            "paths": self.paths.stats(),
        }

    # ---- requests leave ----------------------------------------------------------

    async def finish(
        self,
        req: RequestState,
        reason: str,
        error: str | None,
        token_ids: list[int] = (),
        is_node_done: bool = False,
        status: int | None = None,
        logprobs: list | None = None,
    ) -> None:
        """The last message of a request; the nodes drop it unless they ended it themselves.
        status: the HTTP status an error maps to (for in-process clients)."""
        if self.requests.pop(req.node_id, None) is None:
            return
        choices = self.by_client.get((req.client, req.request_id), [])
        if req in choices:
            choices.remove(req)
        if not choices:
            self.by_client.pop((req.client, req.request_id), None)
        self.admission.done(req.client, req, req.kv_tokens)
        for f in req.forks:  # ended before they were sent with it: they go on their own
            if f.node_id in self.requests:
                self.admission.requeue(f.client, f)
        req.forks = []
        self.unroute(req)
        if not is_node_done:
            for name in (req.prefill_node, req.decode_node):
                node = self.nodes.get(name)
                if node is not None and node.is_alive:
                    await self.node_link.send(NodeAbort(req.node_id), to=node.identity)
        out = req.final_output(reason, error, token_ids, logprobs)
        self.num_served += 1
        self.metrics.finished(req, reason)
        await self.reply(req.client, out, status)

    async def fail_request(self, req: RequestState, error: str, status: int) -> None:
        """Every choice of req's request ends with this error."""
        for r in list(self.by_client.get((req.client, req.request_id), [req])):
            await self.finish(r, FINISH_ERROR, error, status=status)

    def unroute(self, req: RequestState) -> None:
        """Its nodes' counts no longer include it (it ended, or it moves)."""
        if req.prefill_node is not None:
            if not req.is_prefilled:
                req.is_prefilled = True
                router.prefill_done(self.nodes.get(req.prefill_node), req.work_tokens)
            router.decode_done(self.nodes.get(req.decode_node))
            self._wake.set()

    def wake_dispatch(self) -> None:
        self._wake.set()
