"""The OpenAI API's request bodies as models: each field's type and bounds, each list's
length, in one place (openai_api.py turns a body that fits into a request); their JSON
schemas are the OpenAPI document /openapi.json serves (openapi.py).

Parsed strictly (no number from a string, no integer from a float), finite numbers only;
a list is counted as it is read, and one item past its limit ends the reading. A body
that does not fit is one ApiError (400) naming its first fault and the field at fault
(openai_validate.py). A field given as null is a field not given.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from common.base.request import MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS
from common.wire.client import MAX_MESSAGES, MAX_N, MAX_PROMPT_IDS

I32_MAX = 2**31 - 1
MAX_BATCH = 256  # prompts in one completions call
MAX_STOP = 16  # stop strings (OpenAI's API takes 4)
MAX_TOOLS = 128
MAX_SPEC_CHARS = 2**16  # a grammar's text
MAX_NAME = 256  # a model's, a function's, a role's name


def _counted(max_len: int):
    def check(value):
        if isinstance(value, (list, dict)) and len(value) > max_len:
            raise ValueError(f"holds {len(value)} items: at most {max_len} are taken")
        return value

    return BeforeValidator(check)


def items(item, max_len: int, min_len: int = 0):
    """A list of at most max_len items: counted before any is read, and the first bad one
    ends the reading."""
    return Annotated[
        list[item], Field(min_length=min_len, max_length=max_len, fail_fast=True), _counted(max_len)
    ]


def entries(key, value, max_len: int):
    """A map of at most max_len entries, counted before any is read."""
    return Annotated[dict[key, value], Field(max_length=max_len), _counted(max_len)]


TokenId = Annotated[int, Field(ge=0, le=I32_MAX)]
Text = Annotated[str, Field(min_length=1)]  # a prompt
TokenIds = items(TokenId, MAX_PROMPT_IDS, 1)
Name = Annotated[str, Field(max_length=MAX_NAME)]
Short = Annotated[str, Field(max_length=1024)]  # a logit_bias key, a whitespace pattern
Word = Annotated[str, Field(min_length=1, max_length=1024)]  # a stop string, a bad word, a choice


def _range(kind: type, lo, hi):
    return Annotated[kind, Field(ge=lo, le=hi)] | None


# Fields taken only at these values, which change nothing (OpenAI's defaults, vLLM's).
NO_OP = {
    "best_of": (1,),
    "suffix": ("",),
    "functions": ([],),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "skip_special_tokens": (True,),
    "echo": (False,),
    "add_generation_prompt": (True,),
    "include_stop_str_in_output": (False,),
    "spaces_between_special_tokens": (True,),
    "add_special_tokens": (True,),
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _Open(_Strict):
    """An object whose other keys pass through as given (a tool's: the chat template reads them)."""

    model_config = ConfigDict(extra="allow")


class _Lenient(_Strict):
    """An object whose other keys are dropped (what a client echoes back of an answer)."""

    model_config = ConfigDict(extra="ignore")


# ---- what completions and chat share ----------------------------------------------------


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(_Open):
    name: Name | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Lenient):
    """vLLM's structured_outputs: one of these."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: items(Word, 1024, 1) | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Common(_Strict):
    model: Name | None = None
    user: Name | None = None
    metadata: entries(Name, Any, 16) | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: _range(int, 1, MAX_N) = None
    seed: _range(int, 0, 2**63 - 1) = None
    temperature: _range(float, 0.0, 2.0) = None
    top_p: _range(float, 0.0, 1.0) = None
    top_k: _range(int, -1, I32_MAX) = None
    min_p: _range(float, 0.0, 1.0) = None
    presence_penalty: _range(float, -2.0, 2.0) = None
    frequency_penalty: _range(float, -2.0, 2.0) = None
    repetition_penalty: _range(float, 0.001, 100.0) = None
    min_tokens: _range(int, 0, I32_MAX) = None
    stop: Union[Word, items(Word, MAX_STOP)] | None = None
    stop_token_ids: items(TokenId, MAX_STOP_TOKEN_IDS) | None = None
    ignore_eos: bool | None = None
    speculative: bool | None = None
    return_token_ids: bool | None = None
    logit_bias: entries(Short, float, MAX_LOGIT_BIAS) | None = None
    allowed_token_ids: items(TokenId, MAX_PROMPT_IDS, 1) | None = None  # [] allows none
    bad_words: Union[Word, items(Word, MAX_BAD_WORDS)] | None = None
    prompt_logprobs: _range(int, 0, MAX_LOGPROBS) = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: items(Word, 1024, 1) | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: Short | None = None
    # taken at their no-op values alone
    best_of: Literal[1] | None = None
    suffix: Literal[""] | None = None
    functions: items(Any, 0) | None = None
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    skip_special_tokens: Literal[True] | None = None
    include_stop_str_in_output: Literal[False] | None = None
    spaces_between_special_tokens: Literal[True] | None = None
    add_special_tokens: Literal[True] | None = None


class CompletionBody(_Common):
    """POST /v1/completions."""

    prompt: Union[Text, TokenIds, items(Union[Text, TokenIds], MAX_BATCH, 1)]
    max_tokens: _range(int, 0, I32_MAX) = None  # 0: the prompt alone (echo + logprobs)
    echo: bool | None = None
    logprobs: _range(int, 0, MAX_LOGPROBS) = None


# ---- chat ---------------------------------------------------------------------------------


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class CalledFunction(_Lenient):
    name: Name
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: Name = ""
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Lenient):
    # what _has_content says, for the schema's readers
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
                {
                    "required": ["tool_calls"],
                    "properties": {"tool_calls": {"type": "array", "minItems": 1}},
                },
            ]
        }
    )
    role: Name
    content: str | items(TextPart, MAX_MESSAGES) | None = None
    tool_calls: items(ToolCall, MAX_TOOLS) | None = None
    tool_call_id: Name | None = None
    name: Name | None = None

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content (an assistant's tool_calls may stand for it)")
        return self


class FunctionDef(_Open):
    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: Name


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


Messages = items(Message, MAX_MESSAGES, 1)
Tools = items(Tool, MAX_TOOLS)
TemplateKwargs = entries(Name, Any, 16)


class ChatBody(_Common):
    """POST /v1/chat/completions."""

    messages: Messages
    max_tokens: _range(int, 1, I32_MAX) = None
    max_completion_tokens: _range(int, 1, I32_MAX) = None
    logprobs: bool | None = None
    top_logprobs: _range(int, 0, MAX_LOGPROBS) = None
    tools: Tools | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    echo: Literal[False] | None = None
    add_generation_prompt: Literal[True] | None = None


# ---- vLLM's /tokenize and /detokenize -------------------------------------------------------


class TokenizeBody(_Strict):
    """POST /tokenize: a prompt, or messages (with tools) through the chat template."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        }
    )
    model: Name | None = None
    prompt: str | None = None
    messages: Messages | None = None
    tools: Tools | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    add_special_tokens: Literal[True] | None = None
    add_generation_prompt: Literal[True] | None = None


class DetokenizeBody(_Strict):
    """POST /detokenize."""

    model: Name | None = None
    tokens: items(TokenId, MAX_PROMPT_IDS)
