"""The OpenAI API's request bodies: calls to the cluster, or an ApiError in OpenAI's
shape (the answers' shapes are openai_out.py).

Plain functions, no I/O: frontend/http.py serves them. Each body is first held to its
model (openai_models.py: every field's type and bounds, in one place; openai_validate.py
names a body's first fault); what is left here is what one field says of another
(top_logprobs needs logprobs, a batch is not streamed) and the making of the requests. A
parameter pdserve does not implement is refused with a 400 that names it, never ignored; a
parameter given at its no-op value (best_of 1, suffix "") is accepted.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from common.wire.protocol import GenerateRequest, Structured
from frontend import openai_models as models
from frontend import openai_tools as tool_rules
from frontend.openai_errors import ApiError, error_body
from frontend.openai_validate import validate

__all__ = [
    "ApiError",
    "Call",
    "error_body",
    "parse",
    "parse_calls",
    "parse_detokenize",
    "parse_tokenize",
]


@dataclass(frozen=True)
class Call:
    """One parsed call: the request for the cluster and how to answer it."""

    request: GenerateRequest
    is_chat: bool
    is_stream: bool
    is_usage_streamed: bool  # stream_options.include_usage
    is_token_ids: bool  # return_token_ids: each choice carries its token ids
    model: str
    is_echo: bool = False  # completions: the prompt comes first, in the text and the logprobs
    tool_mode: str = "none"  # none, auto, required or named (openai_tools.py)
    tool_name: str | None = None
    is_usage_continuous: bool = False  # stream_options.continuous_usage_stats: on every chunk


def parse(
    body, kind: str, served_model: str, default_max_tokens: int | None, whitespace: str = "compact"
) -> Call:
    """A body of one prompt (parse_calls' first call)."""
    return parse_calls(body, kind, served_model, default_max_tokens, whitespace)[0]


def parse_calls(
    body, kind: str, served_model: str, default_max_tokens: int | None, whitespace: str = "compact"
) -> list[Call]:
    """body: the decoded JSON of /v1/completions (kind "completions") or
    /v1/chat/completions ("chat"); a call per prompt (a completions batch has several,
    each with the body's other fields). whitespace: the JSON grammars' (compact or any).
    Raises ApiError."""
    is_chat = kind == "chat"
    m = validate(models.ChatBody if is_chat else models.CompletionBody, body)
    _check_model(m, served_model)
    is_echo = bool(not is_chat and m.echo)
    max_tokens = m.max_completion_tokens if is_chat and m.max_completion_tokens else m.max_tokens
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    is_stream = bool(m.stream)
    if m.stream_options is not None and not is_stream:
        raise ApiError(
            400,
            "'stream_options' takes only include_usage and continuous_usage_stats "
            "(true or false), and only with stream",
            "stream_options",
        )
    logprobs = _logprobs(m, is_chat)
    prompt_logprobs = m.prompt_logprobs
    if is_echo and logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = logprobs  # the prompt's, as vLLM
    if max_tokens == 0 and prompt_logprobs is None:
        raise ApiError(
            400,
            "'max_tokens' 0 returns the prompt alone: it needs 'echo' and 'logprobs'",
            "max_tokens",
        )
    stop = [m.stop] if isinstance(m.stop, str) else list(m.stop or ())
    tool_mode, tool_name, structured = "none", None, _structured(m, whitespace)
    if is_chat:
        tools = body.get("tools") or None  # as given (held to the model): the template reads it
        try:
            tool_mode, tool_name = tool_rules.choice_mode(tools, body.get("tool_choice"))
        except tool_rules.ToolError as e:
            raise ApiError(400, str(e), "tools") from None
        is_parallel = m.parallel_tool_calls is not False
        forced = tool_rules.grammar_for(tools, tool_mode, tool_name, is_parallel) if tools else None
        if forced is not None:
            if structured is not None:
                raise ApiError(
                    400, "a required or named tool_choice takes no response_format", "tool_choice"
                )
            structured = Structured("json_schema", forced, whitespace)
        sources = [
            {
                "messages": [_message(x) for x in m.messages],
                "tools": json.dumps(tools) if tools else None,
                "chat_template_kwargs": m.chat_template_kwargs,
            }
        ]
    else:
        sources = _prompts(m.prompt)
        if len(sources) > 1 and is_stream:
            raise ApiError(
                400,
                "a batch of prompts is answered whole: send it without stream, "
                "or each prompt in a request of its own",
                "prompt",
            )
    options = m.stream_options or models.StreamOptions()
    is_usage = bool(options.include_usage)
    return [
        Call(
            GenerateRequest(
                request_id=f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}",
                **source,
                max_tokens=max_tokens,
                temperature=_or(m.temperature, 1.0),
                top_p=_or(m.top_p, 1.0),
                top_k=_or(m.top_k, -1),
                seed=m.seed,
                stop=list(stop),
                stop_token_ids=list(m.stop_token_ids or ()),
                ignore_eos=bool(m.ignore_eos),
                speculative=_or(m.speculative, True),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                presence_penalty=_or(m.presence_penalty, 0.0),
                frequency_penalty=_or(m.frequency_penalty, 0.0),
                repetition_penalty=_or(m.repetition_penalty, 1.0),
                min_p=_or(m.min_p, 0.0),
                min_tokens=_or(m.min_tokens, 0),
                logit_bias=m.logit_bias,
                allowed_token_ids=m.allowed_token_ids or None,
                bad_words=[m.bad_words]
                if isinstance(m.bad_words, str)
                else list(m.bad_words or ()),
                n=_or(m.n, 1),
                structured=structured,
            ),
            is_chat,
            is_stream,
            is_usage,
            bool(m.return_token_ids),
            served_model,
            is_echo,
            tool_mode,
            tool_name,
            is_usage and bool(options.continuous_usage_stats),
        )
        for source in sources
    ]


