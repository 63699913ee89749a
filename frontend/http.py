"""OpenAI-compatible HTTP, Prometheus /metrics and /health, served by the frontend
process in its own event loop (aiohttp), beside the ZeroMQ client socket.

An HTTP request becomes an in-process client of the frontend: the same admission,
routing, limits and deadlines as a ZeroMQ request, with no socket in between.
Clients are keyed ("http", peer address), so per-client limits hold per host.
A client that goes away (a dropped stream, a closed connection) aborts its
request, which frees its KV blocks on every node. Here: the routes and the life of a
call's requests; how their outputs become an answer, whole or streamed, is answers.py.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from common.base.log import Throttle, get_logger
from common.wire.channel import LinkError
from common.wire.protocol import ErrorReply, GenerateOutput
from frontend import access_log, http_site, json_body, openapi, server_timing
from frontend import openai_api as api
from frontend import openai_logprobs as lp_shapes
from frontend import openai_out as shapes
from frontend.answers import Answer, stream, whole
from frontend.metrics import CONTENT_TYPE
from frontend.openai_api import ApiError
from frontend.reply_cost import check_whole_reply_logprobs

log = get_logger("http")
noisy = Throttle(log)
# NOTE: a body is parsed on the frontend's one loop: its size follows the model, so no
# body holds much more than a prompt the model can take (JSON of a million small ints
# is ~50 ms to parse; of sixteen MB, half a second of every stream's time).
BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 2 * 2**20
BODY_S = 30.0  # a request body arrives whole within this


class HttpServer:
    def __init__(self, frontend, served_model: str):
        self.frontend = frontend
        self.served_model = served_model
        self.strings = lp_shapes.TokenStrings(frontend.tokenizer)
        self.is_reasoning = bool(frontend.cfg.reasoning_parser)
        self.streams: dict[str, asyncio.Queue] = {}  # request id -> (message, status) queue
        self.prompt_lens: dict[str, int] = {}  # request id -> its prompt's tokens, as it ran
        self.openapi_doc = openapi.openapi(
            served_model, frontend.spec.vocab_size, frontend.max_model_len
        )
        frontend.local_sink = self._deliver

    def _deliver(self, client, msg, status: int | None) -> None:
        rid = getattr(msg, "request_id", None)
        queue = self.streams.get(rid)
        if queue is not None:
            if rid not in self.prompt_lens:
                # NOTE: read while its state lives: a short request may end before its
                # answer reads its first message, and its state with it
                states = self.frontend.by_client.get((client, rid))
                if states:
                    self.prompt_lens[rid] = len(states[0].prompt_ids)
            queue.put_nowait((msg, status))

    def app(self, is_metrics_only: bool = False) -> web.Application:
        limit = max(MIN_BODY_BYTES, BYTES_PER_TOKEN * self.frontend.max_model_len)
        app = web.Application(client_max_size=limit, middlewares=[_openai_errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        if not is_metrics_only:
            app.router.add_get("/v1/models", self.models)
            app.router.add_post("/v1/completions", self.completions)
            app.router.add_post("/v1/chat/completions", self.chat)
            app.router.add_post("/tokenize", self.tokenize)
            app.router.add_post("/detokenize", self.detokenize)
            app.router.add_get("/openapi.json", self.openapi_json)
        return app

    # ---- plain endpoints ---------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.frontend.is_ready():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable"}, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.frontend.metrics.render(), headers={"Content-Type": CONTENT_TYPE}
        )

    async def models(self, request: web.Request) -> web.Response:
        info = self.frontend.model_info()
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.served_model,
                        "object": "model",
                        "created": shapes.now(),
                        "owned_by": "pdserve",
                        "max_model_len": info["max_model_len"],
                        "vocab_size": info["vocab_size"],
                    }
                ],
            }
        )

    async def openapi_json(self, request: web.Request) -> web.Response:
        return web.json_response(self.openapi_doc)

    async def tokenize(self, request: web.Request) -> web.Response:
        fe = self.frontend
        try:
            req = api.parse_tokenize(await _json(request), self.served_model)
            ids = await fe.prompts.tokenize(_client(request), req)
        except (ApiError, ValueError) as e:
            return _refuse(e)
        # NOTE: encoded a piece at a time, as a whole answer: a long text's ids (up to the
        # body's size in bytes, past the model's length) are megabytes of JSON
        return await _whole({"count": len(ids), "max_model_len": fe.max_model_len, "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        fe = self.frontend
        try:
            ids = api.parse_detokenize(
                await _json(request), self.served_model, fe.spec.vocab_size, fe.max_model_len
            )
        except ApiError as e:
            return _refuse(e)
        return web.json_response({"prompt": fe.tokenizer.decode(ids)})

    # ---- generation ------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            # Completions default to 16 tokens, as OpenAI's; chat to what the model length leaves.
            calls = api.parse_calls(
                await _json(request),
                kind,
                self.served_model,
                None if kind == "chat" else 16,
                "any" if self.frontend.cfg.is_json_whitespace else "compact",
            )
            whole = [c.request for c in calls if not c.is_stream]
            check_whole_reply_logprobs(whole, self.frontend.max_model_len)
        except (ApiError, ValueError) as e:
            return _refuse(e)
        answers = await self._serve(request, calls)
        if len(calls) == 1:
            out = answers[0]
            if isinstance(out, web.StreamResponse):
                return out
            return await _whole(out[1], out[0], server_timing.headers(out[2]))
        # A batch of prompts (what evaluation harnesses send): each its own call, admitted
        # together and answered together; choice i of prompt k is at index k * n + i, as vLLM's.
        failed = next(((s, out) for s, out, _ in answers if s != 200), None)
        if failed is not None:
            return web.json_response(failed[1], status=failed[0])
        n = calls[0].request.n
        outs = [out for _, out, _ in answers]
        choices = [
            {**c, "index": k * n + c["index"]} for k, out in enumerate(outs) for c in out["choices"]
        ]
        use = shapes.usage(
            sum(o["usage"]["prompt_tokens"] for o in outs),
            sum(o["usage"]["completion_tokens"] for o in outs),
            sum(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs),
        )
        return await _whole({**outs[0], "choices": choices, "usage": use})

    async def _serve(self, request: web.Request, calls: list[api.Call]) -> list:
        """Calls submitted together (a batch's, or one alone), each answered streamed (its
        StreamResponse) or whole ((status, body, timings))."""
        client = _client(request)
        queues = {c.request.request_id: asyncio.Queue() for c in calls}
        self.streams.update(queues)
        done: set[str] = set()
        try:
            await self.frontend.submit_group(client, [c.request for c in calls])
            return await asyncio.gather(
                *[self._answer(request, client, c, queues, done) for c in calls]
            )
        finally:
            # NOTE: runs on a client disconnect too (aiohttp cancels the handler): no request
            # may keep decoding for nobody (nor its other choices, one failed).
            for rid in queues:
                self.streams.pop(rid, None)
                self.prompt_lens.pop(rid, None)
                if rid not in done or (client, rid) in self.frontend.by_client:
                    await self.frontend.abort(client, rid)  # one that ended: answered to nobody

    async def _answer(
        self, request: web.Request, client, call: api.Call, queues: dict, done: set[str]
    ) -> web.StreamResponse | tuple[int, dict, dict | None]:
        """Its StreamResponse, or (status, body, the timings its Server-Timing says)."""
        rid = call.request.request_id
        msg, status = await queues[rid].get()
        if status is not None:  # refused or failed before any token
            is_error = isinstance(msg, (GenerateOutput, ErrorReply))
            out = (status, api.error_body(status, msg.error if is_error else "failed"), None)
        elif call.is_stream:
            # (a request whose first message is its last: that message's usage says it)
            num_prompt = self.prompt_lens.get(rid, (msg.usage or {}).get("prompt_tokens", 0))
            answers = self._new_answers(call)
            out = await stream(request, call, answers, msg, queues[rid], num_prompt)
        else:
            out = await whole(call, self._new_answers(call), msg, queues[rid])
        done.add(rid)
        return out

    def _new_answers(self, call: api.Call) -> list[Answer]:
        """A call's n choices, before any output: they share the prompt's logprobs."""
        shared: dict = {}
        prompt_text = self._prompt_text(call)
        return [
            Answer(call, self.strings, prompt_text, self.is_reasoning, shared)
            for _ in range(call.request.n)
        ]

    def _prompt_text(self, call: api.Call) -> str:
        """What echo puts first: the prompt as given, or its ids' text."""
        r = call.request
        if not call.is_echo:
            return ""
        if r.prompt is not None:
            return r.prompt
        return self.frontend.tokenizer.decode(r.prompt_token_ids)


