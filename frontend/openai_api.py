"""The OpenAI API's request bodies: a call to the cluster, or an ApiError in OpenAI's
shape (the answers' shapes are openai_out.py).

Plain functions, no I/O: frontend/http.py serves them. A parameter pdserve does
not implement is refused with a 400 that names it, never ignored; a parameter
given at its no-op value (best_of 1, suffix "") is accepted.
"""
from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass

from common.wire.client import MAX_N, MAX_PROMPT_IDS
from common.wire.protocol import GenerateRequest, Structured
from frontend import openai_tools as tool_rules


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
                503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": status}}


# Parameters taken as no-ops at these values (what OpenAI's own defaults mean).
_NO_OP = {"best_of": (1,), "suffix": ("",), "functions": ([],), "store": (False,),
          "service_tier": ("auto", "default"), "skip_special_tokens": (True,), "echo": (False,),
          # vLLM's extras at their defaults
          "add_generation_prompt": (True,), "include_stop_str_in_output": (False,),
          "spaces_between_special_tokens": (True,), "add_special_tokens": (True,)}
# Parameters that describe the caller and do not change the answer.
_METADATA = ("user", "metadata")
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
           "stream_options", "top_k", "ignore_eos", "stop_token_ids", "return_token_ids",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
           "logit_bias", "allowed_token_ids", "bad_words", "logprobs", "prompt_logprobs", "n",
           "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
           "guided_grammar", "guided_whitespace_pattern"}
_FIELDS = {"completions": _COMMON | {"prompt", "echo"},
           "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                              "parallel_tool_calls", "chat_template_kwargs"}}
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Call:
    """One parsed call: the request for the cluster and how to answer it."""
    request: GenerateRequest
    is_chat: bool
    is_stream: bool
    is_usage_streamed: bool   # stream_options.include_usage
    is_token_ids: bool        # return_token_ids: each choice carries its token ids
    model: str
    is_echo: bool = False     # completions: the prompt comes first, in the text and the logprobs
    tool_mode: str = "none"   # none, auto, required or named (openai_tools.py)
    tool_name: str | None = None
    is_usage_continuous: bool = False   # stream_options.continuous_usage_stats: usage on every chunk


def _number(body: dict, name: str, default, low=None, high=None, integer=False):
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {value!r}",
                       name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"'{name}' must be in [{low}, {high}], got {value}", name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
        raise ApiError(400, "'stop' must be a string or a list of at most 16 strings", "stop")
    if "" in stop:
        raise ApiError(400, "a stop string must not be empty", "stop")
    return stop


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "each message needs a 'role' string and 'content'", "messages")
        content = m.get("content")
        if isinstance(content, list):   # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, "only text content parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        calls = m.get("tool_calls")
        if not (isinstance(content, str) or (content is None and calls)):
            raise ApiError(400, "message content must be a string or a list of text parts", "messages")
        message = {"role": m["role"], "content": content}
        if calls:   # an assistant's calls, as the template reads them: arguments as an object
            message["tool_calls"] = [_call_in(c) for c in (calls if isinstance(calls, list) else [None])]
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return out


def _call_in(call) -> dict:
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise ApiError(400, "a tool call is {\"function\": {\"name\": ..., \"arguments\": ...}}", "messages")
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ApiError(400, "a tool call's arguments must be JSON", "messages") from None
    return {"type": "function", "id": call.get("id", ""), "function": {"name": f["name"], "arguments": args}}


def _prompt(body: dict) -> dict:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # a batch of one
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPT_IDS:
        raise ApiError(400, f"'prompt' holds more than {MAX_PROMPT_IDS} token ids", "prompt")
    if isinstance(prompt, list) and prompt and \
            all(type(t) is int for t in prompt):
        return {"prompt_token_ids": prompt}   # its length against the model's is checked next
    if isinstance(prompt, list):
        raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of those "
                            "(a batch)", "prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids", "prompt")


MAX_BATCH = 256   # prompts in one completions call