def _or(value, default):
    return default if value is None else value


def _check_model(m, served_model: str) -> None:
    if m.model is not None and m.model != served_model:
        raise ApiError(
            404,
            f"the model '{m.model}' does not exist; this server serves '{served_model}'",
            "model",
        )


def _prompts(prompt) -> list[dict]:
    """A prompt (text, or token ids), or a batch of them (a list of those): each as a
    request's source. A batch of one is its prompt."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if all(isinstance(t, int) for t in prompt):
        return [{"prompt_token_ids": prompt}]  # its length against the model's is checked next
    return [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


def _message(m: models.Message) -> dict:
    """A message as the chat template reads it: text parts joined, a tool call's arguments
    as an object."""
    content = m.content if not isinstance(m.content, list) else "".join(p.text for p in m.content)
    out = {"role": m.role, "content": content}
    if m.tool_calls:
        out["tool_calls"] = [_call_in(c) for c in m.tool_calls]
    for key in ("tool_call_id", "name"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def _call_in(call: models.ToolCall) -> dict:
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):  # NOTE: deep nesting is C's recursion
            raise ApiError(400, "a tool call's arguments must be JSON", "messages") from None
    return {
        "type": "function",
        "id": call.id,
        "function": {"name": call.function.name, "arguments": args},
    }


def _structured(m, whitespace: str) -> Structured | None:
    """OpenAI's response_format, vLLM's structured_outputs and its older guided_* names,
    at most one of them."""
    given = []
    fmt = m.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("json_object", ""))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        if schema is None:
            raise ApiError(
                400,
                "'response_format' json_schema needs json_schema.schema, an object",
                "response_format",
            )
        given.append(("json_schema", json.dumps(schema)))
    so = m.structured_outputs
    if so is not None:
        for name, kind in (
            ("json_", "json_schema"),
            ("regex", "regex"),
            ("choice", "choice"),
            ("grammar", "grammar"),
            ("json_object", "json_object"),
        ):
            if getattr(so, name) not in (None, False):
                given.append((kind, getattr(so, name)))
    for name, kind in (
        ("guided_json", "json_schema"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if getattr(m, name) is not None:
            given.append((kind, getattr(m, name)))
    if len(given) > 1:
        raise ApiError(
            400,
            "give one structured output (response_format, structured_outputs or guided_*)",
            "response_format",
        )
    if not given:
        return None
    kind, spec = given[0]
    if kind == "json_object":
        spec = ""
    elif not isinstance(spec, str):  # a schema or a list of choices, as JSON text
        spec = json.dumps(spec)
    if len(spec) > models.MAX_SPEC_CHARS:
        raise ApiError(
            400,
            f"the {kind} must be text of at most {models.MAX_SPEC_CHARS} characters",
            "response_format",
        )
    return Structured(kind, spec, "any" if m.guided_whitespace_pattern is not None else whitespace)


def _logprobs(m, is_chat: bool) -> int | None:
    """Completions: logprobs N (alternatives per token). Chat: logprobs true, top_logprobs N."""
    if not is_chat:
        return m.logprobs
    if m.top_logprobs is not None and not m.logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (m.top_logprobs or 0) if m.logprobs else None


# ---- /tokenize and /detokenize (vLLM's shapes) -------------------------------------


def parse_tokenize(body, served_model: str) -> GenerateRequest:
    """/tokenize: {"prompt": text} or {"messages": [...], "tools"?, "chat_template_kwargs"?}
    as a request whose prompt the frontend tokenizes (its generation prompt added)."""
    m = validate(models.TokenizeBody, body)
    _check_model(m, served_model)
    if (m.prompt is None) == (m.messages is None):
        raise ApiError(400, "give one of 'prompt' or 'messages'")
    if m.prompt is not None:
        return GenerateRequest(request_id="tokenize", prompt=m.prompt)
    tools = body.get("tools") or None
    return GenerateRequest(
        request_id="tokenize",
        messages=[_message(x) for x in m.messages],
        tools=json.dumps(tools) if tools else None,
        chat_template_kwargs=m.chat_template_kwargs,
    )


def parse_detokenize(body, served_model: str, vocab_size: int, max_len: int) -> list[int]:
    """/detokenize: {"tokens": [id, ...]}, each id in the vocabulary, at most max_len."""
    why = f"'tokens' must be a list of at most {max_len} token ids in [0, {vocab_size})"
    try:
        m = validate(models.DetokenizeBody, body)
    except ApiError as e:
        if e.param == "tokens":
            raise ApiError(400, why, "tokens") from None
        raise e from None
    _check_model(m, served_model)
    if len(m.tokens) > max_len or any(t >= vocab_size for t in m.tokens):
        raise ApiError(400, why, "tokens")
    return m.tokens
