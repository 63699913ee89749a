"""The OpenAPI document GET /openapi.json serves: the routes that take a body, each with
its request schema (the models of openai_models.py), and errors in OpenAI's shape."""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from frontend.openai_models import I32_MAX, ChatBody, CompletionBody, DetokenizeBody, TokenizeBody

ROUTES = {
    "/v1/completions": CompletionBody,
    "/v1/chat/completions": ChatBody,
    "/tokenize": TokenizeBody,
    "/detokenize": DetokenizeBody,
}


def openapi(served_model: str, vocab_size: int, max_model_len: int) -> dict:
    """OpenAPI 3.1 for the routes that take a body: their request schemas, and errors in
    OpenAI's shape. The schemas say what this server takes: the one model name a body may
    give, token ids in its vocabulary, a prompt of ids no longer than its model length."""
    refs, defs = models_json_schema(
        [(m, "validation") for m in ROUTES.values()], ref_template="#/components/schemas/{model}"
    )
    schemas = defs["$defs"]
    for m in ROUTES.values():
        schemas[m.__name__]["properties"]["model"] = {
            "anyOf": [{"const": served_model}, {"type": "null"}]
        }
    _held_to(schemas, vocab_size, max_model_len)
    error = {
        "description": 'refused: {"error": {"message", "type", "param", "code"}}',
        "content": {"application/json": {"schema": {"type": "object", "required": ["error"]}}},
    }
    paths = {
        route: {
            "post": {
                "operationId": m.__name__.removesuffix("Body").lower(),
                "summary": m.__doc__,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": refs[(m, "validation")]}},
                },
                "responses": {
                    "200": {"description": "the answer (an event stream where stream is true)"},
                    "400": error,
                    "404": error,
                    "429": error,
                    "503": error,
                    "504": error,
                },
            }
        }
        for route, m in ROUTES.items()
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }


_TOKEN_ID = {"maximum": I32_MAX, "minimum": 0, "type": "integer"}


def _held_to(node, vocab_size: int, max_model_len: int, name: str = "") -> None:
    """Every list of token ids in node: each id below vocab_size; a prompt's ids, and the ids
    to detokenize, at most max_model_len."""
    if isinstance(node, list):
        for x in node:
            _held_to(x, vocab_size, max_model_len, name)
    elif isinstance(node, dict):
        if node.get("items") == _TOKEN_ID:
            node["items"] = {**_TOKEN_ID, "maximum": vocab_size - 1}
            if name in ("prompt", "tokens"):
                node["maxItems"] = min(node["maxItems"], max_model_len)
        for key, value in node.items():
            _held_to(value, vocab_size, max_model_len, name if key in ("anyOf", "items") else key)