def split_batch(body) -> list[dict] | None:
    """A completions body whose prompt is a batch (a list of texts, or of lists of token
    ids) as one body per prompt; None where it holds one prompt."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, list) or len(prompt) < 2 or not all(isinstance(p, (str, list)) for p in prompt):
        return None
    if len(prompt) > MAX_BATCH:
        raise ApiError(400, f"'prompt' holds more than {MAX_BATCH} prompts", "prompt")
    if body.get("stream"):
        raise ApiError(400, "a batch of prompts is answered whole: send it without stream, or each "
                            "prompt in a request of its own", "prompt")
    return [{**body, "prompt": p} for p in prompt]


def parse(body, kind: str, served_model: str, default_max_tokens: int | None,
          whitespace: str = "compact") -> Call:
    """body: the decoded JSON of /v1/completions (kind "completions") or
    /v1/chat/completions ("chat"). whitespace: the JSON grammars' (compact or any).
    Raises ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name in _FIELDS[kind] or name in _METADATA:
            continue
        if name in _NO_OP and (value is None or value in _NO_OP[name]):
            continue
        if name not in _NO_OP and value is None:
            continue
        allowed = " or ".join(json.dumps(v) for v in _NO_OP.get(name, ()))
        raise ApiError(400, f"'{name}' is not supported by pdserve" +
                       (f" (only {name}={allowed}, which changes nothing)" if allowed else ""), name)
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{served_model}'",
                       "model")
    is_chat = kind == "chat"
    is_echo = body.get("echo", False)
    if not isinstance(is_echo, bool):
        raise ApiError(400, "'echo' must be a boolean", "echo")
    max_tokens = _number(body, "max_tokens", None, 0 if is_echo else 1, 2**31 - 1, integer=True)
    if is_chat:
        max_tokens = _number(body, "max_completion_tokens", max_tokens, 1, 2**31 - 1, integer=True)
    if max_tokens is None:
        max_tokens = default_max_tokens
    stream = body.get("stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not stream or not isinstance(options, dict) or \
                set(options) - {"include_usage", "continuous_usage_stats"} or \
                not all(isinstance(v, bool) for v in options.values()):
            raise ApiError(400, "'stream_options' takes only include_usage and continuous_usage_stats "
                           "(true or false), and only with stream", "stream_options")
    flags = {k: body.get(k, False) for k in ("stream", "ignore_eos", "return_token_ids")}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise ApiError(400, f"'{k}' must be a boolean", k)
    stop_token_ids = _ids(body, "stop_token_ids")
    logprobs = _logprobs(body, is_chat)
    prompt_logprobs = _number(body, "prompt_logprobs", None, 0, MAX_LOGPROBS, integer=True)
    if is_echo and logprobs is not None:
        prompt_logprobs = logprobs if prompt_logprobs is None else prompt_logprobs   # the prompt's, as vLLM
    if max_tokens == 0 and prompt_logprobs is None:
        raise ApiError(400, "'max_tokens' 0 returns the prompt alone: it needs 'echo' and 'logprobs'", "max_tokens")
    source = {"messages": _messages(body)} if is_chat else _prompt(body)
    tool_mode, tool_name, structured = "none", None, _structured(body, whitespace)
    if is_chat:
        try:
            tools = tool_rules.check_tools(body["tools"]) if body.get("tools") else None
            tool_mode, tool_name = tool_rules.choice_mode(tools, body.get("tool_choice"))
        except tool_rules.ToolError as e:
            raise ApiError(400, str(e), "tools") from None
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ApiError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
        is_parallel = body.get("parallel_tool_calls", True)
        if not isinstance(is_parallel, bool):
            raise ApiError(400, "'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
        forced = tool_rules.grammar_for(tools, tool_mode, tool_name, is_parallel) if tools else None
        if forced is not None:
            if structured is not None:
                raise ApiError(400, "a required or named tool_choice takes no response_format", "tool_choice")
            structured = Structured("json_schema", forced, whitespace)
        source.update(tools=json.dumps(tools) if tools else None, chat_template_kwargs=kwargs)
    request = GenerateRequest(
        request_id=f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}", **source,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_number(body, "top_k", -1, -1, 2**31 - 1, integer=True),
        seed=_number(body, "seed", None, 0, 2**63 - 1, integer=True),
        stop=_stop(body), stop_token_ids=stop_token_ids, ignore_eos=flags["ignore_eos"],
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.001, 100.0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        min_tokens=_number(body, "min_tokens", 0, 0, 2**31 - 1, integer=True),
        logit_bias=_logit_bias(body), allowed_token_ids=_ids(body, "allowed_token_ids") or None,
        bad_words=_strings(body, "bad_words"), n=_number(body, "n", 1, 1, MAX_N, integer=True),
        structured=structured)
    options = options or {}
    return Call(request, is_chat, flags["stream"], options.get("include_usage", False),
                flags["return_token_ids"], served_model, is_echo, tool_mode, tool_name,
                options.get("include_usage", False) and options.get("continuous_usage_stats", False))


def _structured(body: dict, whitespace: str) -> Structured | None:
    """OpenAI's response_format, vLLM's structured_outputs and its older guided_* names,
    at most one of them."""
    given = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise ApiError(400, "'response_format' type must be text, json_object or json_schema", "response_format")
        if fmt["type"] == "json_object":
            given.append(("json_object", ""))
        elif fmt["type"] == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
            if not isinstance(schema, dict):
                raise ApiError(400, "'response_format' json_schema needs json_schema.schema, an object",
                               "response_format")
            given.append(("json_schema", json.dumps(schema)))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError(400, "'structured_outputs' must be an object", "structured_outputs")
        for name, kind in (("json", "json_schema"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar"),
                           ("json_object", "json_object")):
            if so.get(name) not in (None, False):
                given.append((kind, so[name]))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if body.get(name) is not None:
            given.append((kind, body[name]))
    if len(given) > 1:
        raise ApiError(400, "give one structured output (response_format, structured_outputs or guided_*)",
                       "response_format")
    if not given:
        return None
    kind, spec = given[0]
    if kind == "json_object":
        spec = ""
    elif kind in ("json_schema", "choice") and not isinstance(spec, str):
        spec = json.dumps(spec)
    if not isinstance(spec, str) or len(spec) > 2**16:
        raise ApiError(400, f"the {kind} must be text of at most 65536 characters", "response_format")
    if body.get("guided_whitespace_pattern") is not None:
        whitespace = "any"
    return Structured(kind, spec, whitespace)


def _logprobs(body: dict, is_chat: bool) -> int | None:
    """Completions: logprobs N (alternatives per token). Chat: logprobs true, top_logprobs N."""
    value = body.get("logprobs")
    if not is_chat:
        return _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, "'logprobs' must be a boolean (the number of alternatives is 'top_logprobs')",
                       "logprobs")
    top = _number(body, "top_logprobs", None, 0, MAX_LOGPROBS, integer=True)
    if top is not None and not value:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if value else None


def _ids(body: dict, name: str) -> list[int]:
    ids = body.get(name) or []
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ApiError(400, f"'{name}' must be a list of integers", name)
    return ids


def _strings(body: dict, name: str) -> list[str]:
    values = body.get(name) or []
    if isinstance(values, str):
        values = [values]
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ApiError(400, f"'{name}' must be a string or a list of strings", name)
    return values


def _logit_bias(body: dict) -> dict | None:
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict) or len(bias) > 1024:
        raise ApiError(400, "'logit_bias' must be a map of at most 1024 token ids to biases", "logit_bias")
    return bias


