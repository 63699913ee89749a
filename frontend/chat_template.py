"""A chat request's prompt as the model's chat template writes it: the template's
variables (the tools, parsed and bounded in depth, and the request's own), how much longer
than sent the template may write the tools, and the render, whose failure is the request's
error."""

from __future__ import annotations

import functools
import inspect
import json

from common.wire.protocol import GenerateRequest

# A template writes the tools again, longer than sent: a short number written out (`9e15`
# is `9000000000000000.0`, 4.5 times), and where it indents JSON, each item on a line of its
# own with an indent a level of nesting (at most MAX_TOOLS_DEPTH).
TOOLS_GROWTH = 5
MAX_TOOLS_DEPTH = 32


def render(tokenizer, messages: list[dict], is_tokenized: bool, kwargs: dict):
    """The chat template over a client's messages and variables. NOTE: whatever it raises
    (a template's own raise_exception, a variable of the wrong type) is that request's
    error, never its loop's."""
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=is_tokenized, **kwargs
        )
    except Exception as e:
        raise ValueError(
            f"the chat template cannot render these messages: {type(e).__name__}: {str(e)[:200]}"
        ) from None


def template_kwargs(req: GenerateRequest, tokenizer) -> dict:
    """What the chat template gets besides the messages: the tools, and the request's
    chat_template_kwargs (Qwen3's enable_thinking, say): variables of the template alone.
    NOTE: apply_chat_template's own parameters are not a client's to set (chat_template
    would run a template of its choosing; return_tensors, padding change what comes back)."""
    reserved = _template_parameters(type(tokenizer))
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in reserved}
    if req.tools:
        try:
            kwargs["tools"] = json.loads(req.tools)
        except json.JSONDecodeError as e:
            raise ValueError(f"tools is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError("tools is nested too deeply") from None
        if _is_deeper(kwargs["tools"], MAX_TOOLS_DEPTH):
            raise ValueError(f"tools nest more than {MAX_TOOLS_DEPTH} levels deep")
    return kwargs


def tools_growth(tokenizer) -> int:
    """How many times longer than sent the model's chat template may write the tools:
    TOOLS_GROWTH, or where the template indents JSON, a line of its own and an indent a
    level for each item (an item of two characters, `0,`, takes 4 x MAX_TOOLS_DEPTH + 3)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    text = template if isinstance(template, str) else str(template)  # named ones: a dict
    return 4 * MAX_TOOLS_DEPTH + 1 if "indent" in text else TOOLS_GROWTH


def _is_deeper(value, limit: int) -> bool:
    """Whether plain data nests lists and maps more than limit levels deep (at once, once
    one does: the rest is not walked)."""
    stack = [(value, 1)]
    while stack:
        v, level = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            if level > limit:
                return True
            stack.extend((c, level + 1) for c in children if isinstance(c, (dict, list)))
    return False


@functools.lru_cache(maxsize=8)
def _template_parameters(tokenizer_type: type) -> frozenset[str]:
    named = inspect.signature(tokenizer_type.apply_chat_template).parameters.values()
    return frozenset(p.name for p in named if p.kind is not p.VAR_KEYWORD) | {"messages"}
