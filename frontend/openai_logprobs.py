"""Log-probabilities in the OpenAI API's two shapes, from what the nodes report
(common.base.request.TokenLogprobs: the token's own, and the k likeliest).

Completions: {"tokens", "token_logprobs", "top_logprobs" (a map text -> logprob per
token), "text_offset"}; with echo the prompt's tokens come first, the first of them
without a log-probability. Chat: {"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}.
"""

from __future__ import annotations

from functools import lru_cache

from common.base.request import TokenLogprobs


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class TokenStrings:
    """Each token id's text and bytes, worked out once per id."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._texts:
            piece = self._tok.convert_ids_to_tokens(token_id)
            self._texts[token_id] = (
                self._tok.convert_tokens_to_string([piece]) if piece is not None else ""
            )
        return self._texts[token_id]

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: a byte-level piece may hold part of a character."""
        if token_id not in self._bytes:
            piece = self._tok.convert_ids_to_tokens(token_id) or ""
            table = _byte_decoder()
            self._bytes[token_id] = (
                [table[c] for c in piece]
                if piece and all(c in table for c in piece)
                else list(self.text(token_id).encode("utf-8"))
            )
        return self._bytes[token_id]


def completion(
    strings: TokenStrings,
    token_ids: list[int],
    logprobs: list[TokenLogprobs | None],
    offset: int = 0,
) -> dict:
    """The completions shape for these tokens; offset: the text's length before them."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp in zip(token_ids, logprobs):
        text = strings.text(tid)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(lp.logprob)
        # NOTE: a map by text: two tokens of one text (byte pieces of a character) are one
        # entry, the likelier (they come likeliest first), as a reader comparing with max() expects.
        top: dict[str, float] = {}
        for i, v in zip(lp.top_ids, lp.top_logprobs):
            top.setdefault(strings.text(i), v)
        top.setdefault(text, lp.logprob)  # the chosen token is always among them (as vLLM)
        out["top_logprobs"].append(top)
    return out


def chat(strings: TokenStrings, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> dict:
    content = []
    for tid, lp in zip(token_ids, logprobs):
        if lp is None:
            continue
        content.append(
            {
                "token": strings.text(tid),
                "logprob": lp.logprob,
                "bytes": strings.bytes(tid),
                "top_logprobs": [
                    {"token": strings.text(i), "logprob": v, "bytes": strings.bytes(i)}
                    for i, v in zip(lp.top_ids, lp.top_logprobs)
                ],
            }
        )
    return {"content": content}


def merge(a: dict | None, b: dict) -> dict:
    """Two parts of one answer's completions logprobs, in order."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


def extend(a: dict | None, b: dict) -> dict:
    """a with b's logprobs after its own (either shape), in a's lists: a whole answer gathers
    them a token at a time, and rebuilding its lists each time is quadratic in its length.
    With a None, lists of its own: b may be shared (an echo's prompt part is every choice's)."""
    if a is None:
        return {k: list(v) for k, v in b.items()}
    for k in a:
        a[k].extend(b[k])
    return a
