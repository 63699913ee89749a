"""The OpenAI API's bodies as models (frontend/openai_models.py): every documented field
parses into the request the cluster runs, every fault is one 400 naming its field, lists
are counted before their items are read, and /openapi.json describes the routes."""

from __future__ import annotations

import json
import time

import pytest

from frontend import openai_api as api
from frontend import openapi

MODEL = "m"
USER = [{"role": "user", "content": "hi"}]
ADD = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "description": "a + b", "strict": True, "parameters": ADD},
    }
]


def _call(body: dict, kind: str = "completions") -> api.Call:
    return api.parse(body, kind, MODEL, 16)


def _refused(body, kind: str = "completions") -> api.ApiError:
    with pytest.raises(api.ApiError) as e:
        api.parse_calls(body, kind, MODEL, 16)
    return e.value


@pytest.mark.parametrize(
    "body,kind,want",
    [
        (
            {
                "prompt": "hi",
                "max_tokens": 3,
                "temperature": 0,
                "top_p": 0.5,
                "top_k": 4,
                "seed": 9,
                "min_p": 0.1,
                "presence_penalty": 1,
                "frequency_penalty": -1.5,
                "repetition_penalty": 1.2,
                "min_tokens": 2,
                "ignore_eos": True,
                "stop_token_ids": [5],
                "stop": "x",
                "bad_words": "no",
                "n": 3,
                "speculative": False,
            },
            "completions",
            dict(
                max_tokens=3,
                temperature=0,
                top_p=0.5,
                top_k=4,
                seed=9,
                min_p=0.1,
                presence_penalty=1,
                frequency_penalty=-1.5,
                repetition_penalty=1.2,
                min_tokens=2,
                ignore_eos=True,
                stop_token_ids=[5],
                stop=["x"],
                bad_words=["no"],
                n=3,
                speculative=False,
            ),
        ),
        (
            {"prompt": [1, 2, 3], "logprobs": 2, "echo": True, "max_tokens": 0},
            "completions",
            dict(prompt_token_ids=[1, 2, 3], logprobs=2, prompt_logprobs=2, max_tokens=0),
        ),
        (
            {
                "prompt": "hi",
                "logit_bias": {"7": 3, "11": -100.0},
                "allowed_token_ids": [7, 11],
                "prompt_logprobs": 1,
            },
            "completions",
            dict(logit_bias={"7": 3, "11": -100.0}, allowed_token_ids=[7, 11], prompt_logprobs=1),
        ),
        (
            {
                "messages": USER,
                "max_completion_tokens": 5,
                "max_tokens": 9,
                "logprobs": True,
                "top_logprobs": 2,
            },
            "chat",
            dict(max_tokens=5, logprobs=2, messages=USER),
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "refusal": None,
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ]
            },
            "chat",
            dict(messages=[{"role": "user", "content": "ab"}]),
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "add", "arguments": '{"a": 1}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "2"},
                ],
                "tools": TOOLS,
                "chat_template_kwargs": {"enable_thinking": False},
            },
            "chat",
            dict(
                messages=[
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "type": "function",
                                "id": "c1",
                                "function": {"name": "add", "arguments": {"a": 1}},
                            }
                        ],
                    },
                    {"role": "tool", "content": "2", "tool_call_id": "c1"},
                ],
                tools=json.dumps(TOOLS),
                chat_template_kwargs={"enable_thinking": False},
            ),
        ),
    ],
)
def test_every_documented_field_reaches_the_request(body, kind, want):
    r = _call({"model": MODEL, "user": "u", **body}, kind).request
    for k, v in want.items():
        assert getattr(r, k) == v, k


@pytest.mark.parametrize(
    "body,kind,spec",
    [
        (
            {"prompt": "x", "response_format": {"type": "json_object"}},
            "completions",
            ("json_object", ""),
        ),
        (
            {
                "messages": USER,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True},
                },
            },
            "chat",
            ("json_schema", '{"type": "object"}'),
        ),
        ({"prompt": "x", "response_format": {"type": "text"}}, "completions", None),
        (
            {"prompt": "x", "guided_json": {"type": "array"}},
            "completions",
            ("json_schema", '{"type": "array"}'),
        ),
        ({"prompt": "x", "guided_regex": "a+"}, "completions", ("regex", "a+")),
        ({"prompt": "x", "guided_choice": ["a", "b"]}, "completions", ("choice", '["a", "b"]')),
        (
            {"prompt": "x", "guided_grammar": 'root ::= "a"'},
            "completions",
            ("grammar", 'root ::= "a"'),
        ),
        (
            {"prompt": "x", "structured_outputs": {"choice": ["red"]}},
            "completions",
            ("choice", '["red"]'),
        ),
        (
            {"prompt": "x", "structured_outputs": {"json": "{}", "disable_fallback": True}},
            "completions",
            ("json_schema", "{}"),
        ),
        (
            {
                "messages": USER,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "add"}},
            },
            "chat",
            ("json_schema", json.dumps(ADD)),
        ),
    ],
)
def test_structured_outputs_in_each_of_their_spellings(body, kind, spec):
    s = _call(body, kind).request.structured
    assert (s.kind, s.spec) == spec if spec else s is None


