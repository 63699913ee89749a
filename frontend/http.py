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

from common.base.log import Throttle, get_logger
from common.wire.channel import LinkError
from common.wire.protocol import ErrorReply, GenerateOutput
from frontend import access_log, openapi, server_timing
from frontend import openai_api as api
from frontend import openai_logprobs as lp_shapes
from frontend import openai_out as shapes
from frontend import openai_tools as tool_rules
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


class Answer:
    """One choice of a call as its outputs arrive: the text (after the prompt's, with
    echo), the token ids, the logprobs in the call's shape when asked for, and a chat
    answer's content, reasoning and tool calls where they are split out of its text."""

    def __init__(
        self,
        call: api.Call,
        strings: lp_shapes.TokenStrings,
        prompt_text: str,
        is_reasoning: bool = False,
        prompt_parts: dict | None = None,
    ):
        """prompt_parts: shared by a call's choices, the prompt's logprobs in the call's
        shape, made once (every choice's are the same: n copies cost n shapes otherwise)."""
        self.call, self.strings = call, strings
        self.prompt_parts = {} if prompt_parts is None else prompt_parts
        self.text = [prompt_text] if prompt_text else []
        self.unsent = prompt_text  # echo: streamed with the first text
        self.offset = 0  # the next token's text_offset (completions logprobs)
        self.token_ids: list[int] = []
        self.is_logprobs = call.request.logprobs is not None
        self.logprobs: dict | None = None
        self.split = (
            tool_rules.Split(call.tool_mode, call.tool_name, is_reasoning)
            if call.is_chat and (call.tool_mode != "none" or is_reasoning)
            else None
        )
        self.parts = {"content": "", "reasoning_content": "", "tool_calls": []}

    def _completion(self, token_ids: list[int], logprobs: list) -> dict:
        part = lp_shapes.completion(self.strings, token_ids, logprobs, self.offset)
        if part["tokens"]:
            self.offset = part["text_offset"][-1] + len(part["tokens"][-1])
        return part

    def add(self, msg) -> tuple[str, dict | None, dict | None]:
        """(the text to stream now, the new tokens' logprobs in the call's shape or None,
        the split parts of a chat answer to stream now or None)."""
        text, self.unsent = self.unsent + msg.text, ""
        part = None
        if self.is_logprobs and self.call.is_echo and msg.prompt_token_ids is not None:
            # NOTE: keyed by the list's identity: the choices of one request share the one list
            key = id(msg.prompt_logprobs)
            part = self.prompt_parts.get(key)
            if part is None:
                part = self.prompt_parts[key] = self._completion(
                    list(msg.prompt_token_ids), [None, *(msg.prompt_logprobs or [])]
                )
            elif part["tokens"]:
                self.offset = part["text_offset"][-1] + len(part["tokens"][-1])
        if self.is_logprobs and msg.logprobs is not None:
            part = (
                lp_shapes.chat(self.strings, msg.token_ids, msg.logprobs)
                if self.call.is_chat
                else lp_shapes.merge(part, self._completion(msg.token_ids, msg.logprobs))
            )
        if part is not None:  # extended in place, never rebuilt: linear in the answer's length
            self.logprobs = lp_shapes.extend(self.logprobs, part)
        self.text.append(msg.text)
        self.token_ids += msg.token_ids
        parts = None
        if self.split is not None:
            parts = self.split.feed(msg.text, is_final=msg.is_finished)
            for k, v in parts.items():
                self.parts[k] += v
            if parts.get(
                "tool_calls"
            ):  # a streamed call carries its place among the answer's calls
                first = len(self.parts["tool_calls"]) - len(parts["tool_calls"])
                parts = {
                    **parts,
                    "tool_calls": [
                        {"index": first + i, **c} for i, c in enumerate(parts["tool_calls"])
                    ],
                }
        return text, part, parts

    def finish_reason(self, reason: str) -> str:
        return shapes.finish_reason(reason, bool(self.split and self.parts["tool_calls"]))

    def choice(self, reason: str) -> tuple:
        """This choice in a whole response (out_shape.response's tuple)."""
        return (
            "".join(self.text),
            self.token_ids,
            self.finish_reason(reason),
            self.logprobs,
            self.parts if self.split is not None else None,
        )


