"""OpenAI-compatible HTTP, Prometheus /metrics and /health, served by the frontend
process in its own event loop (aiohttp), beside the ZeroMQ client socket.

An HTTP request becomes an in-process client of the frontend: the same admission,
routing, limits and deadlines as a ZeroMQ request, with no socket in between.
Clients are keyed ("http", peer address), so per-client limits hold per host.
A client that goes away (a dropped stream, a closed connection) aborts its
request, which frees its KV blocks on every node.
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from common.wire.channel import LinkError
from common.base.log import Throttle, get_logger
from common.wire.protocol import ErrorReply, GenerateOutput
from frontend import openai_api as api
from frontend.metrics import CONTENT_TYPE
from frontend.openai_api import ApiError

log = get_logger("http")
noisy = Throttle(log)
# NOTE: a body is parsed on the frontend's one loop: its size follows the model, so no
# body holds much more than a prompt the model can take (JSON of a million small ints
# is ~50 ms to parse; of sixteen MB, half a second of every stream's time).
BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 2 * 2**20
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class HttpServer:
    def __init__(self, frontend, served_model: str):
        self.frontend = frontend
        self.served_model = served_model
        self.streams: dict[str, asyncio.Queue] = {}   # request id -> (message, status) queue
        frontend.local_sink = self._deliver

    def _deliver(self, client, msg, status: int | None) -> None:
        rid = getattr(msg, "request_id", None)
        queue = self.streams.get(rid)
        if queue is not None:
            queue.put_nowait((msg, status))

    def app(self, is_metrics_only: bool = False) -> web.Application:
        limit = max(MIN_BODY_BYTES, BYTES_PER_TOKEN * self.frontend.max_model_len)
        app = web.Application(client_max_size=limit)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        if not is_metrics_only:
            app.router.add_get("/v1/models", self.models)
            app.router.add_post("/v1/completions", self.completions)
            app.router.add_post("/v1/chat/completions", self.chat)
        return app

    # ---- plain endpoints ---------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        is_ready = self.frontend.is_ready()
        return web.json_response({"status": "ok" if is_ready else "unavailable"},
                                 status=200 if is_ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.frontend.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        info = self.frontend.model_info()
        return web.json_response({"object": "list", "data": [{
            "id": self.served_model, "object": "model", "created": api.now(), "owned_by": "pdserve",
            "max_model_len": info["max_model_len"], "vocab_size": info["vocab_size"]}]})

    # ---- generation ------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                raise ApiError(400, "the request body is not valid JSON")
            # Completions default to 16 tokens, as OpenAI's; chat to what the model length leaves.
            call = api.parse(body, kind, self.served_model, None if kind == "chat" else 16)
        except ApiError as e:
            noisy.info("refused an HTTP request: %s", e.message)
            return web.json_response(e.body(), status=e.status)
        except web.HTTPRequestEntityTooLarge:
            return web.json_response(api.error_body(413, "the request body is too large"), status=413)
        client = ("http", request.remote or "?")
        rid = call.request.request_id
        queue = self.streams[rid] = asyncio.Queue()
        is_done = False
        try:
            await self.frontend.submit(client, call.request)
            msg, status = await queue.get()
            if status is not None:   # refused or failed before any token
                error = msg.error if isinstance(msg, (GenerateOutput, ErrorReply)) else "failed"
                is_done = True
                return web.json_response(api.error_body(status, error), status=status)
            if call.is_stream:
                response = await self._stream(request, call, msg, queue)
            else:
                response = await self._whole(call, msg, queue)
            is_done = True
            return response
        finally:
            # NOTE: runs on a client disconnect too (aiohttp cancels the handler): the
            # request must not keep decoding for nobody.
            self.streams.pop(rid, None)
            if not is_done:   # an unknown id (it ended meanwhile) is answered to nobody
                await self.frontend.abort(client, rid)

    async def _whole(self, call: api.Call, msg, queue: asyncio.Queue) -> web.Response:
        text, token_ids, status = [], [], None
        while True:
            text.append(msg.text)
            token_ids += msg.token_ids
            if msg.is_finished:
                break
            msg, status = await queue.get()
        if msg.finish_reason not in ("stop", "length"):
            status = status or 500
            return web.json_response(api.error_body(status, msg.error or msg.finish_reason), status=status)
        use = api.usage(**msg.usage) if msg.usage else api.usage(0, len(token_ids))
        return web.json_response(api.response(call, api.now(), "".join(text), token_ids,
                                              api.finish_reason(msg.finish_reason), use))

    async def _stream(self, request: web.Request, call: api.Call, msg,
                      queue: asyncio.Queue) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", **HEADERS})
        await out.prepare(request)
        created = api.now()
        event = api.text_events(call, created)
        # Events not yet written. Everything already queued goes out in one write: a
        # socket write per event is most of a stream's cost, and a client that lags
        # a step behind gets its backlog at once.
        events = [api.stream_event(api.chunk(call, created, is_role=True))] if call.is_chat else []
        status = None
        while True:
            if msg.text or (call.is_token_ids and msg.token_ids):   # held-back text waits
                events.append(event(msg.text, msg.token_ids))
            if msg.is_finished:
                break
            if queue.empty():
                if events:
                    await out.write(b"".join(events))
                    events.clear()
                msg, status = await queue.get()
            else:
                msg, status = queue.get_nowait()
        if msg.finish_reason in ("stop", "length"):
            events.append(api.stream_event(
                api.chunk(call, created, finish_reason=api.finish_reason(msg.finish_reason))))
            if call.is_usage_streamed and msg.usage:
                # pdserve's TTFT parts ride along on the usage chunk (an extra key).
                events.append(api.stream_event({**api.chunk(call, created, use=api.usage(**msg.usage)),
                                                "timings": msg.timings or {}}))
        else:   # the status line is sent: the error goes in the stream, as OpenAI's servers do
            events.append(api.stream_event(api.error_body(status or 500, msg.error or msg.finish_reason)))
        events.append(b"data: [DONE]\n\n")
        await out.write_eof(b"".join(events))
        return out


async def serve(frontend, cfg) -> web.AppRunner | None:
    """Start the HTTP site (OpenAI API, /metrics, /health) or the metrics-only site
    the config asks for; None when neither."""
    port = cfg.http_port or cfg.metrics_port
    if not port:
        return None
    server = HttpServer(frontend, frontend.served_model)
    # handler_cancellation: a client that hangs up cancels its handler, which aborts the request.
    runner = web.AppRunner(server.app(is_metrics_only=not cfg.http_port), handler_cancellation=True,
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.http_host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise LinkError(f"cannot serve HTTP on {cfg.http_host}:{port}: {e.strerror or e}: "
                      f"choose another {'--http-port' if cfg.http_port else '--metrics-port'}") from None
    log.info("%s at http://%s:%d", "OpenAI API, /metrics and /health" if cfg.http_port
             else "/metrics and /health", cfg.http_host, port)
    return runner