# ---- /tokenize and /detokenize (vLLM's shapes) -------------------------------------

def _check_model(body, served_model: str, fields: set[str]) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(k for k in set(body) - fields - {"model"}
                     if not (k in _NO_OP and body[k] in _NO_OP[k]))
    if unknown:
        raise ApiError(400, f"'{unknown[0]}' is not supported here", unknown[0])
    if body.get("model") is not None and body["model"] != served_model:
        raise ApiError(404, f"the model '{body['model']}' does not exist; this server serves '{served_model}'",
                       "model")


def parse_tokenize(body, served_model: str) -> GenerateRequest:
    """/tokenize: {"prompt": text} or {"messages": [...], "tools"?, "chat_template_kwargs"?}
    as a request whose prompt the frontend tokenizes (its generation prompt added)."""
    _check_model(body, served_model, {"prompt", "messages", "tools", "chat_template_kwargs"})
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "give one of 'prompt' or 'messages'")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise ApiError(400, "'prompt' must be a string", "prompt")
        return GenerateRequest(request_id="tokenize", prompt=body["prompt"])
    try:
        tools = tool_rules.check_tools(body["tools"]) if body.get("tools") else None
    except tool_rules.ToolError as e:
        raise ApiError(400, str(e), "tools") from None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return GenerateRequest(request_id="tokenize", messages=_messages(body),
                           tools=json.dumps(tools) if tools else None, chat_template_kwargs=kwargs)


def parse_detokenize(body, served_model: str, vocab_size: int, max_len: int) -> list[int]:
    """/detokenize: {"tokens": [id, ...]}, each id in the vocabulary, at most max_len."""
    _check_model(body, served_model, {"tokens"})
    ids = body.get("tokens")
    if not isinstance(ids, list) or len(ids) > max_len or \
            not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise ApiError(400, f"'tokens' must be a list of at most {max_len} token ids in [0, {vocab_size})",
                       "tokens")
    return ids