class HttpServer:
    def __init__(self, frontend, served_model: str):
        self.frontend = frontend
        self.served_model = served_model
        self.strings = lp_shapes.TokenStrings(frontend.tokenizer)
        self.is_reasoning = bool(frontend.cfg.reasoning_parser)
        self.streams: dict[str, asyncio.Queue] = {}  # request id -> (message, status) queue
        self.openapi_doc = openapi.openapi(
            served_model, frontend.spec.vocab_size, frontend.max_model_len
        )
        frontend.local_sink = self._deliver

    def _deliver(self, client, msg, status: int | None) -> None:
        rid = getattr(msg, "request_id", None)
        queue = self.streams.get(rid)
        if queue is not None:
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
        is_ready = self.frontend.is_ready()
        return web.json_response(
            {"status": "ok" if is_ready else "unavailable"}, status=200 if is_ready else 503
        )

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
        return web.json_response(
            {"count": len(ids), "max_model_len": fe.max_model_len, "tokens": ids}
        )

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
        except ApiError as e:
            return _refuse(e)
        answers = await self._serve(request, calls)
        if len(calls) == 1:
            out = answers[0]
            if isinstance(out, web.StreamResponse):
                return out
            return web.json_response(out[1], status=out[0], headers=server_timing.headers(out[2]))
        # A batch of prompts (what evaluation harnesses send): each its own call, admitted
        # together and answered together; choice i of prompt k is at index k * n + i, as vLLM's.
        failed = next(((s, out) for s, out, _ in answers if s != 200), None)
        if failed is not None:
            return web.json_response(failed[1], status=failed[0])
        n, outs = calls[0].request.n, [out for _, out, _ in answers]
        choices = [
            {**c, "index": k * n + c["index"]} for k, out in enumerate(outs) for c in out["choices"]
        ]
        use = shapes.usage(
            sum(o["usage"]["prompt_tokens"] for o in outs),
            sum(o["usage"]["completion_tokens"] for o in outs),
            sum(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs),
        )
        return web.json_response({**outs[0], "choices": choices, "usage": use})

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
            states = self.frontend.by_client.get((client, rid))  # none: it ended already
            num_prompt = (
                len(states[0].prompt_ids) if states else (msg.usage or {}).get("prompt_tokens", 0)
            )
            out = await self._stream(request, call, msg, queues[rid], num_prompt)
        else:
            (code, body), timings = await self._whole(call, msg, queues[rid])
            out = (code, body, timings)
        done.add(rid)
        return out

    async def _whole(self, call: api.Call, msg, queue: asyncio.Queue) -> tuple[tuple, dict | None]:
        """((status, body), the first choice's timings: its Server-Timing)."""
        n = call.request.n
        shared: dict = {}
        answers = [
            Answer(call, self.strings, self._prompt_text(call), self.is_reasoning, shared)
            for _ in range(n)
        ]
        finals: dict[int, object] = {}
        status = None
        while True:
            answers[max(msg.index, 0)].add(msg)
            if msg.is_finished:
                if msg.finish_reason not in ("stop", "length"):
                    status = status or 500
                    error = api.error_body(status, msg.error or msg.finish_reason)
                    return (status, error), msg.timings
                finals[msg.index] = msg
                if len(finals) == n:
                    break
            msg, status = await queue.get()
        choices = [a.choice(finals[i].finish_reason) for i, a in enumerate(answers)]
        body = shapes.response(call, shapes.now(), choices, _usage(finals.values()))
        return (200, body), finals[0].timings

    def _prompt_text(self, call: api.Call) -> str:
        """What echo puts first: the prompt as given, or its ids' text."""
        r = call.request
        if not call.is_echo:
            return ""
        return (
            r.prompt if r.prompt is not None else self.frontend.tokenizer.decode(r.prompt_token_ids)
        )

    async def _stream(
        self, request: web.Request, call: api.Call, msg, queue: asyncio.Queue, num_prompt: int
    ) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", **HEADERS})
        await out.prepare(request)
        created, n = shapes.now(), call.request.n
        events_of = [shapes.text_events(call, created, i) for i in range(n)]
        shared: dict = {}
        answers = [
            Answer(call, self.strings, self._prompt_text(call), self.is_reasoning, shared)
            for _ in range(n)
        ]
        # Events not yet written. Everything already queued goes out in one write: a
        # socket write per event is most of a stream's cost, and a client that lags
        # a step behind gets its backlog at once.
        events = (
            [
                shapes.stream_event(shapes.chunk(call, created, is_role=True, index=i))
                for i in range(n)
            ]
            if call.is_chat
            else []
        )
        status, finals = None, {}

        def event(timings: dict | None = None, **kw) -> bytes:  # a chunk of its own, no template
            c = shapes.chunk(call, created, **kw)
            if call.is_usage_continuous:  # the usage so far on every chunk
                c["usage"] = shapes.usage(num_prompt, sum(len(a.token_ids) for a in answers))
            if timings is not None:  # the last chunk: where the time went (server_timing.py)
                c["timings"] = server_timing.with_decode(timings)
            return shapes.stream_event(c)

        while True:
            i = max(msg.index, 0)
            text, logprobs, parts = answers[i].add(msg)
            if parts is not None:  # a chat answer split into content, reasoning and tool calls
                if parts or logprobs is not None:
                    events.append(
                        event(
                            text=text,
                            token_ids=msg.token_ids,
                            logprobs=logprobs,
                            index=i,
                            parts=parts,
                        )
                    )
            elif logprobs is not None or (call.is_usage_continuous and (text or msg.token_ids)):
                events.append(event(text=text, token_ids=msg.token_ids, logprobs=logprobs, index=i))
            elif text or (call.is_token_ids and msg.token_ids):  # held-back text waits
                events.append(events_of[i](text, msg.token_ids))
            if msg.is_finished:
                if msg.finish_reason not in ("stop", "length"):
                    # the status line is sent: the error goes in the stream, as OpenAI's servers do
                    events.append(
                        shapes.stream_event(
                            api.error_body(status or 500, msg.error or msg.finish_reason)
                        )
                    )
                    break
                finals[msg.index] = msg
                is_last = len(finals) == n and not call.is_usage_streamed  # else: the usage chunk
                last = (msg.timings or {}) if is_last else None
                reason = answers[i].finish_reason(msg.finish_reason)
                events.append(event(finish_reason=reason, index=i, timings=last))
                if len(finals) == n:
                    if call.is_usage_streamed:
                        # pdserve's TTFT parts ride along on the usage chunk (an extra key).
                        use = shapes.chunk(call, created, use=_usage(finals.values()))
                        timings = server_timing.with_decode(msg.timings)
                        events.append(shapes.stream_event({**use, "timings": timings}))
                    break
            if queue.empty():
                if events:
                    await out.write(b"".join(events))
                    events.clear()
                msg, status = await queue.get()
            else:
                msg, status = queue.get_nowait()
        events.append(b"data: [DONE]\n\n")
        await out.write_eof(b"".join(events))
        return out