def test_streams_tools_and_batches_are_what_the_answer_is_shaped_by():
    c = _call(
        {
            "prompt": "x",
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "return_token_ids": True,
        }
    )
    assert (c.is_stream, c.is_usage_streamed, c.is_usage_continuous, c.is_token_ids) == (True,) * 4
    c = _call(
        {"messages": USER, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
        "chat",
    )
    assert c.tool_mode == "required" and '"maxItems": 1' in c.request.structured.spec
    assert _call({"messages": USER, "tools": TOOLS}, "chat").tool_mode == "auto"
    calls = api.parse_calls(
        {"prompt": ["a", [1, 2], "c"], "n": 2, "echo": True}, "completions", MODEL, 16
    )
    assert [c.request.prompt or c.request.prompt_token_ids for c in calls] == ["a", [1, 2], "c"]
    assert len({c.request.request_id for c in calls}) == 3 and all(c.request.n == 2 for c in calls)
    assert _call({"prompt": ["one"]}).request.prompt == "one"  # a batch of one is its prompt
    nulls = _call({"prompt": "x", "suffix": None, "logprobs": None, "vendor_field": None}).request
    assert nulls.logprobs is None  # a field given as null is a field not given


@pytest.mark.parametrize(
    "body,kind,param,says",
    [
        ({"prompt": "hi", "n": 0}, "completions", "n", "'n' must be in [1, 64], got 0"),
        (
            {"prompt": "hi", "temperature": "hot"},
            "completions",
            "temperature",
            "'temperature' must be a valid number",
        ),
        (
            {"prompt": "hi", "max_tokens": 2.0},
            "completions",
            "max_tokens",
            "'max_tokens' must be a valid integer",
        ),
        ({"prompt": "hi", "seed": True}, "completions", "seed", "'seed' must be a valid integer"),
        ({"prompt": "hi", "top_p": float("nan")}, "completions", "top_p", "finite"),
        (
            {"prompt": "hi", "suffix": "!"},
            "completions",
            "suffix",
            'only suffix="", which changes nothing',
        ),
        (
            {"prompt": "hi", "frobnicate": 1},
            "completions",
            "frobnicate",
            "'frobnicate' is not supported by pdserve",
        ),
        ({"messages": USER, "echo": True}, "chat", "echo", "only echo=false"),
        ({"prompt": ["a", 5]}, "completions", "prompt", "a list of those (a batch"),
        ({"prompt": []}, "completions", "prompt", "'prompt' must be"),
        ({}, "completions", "prompt", "'prompt' must be"),
        ({"prompt": "hi", "stop": ["a"] * 17}, "completions", "stop", "at most 16 strings"),
        ({"prompt": "hi", "stop": ""}, "completions", "stop", "each of 1 to 1024 characters"),
        ({"prompt": ""}, "completions", "prompt", "'prompt' must be a non-empty string"),
        (
            {"prompt": "hi", "bad_words": ["w"] * 200_000},
            "completions",
            "bad_words",
            "at most 128 strings",
        ),
        (
            {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(2000)}},
            "completions",
            "logit_bias",
            "holds 2000 items: at most 1024",
        ),
        (
            {"prompt": "hi", "allowed_token_ids": [-1]},
            "completions",
            "allowed_token_ids",
            "'allowed_token_ids[0]'",
        ),
        # Empty: no token may be sampled (not "no restriction", which is leaving it out)
        (
            {"prompt": "hi", "allowed_token_ids": []},
            "completions",
            "allowed_token_ids",
            "at least 1",
        ),
        (
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            "completions",
            "stream_options",
            "only with stream",
        ),
        (
            {"prompt": "hi", "stream": True, "stream_options": {"x": 1}},
            "completions",
            "stream_options",
            "takes only",
        ),
        (
            {"prompt": "hi", "max_tokens": 0},
            "completions",
            "max_tokens",
            "needs 'echo' and 'logprobs'",
        ),
        ({"prompt": ["a", "b"], "stream": True}, "completions", "prompt", "answered whole"),
        (
            {"prompt": "hi", "response_format": {"type": "xml"}},
            "completions",
            "response_format",
            "json_schema",
        ),
        (
            {"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]},
            "completions",
            "response_format",
            "give one",
        ),
        (
            {"prompt": "hi", "guided_regex": "a" * 70_000},
            "completions",
            "response_format",
            "at most 65536",
        ),
        ({"messages": []}, "chat", "messages", "at least 1 item"),
        (
            {"messages": [{"role": "user"}]},
            "chat",
            "messages",
            "'messages[0]': a message needs content",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "chat",
            "messages",
            '\'messages[0].content\' must be a string or a list of {"type": "text"',
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "chat",
            "messages",
            "arguments must be JSON",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"function": {"name": "f", "arguments": "[" * 10**5 + "]" * 10**5}}
                        ],
                    }
                ]
            },
            "chat",
            "messages",
            "arguments must be JSON",  # nested past json's stack: no RecursionError, no 500
        ),
        ({"messages": USER, "logprobs": 3}, "chat", "logprobs", "'top_logprobs'"),
        ({"messages": USER, "top_logprobs": 3}, "chat", "top_logprobs", "needs 'logprobs': true"),
        (
            {"messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]},
            "chat",
            "tools",
            "each",
        ),
        (
            {"messages": USER, "tools": TOOLS, "tool_choice": "always"},
            "chat",
            "tools",
            "'tool_choice' must be",
        ),
        ({"messages": USER, "tool_choice": "required"}, "chat", "tools", "needs 'tools'"),
        (
            {
                "messages": USER,
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "chat",
            "tool_choice",
            "takes no response_format",
        ),
        (
            {"messages": USER, "chat_template_kwargs": [1]},
            "chat",
            "chat_template_kwargs",
            "valid dictionary",
        ),
    ],
)
def test_each_fault_is_one_400_naming_its_field(body, kind, param, says):
    e = _refused(body, kind)
    assert (e.status, e.param) == (400, param) and says in e.message, e.message


