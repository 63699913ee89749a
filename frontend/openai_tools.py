"""Tool calls and reasoning in the OpenAI API, in Qwen3's own format.

A model given tools answers a call as
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
(several may follow one another), and thinks inside <think> ... </think> first.
tool_choice "auto" parses those blocks out of the text; "required" and a named
function are enforced with a grammar (common/base/grammar.py), so that even a
weak model answers with a call whose arguments fit the function's parameters:
required as a JSON list of {"name", "parameters"} (as vLLM does), a named
function as its arguments alone. "none" leaves the text as it is.

Split holds a choice's text as it streams and gives it back as content,
reasoning and whole tool calls; text that might be the start of a tag waits.
"""

from __future__ import annotations

import json
import uuid

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ToolError(ValueError):
    """tools or tool_choice that cannot be served, said so a client can act on it."""


def choice_mode(tools: list[dict] | None, tool_choice) -> tuple[str, str | None]:
    """(none|auto|required|named, the named function) of a request's tool_choice."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'")
        return "none", None
    if tool_choice in (None, "auto"):
        return "auto", None
    if tool_choice in ("none", "required"):
        return tool_choice, None
    f = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = f.get("name") if isinstance(f, dict) else None
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
        raise ToolError(
            '\'tool_choice\' must be none, auto, required or {"type": "function", '
            '"function": {"name": one of the tools}}'
        )
    return "named", name


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def grammar_for(
    tools: list[dict], mode: str, name: str | None, is_parallel: bool = True
) -> str | None:
    """The JSON schema that makes the answer a call (required, named), or None;
    required: a list of calls, of one unless is_parallel (parallel_tool_calls)."""
    if mode == "named":
        return json.dumps(_parameters(next(t for t in tools if t["function"]["name"] == name)))
    if mode == "required":
        one = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "parameters": _parameters(t),
                },
                "required": ["name", "parameters"],
            }
            for t in tools
        ]
        return json.dumps(
            {
                "type": "array",
                "minItems": 1,
                **({} if is_parallel else {"maxItems": 1}),
                "items": {"anyOf": one},
            }
        )
    return None


def _whole_items(text: str) -> list:
    """The items of a JSON list, or of the whole items at its start when it was cut
    short (max_tokens): the calls a required tool_choice made before the cut."""
    decoder, items, i = json.JSONDecoder(), [], text.find("[") + 1
    if i == 0:
        return items
    while True:
        while i < len(text) and text[i] in " \t\n\r,":
            i += 1
        try:
            item, i = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError):  # NOTE: a model may nest past C's stack
            return items
        items.append(item)


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def _holdback(text: str, tags: tuple[str, ...]) -> int:
    """How many trailing characters of text may be the start of one of the tags."""
    for n in range(min(max(len(t) for t in tags) - 1, len(text)), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


class Split:
    """One choice's text -> content, reasoning and tool calls, as it streams."""

    def __init__(self, mode: str, name: str | None, is_reasoning: bool):
        self.mode, self.name = mode, name
        self.is_reasoning = is_reasoning
        # start -> reasoning -> content <-> call
        self.state = "start" if is_reasoning else "content"
        self.pending = ""  # text not yet given back
        # Text that only extends a wait (_is_waiting), after pending; joined when it ends.
        # NOTE: added to pending and searched token by token, a long wait would cost each
        # token its whole length (the answer's square in all, on the frontend's loop).
        self._waiting: list[str] = []
        self._tail = ""  # the last characters of a call's text, where its close may begin
        self.calls: list[dict] = []

    def feed(self, text: str, is_final: bool = False) -> dict:
        """New text -> {"content": str, "reasoning_content": str, "tool_calls": [calls whole]}
        (the parts there are). Required and named calls are given whole at the end."""
        if not is_final and self._is_waiting(text):
            self._waiting.append(text)
            return {}
        self.pending += "".join(self._waiting) + text
        self._waiting = []
        out = {"content": "", "reasoning_content": "", "tool_calls": []}
        if self.mode in ("required", "named"):
            if is_final:
                out["tool_calls"] = self._forced(self.pending)
                self.pending = ""
            return {k: v for k, v in out.items() if v}
        while True:
            if self.state == "start":
                stripped = self.pending.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.pending, self.state = stripped[len(THINK_OPEN) :], "reasoning"
                    continue
                if not is_final and THINK_OPEN.startswith(stripped):
                    break  # it may yet open a block
                self.state = "content"
            if self.state == "reasoning":
                i = self.pending.find(THINK_CLOSE)
                if i < 0:
                    keep = 0 if is_final else _holdback(self.pending, (THINK_CLOSE,))
                    out["reasoning_content"] += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                out["reasoning_content"] += self.pending[:i]
                self.pending, self.state = (
                    self.pending[i + len(THINK_CLOSE) :].lstrip("\n"),
                    "content",
                )
                continue
            if self.state == "content":
                i = self.pending.find(TOOL_OPEN) if self.mode == "auto" else -1
                if i < 0:
                    keep = (
                        0
                        if is_final or self.mode != "auto"
                        else _holdback(self.pending, (TOOL_OPEN,))
                    )
                    out["content"] += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                out["content"] += self.pending[:i]
                self.pending, self.state = self.pending[i + len(TOOL_OPEN) :], "call"
                continue
            i = self.pending.find(TOOL_CLOSE)  # state "call"
            if i < 0:
                if is_final:  # a call never closed: what there is, as text
                    out["content"] += TOOL_OPEN + self.pending
                    self.pending = ""
                break
            call = self._parsed(self.pending[:i])
            if call is None:
                out["content"] += TOOL_OPEN + self.pending[: i + len(TOOL_CLOSE)]
            else:
                out["tool_calls"].append(call)
                self.calls.append(call)
            self.pending, self.state = self.pending[i + len(TOOL_CLOSE) :], "content"
        return {k: v for k, v in out.items() if v}

    def _is_waiting(self, text: str) -> bool:
        """Whether text gives nothing back yet, and changes no state: a required or named
        call's (given whole at the end), a call's that does not close it, or blank text
        before a reasoning block may open."""
        if self.mode in ("required", "named"):
            return True
        if self.state == "call":
            before = self._tail if self._waiting else self.pending[1 - len(TOOL_CLOSE) :]
            recent = before + text
            self._tail = recent[1 - len(TOOL_CLOSE) :]
            return TOOL_CLOSE not in recent
        return (
            self.state == "start"
            and text.isspace()
            and (bool(self._waiting) or not self.pending or self.pending.isspace())
        )

    @staticmethod
    def _parsed(body: str) -> dict | None:
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        return _call(obj["name"], obj.get("arguments", {}))

    def _forced(self, text: str) -> list[dict]:
        """The answer the grammar made: a named call's arguments, or required's list."""
        if self.mode == "named":
            calls = [_call(self.name, text.strip())]
        else:
            calls = [
                _call(c["name"], c.get("parameters", {}))
                for c in _whole_items(text)
                if isinstance(c, dict) and isinstance(c.get("name"), str)
            ]
        self.calls += calls
        return calls