def _client(request: web.Request) -> tuple[str, str]:
    """An HTTP client, as the frontend keys it: per-client limits hold per host."""
    return ("http", request.remote or "?")


async def _json(request: web.Request):
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None


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
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client went away
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return web.json_response(
            api.error_body(
                500, f"internal error on {request.method} {request.path}: see the frontend's log"
            ),
            status=500,
        )


def _usage(finals) -> dict:
    """One usage over a call's choices: the prompt once, every choice's completion."""
    finals = [f for f in finals if f.usage]
    prompt = finals[0].usage["prompt_tokens"] if finals else 0
    cached = finals[0].usage.get("cached_tokens", 0) if finals else 0
    return shapes.usage(prompt, sum(f.usage["completion_tokens"] for f in finals), cached)


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
        **access_log.runner_args(),
    )
    await runner.setup()
    site = web.TCPSite(runner, cfg.http_host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise LinkError(
            f"cannot serve HTTP on {cfg.http_host}:{port}: {e.strerror or e}: "
            f"choose another {'--http-port' if cfg.http_port else '--metrics-port'}"
        ) from None
    log.info(
        "%s at http://%s:%d",
        "OpenAI API, /metrics and /health" if cfg.http_port else "/metrics and /health",
        cfg.http_host,
        port,
    )
    return runner