def test_the_wrong_model_is_a_404_and_a_body_that_is_no_object_a_400():
    e = _refused({"prompt": "x", "model": "gpt-4o"})
    assert e.status == 404 and e.param == "model" and "serves 'm'" in e.message
    assert _refused([1, 2]).status == 400
    assert _refused("x").message == "the request body must be a JSON object"


def test_a_list_past_its_limit_is_refused_before_its_items_are_read():
    """Counted, not walked: a list of a million bad items past its limit costs the same
    as one of a few (and a long one is never shown whole in the error)."""
    for body in (
        {"prompt": "x", "allowed_token_ids": ["w"] * 3_000_000},
        {"prompt": "x", "logit_bias": {str(i): "w" for i in range(1_000_000)}},
        {"prompt": [1] * (2**20 + 1)},
        {"prompt": ["w"] * 1_000_000},
        {"prompt": "x", "stop_token_ids": [[1]] * 1_000_000},
    ):
        t0 = time.process_time()
        e = _refused(body)
        assert e.status == 400 and len(e.message) < 300
        assert time.process_time() - t0 < 0.05, (list(body)[-1], time.process_time() - t0)


def test_tokenize_and_detokenize_bodies():
    assert api.parse_tokenize({"prompt": "hi", "add_special_tokens": True}, MODEL).prompt == "hi"
    r = api.parse_tokenize(
        {"messages": USER, "tools": TOOLS, "chat_template_kwargs": {"x": 1}}, MODEL
    )
    assert r.messages == USER and json.loads(r.tools) == TOOLS
    assert r.chat_template_kwargs == {"x": 1}
    assert api.parse_detokenize({"tokens": [1, 2]}, MODEL, 10, 5) == [1, 2]
    for body in ({"tokens": [10]}, {"tokens": [1] * 6}, {"tokens": "x"}, {"tokens": [-1]}, {}):
        with pytest.raises(api.ApiError) as e:
            api.parse_detokenize(body, MODEL, 10, 5)
        assert e.value.param == "tokens" and "at most 5 token ids in [0, 10)" in e.value.message
    with pytest.raises(api.ApiError) as e:
        api.parse_tokenize({"prompt": "a", "messages": USER}, MODEL)
    assert e.value.param is None and "one of" in e.value.message


def test_the_openapi_document_describes_each_route_with_its_body():
    doc = openapi.openapi(MODEL, 1000, 512)
    assert doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    for route, name in [
        ("/v1/completions", "CompletionBody"),
        ("/v1/chat/completions", "ChatBody"),
        ("/tokenize", "TokenizeBody"),
        ("/detokenize", "DetokenizeBody"),
    ]:
        body = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert schemas[name]["additionalProperties"] is False
    completion = schemas["CompletionBody"]
    assert completion["required"] == ["prompt"] and "n" in completion["properties"]
    assert completion["properties"]["model"] == {"anyOf": [{"const": MODEL}, {"type": "null"}]}
    text = json.dumps(doc)
    assert all(ref.split("/")[-1] in schemas for ref in _refs(doc))
    assert '"maxItems": 128' in text  # bad_words, tools: bounded in the schema too
    ids = schemas["DetokenizeBody"]["properties"]["tokens"]
    assert ids["items"]["maximum"] == 999 and ids["maxItems"] == 512
    assert schemas["CompletionBody"]["properties"]["prompt"]["anyOf"][1]["maxItems"] == 512


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in _refs(v)]
    return [r for v in node for r in _refs(v)] if isinstance(node, list) else []