def _client(request: web.Request) -> tuple[str, str]:
    """An HTTP client, as the frontend keys it: per-client limits hold per host."""
    return ("http", request.remote or "?")


async def _json(request: web.Request):
    try:
        # NOTE: a handler reading a body is not idle: only this ends a body that never comes
        return await asyncio.wait_for(request.json(), BODY_S)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_S:.0f}s") from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None


async def _whole(body: dict, status: int = 200, headers: dict | None = None) -> web.Response:
    """A whole answer: its JSON encoded a piece at a time, the loop's other work between."""
    data = await json_body.encode(body)  # NOTE: ASCII (json.dumps's), labelled as json_response's
    return web.Response(
        body=data, status=status, headers=headers, content_type="application/json", charset="utf-8"
    )


def _refuse(e: Exception) -> web.Response:
    """A refusal in OpenAI's shape; a ValueError that is not an ApiError (a prompt the
    tokenizer cannot take) is the client's 400, or the status it names (429: overloaded)."""
    e = e if isinstance(e, ApiError) else ApiError(getattr(e, "status", 400), str(e))
    noisy.info("refused an HTTP request: %s", e.message)
    return web.json_response(e.body(), status=e.status)


@web.middleware
async def _openai_errors(request: web.Request, handler):
    """aiohttp's own refusals (no such route, wrong method, a body too large) in
    OpenAI's shape, as every other error; a fault of pdserve's own is a 500 in that
    shape too, logged with its traceback, and the server goes on."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = "the request body is too large" if e.status == 413 else e.reason
        return web.json_response(
            api.error_body(e.status, f"{message}: {request.method} {request.path}"), status=e.status
        )
    except asyncio.CancelledError:
        raise  # the client went away
    except ConnectionError:
        # NOTE: the client went away (mid-body, say): nothing to answer, and not aiohttp's
        # traceback and 500 for each (a log any client could fill): ended as a hang-up is
        noisy.info("an HTTP client went away during %s %s", request.method, request.path)
        raise asyncio.CancelledError from None
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return web.json_response(
            api.error_body(
                500, f"internal error on {request.method} {request.path}: see the frontend's log"
            ),
            status=500,
        )


async def serve(frontend, cfg) -> web.AppRunner | None:
    """Start the HTTP site (OpenAI API, /metrics, /health) or the metrics-only site
    the config asks for; None when neither."""
    port = cfg.http_port or cfg.metrics_port
    if not port:
        return None
    server = HttpServer(frontend, frontend.served_model)
    # handler_cancellation: a client that hangs up cancels its handler, which aborts the request.
    runner = web.AppRunner(
        server.app(is_metrics_only=not cfg.http_port),
        handler_cancellation=True,
        keepalive_timeout=http_site.IDLE_S,
        **access_log.runner_args(),
    )
    await runner.setup()
    num_fds = http_site.raise_fd_limit()
    site = http_site.CappedSite(runner, cfg.http_host, port, http_site.max_connections(num_fds))
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise LinkError(
            f"cannot serve HTTP on {cfg.http_host}:{port}: {e.strerror or e}: "
            f"choose another {'--http-port' if cfg.http_port else '--metrics-port'}"
        ) from None
    log.info(
        "%s at http://%s:%d (at most %d connections at once, idle ones closed after %.0fs)",
        "OpenAI API, /metrics and /health" if cfg.http_port else "/metrics and /health",
        cfg.http_host,
        port,
        site.max_connections,
        http_site.IDLE_S,
    )
    return runner
