"""What an HTTP client can do to the frontend short of a request: hold connections open and
idle, send a body that never ends, nest JSON past the parser's stack, send text the
tokenizer cannot take. Each is a clear answer for that client, never a 500 or a frontend
whose descriptors are all used up."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import ClientSession, web

from common.wire.client import GenerateRequest
from frontend import http, http_site, openai_tools, prompts
from frontend.openai_api import ApiError

DEEP = "[" * 100_000 + "]" * 100_000  # past json's recursion limit


async def _eof_within(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """What the server sent before it closed the connection (fails past timeout_s)."""
    return await asyncio.wait_for(reader.read(), timeout_s)


def test_connections_past_the_cap_are_refused_and_idle_ones_are_closed():
    """aiohttp's default kept a connection that sends nothing for an hour: 20,000 idle
    sockets from one host used up the frontend's descriptors, and every new client, HTTP or
    ZeroMQ, failed. Now the site holds at most its cap (503 past it), and closes idle ones."""

    async def run():
        async def health(request):
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, keepalive_timeout=0.5)
        await runner.setup()
        site = http_site.CappedSite(runner, "127.0.0.1", 0, max_connections=3)
        await site.start()
        try:
            idle = [await asyncio.open_connection("127.0.0.1", site.port) for _ in range(3)]
            await asyncio.sleep(0)  # NOTE: counted once made: let the loop take them
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
            refused = await _eof_within(reader, 5)
            writer.close()
            assert refused.startswith(b"HTTP/1.1 503") and b"too many HTTP connections" in refused
            assert site.num_refused == 1
            # The idle ones are closed without a word, and their places are free again
            for reader, writer in idle:
                assert await _eof_within(reader, 10) == b""
                writer.close()
            async with ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{site.port}/health") as r:
                    assert r.status == 200 and await r.text() == "ok"
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_the_cap_is_a_share_of_a_raised_open_files_limit():
    import resource

    limit = http_site.raise_fd_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert limit == soft and (soft == hard or soft == http_site.MAX_FDS)
    assert http_site.max_connections(limit) == limit // http_site.FD_SHARE
    assert http_site.max_connections(10) == 16


class _Body:
    """A request whose body is given by json()."""

    def __init__(self, json_fn):
        self.json = json_fn


def test_a_body_too_deep_or_that_never_ends_is_the_clients_error(monkeypatch):
    async def deep():
        return json.loads(DEEP)

    async def never():
        await asyncio.Event().wait()

    with pytest.raises(ApiError) as e:
        asyncio.run(http._json(_Body(deep)))
    assert (e.value.status, e.value.message) == (400, "the request body is nested too deeply")
    monkeypatch.setattr(http, "BODY_S", 0.05)
    with pytest.raises(ApiError) as e:
        asyncio.run(http._json(_Body(never)))
    assert e.value.status == 408 and "did not arrive" in e.value.message


def test_tools_too_deep_and_text_the_tokenizer_cannot_take_are_refused(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="tools is nested too deeply"):
        prompts.prompt_ids(tok, GenerateRequest(request_id="r", messages=user, tools=DEEP))
    with pytest.raises(ValueError, match="cannot be tokenized"):
        prompts.prompt_ids(tok, GenerateRequest(request_id="r", prompt="a\ud800b"))
    long = [{"role": "user", "content": "a" * prompts.OFF_LOOP_CHARS + "\ud800"}]
    with pytest.raises(ValueError, match="cannot be tokenized"):
        prompts.prompt_ids(tok, GenerateRequest(request_id="r", messages=long))
    with pytest.raises(ValueError, match="a bad word cannot be tokenized"):
        prompts._bad_words(tok, ["a\ud800"])


def test_a_chat_templates_variables_beside_a_prompt_are_refused_not_ignored(tiny_model):
    """Hunt: on the ZeroMQ port, tools (even "not json") and chat_template_kwargs beside a
    text prompt or token ids were dropped without a word: the client believed the model
    saw its tools. They are the chat template's, and only a chat has one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    for given in ({"prompt": "hi"}, {"prompt_token_ids": [1, 2]}):
        assert prompts.prompt_ids(tok, GenerateRequest(request_id="r", **given))
        for extra in ({"tools": "not json"}, {"chat_template_kwargs": {"enable_thinking": 0}}):
            with pytest.raises(ValueError, match="the chat template's: give messages"):
                prompts.prompt_ids(tok, GenerateRequest(request_id="r", **given, **extra))


def test_a_tool_call_the_model_nests_past_the_stack_is_text_not_an_error():
    split = openai_tools.Split("auto", None, False)
    out = split.feed("<tool_call>" + DEEP + "</tool_call>", is_final=True)
    assert "tool_calls" not in out and out["content"].startswith("<tool_call>[[[")
    required = openai_tools.Split("required", None, False)
    assert required.feed("[" + DEEP, is_final=True) == {}


def test_a_client_that_hangs_up_mid_body_fills_no_log(caplog):
    """Hunt: each client that sent half a body and hung up cost an unthrottled traceback
    at ERROR ("Error handling request") and a 500 in the access log: 2.3 KB of log a
    hang-up, any client's to fill. A hang-up is ended as one, quietly."""
    import logging

    async def run():
        async def echo(request):
            return web.json_response(await http._json(request))

        app = web.Application(middlewares=[http._openai_errors])
        app.router.add_post("/v1/completions", echo)
        runner = web.AppRunner(app)
        await runner.setup()
        site = http_site.CappedSite(runner, "127.0.0.1", 0, max_connections=64)
        await site.start()
        try:
            for _ in range(5):
                _, writer = await asyncio.open_connection("127.0.0.1", site.port)
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    b'\r\nContent-Length: 1000\r\n\r\n{"prompt": "hal'
                )
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.close()
            await asyncio.sleep(0.3)
            async with ClientSession() as s:  # and the server goes on
                async with s.post(f"http://127.0.0.1:{site.port}/v1/completions", json=[1]) as r:
                    assert r.status == 200 and await r.json() == [1]
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(run())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert any("went away" in r.getMessage() for r in caplog.records)


def test_logit_bias_keys_are_ascii_ids_each_named_once():
    """Hunt: " 1", "1" and "01" named one token three times, each with its own bias, and
    the request said nothing of which held; int() took other scripts' digits as ids."""
    assert prompts._logit_bias({" 7": 2, "11": -100.0}) == {
        "logit_bias_ids": (7, 11),
        "logit_bias": (2.0, -100.0),
    }
    with pytest.raises(ValueError, match="names token 1 twice"):
        prompts._logit_bias({" 1": 1, "01": 2})
    for key in ("١٢", "²", "1.5", "", "-"):
        with pytest.raises(ValueError, match="keys are token ids"):
            prompts._logit_bias({key: 1})
