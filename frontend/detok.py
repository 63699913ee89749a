"""Incremental detokenization with stop strings.

Text is released only once it is stable: a character whose bytes have not all come
waits for the rest of them, and the tail that could still grow into a stop string is
held back. A stop string ends the request and is never streamed.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
# The decode window's tokens, at most: past it, the window starts again with its last
# KEPT_TOKENS, which hold every byte of a character still coming (three at most, a token
# at least one of them).
MAX_WINDOW = 24
KEPT_TOKENS = 12


def falls_back_to_bytes(tokenizer) -> bool:
    """Whether the tokenizer's decoder writes byte tokens (<0xE4>) as a run: a run that is
    not all UTF-8 shows as a U+FFFD a byte, those of characters already whole included."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and b'"ByteFallback"' in decoder.__getstate__()


def text_decoder(tokenizer):
    """ids -> text, special tokens skipped. A fast tokenizer that cleans up no spaces
    is called directly: the transformers wrapper would add nothing but time, and this
    runs twice per streamed token."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Text from tokens, decoded over a short window of the latest ones (a token's text can
    depend on those before it: a leading space, a character's first bytes). All of the
    window's text but its last U+FFFD (a character whose bytes may still come) is stable;
    where the decoder falls back to bytes, a window ending in U+FFFD waits whole.
    NOTE: a character's bytes may straddle every token boundary (byte-level BPE does that
    to CJK text), so text is taken a character at a time, not a token at a time; and the
    window is kept short, or each token would decode the whole output again."""

    def __init__(self, tokenizer, stop: list[str] = ()):
        self._decode = text_decoder(tokenizer)
        # ids that decode to nothing (specials are skipped, unknown ids have no text): kept
        # out of the window, which they would only make longer
        self._num_vocab = len(tokenizer)
        self._is_byte_fallback = falls_back_to_bytes(tokenizer)
        self._token_text = tokenizer.convert_ids_to_tokens if self._is_byte_fallback else None
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._special = frozenset(tokenizer.all_special_ids).union(
            i for i, t in added.items() if getattr(t, "special", False)
        )
        self.stop = list(stop)  # each non-empty: the frontend refuses an empty one
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self._ids: list[int] = []  # the window's tokens
        # Stable text not yet handed out by take(): its last holdback characters at least,
        # where a stop string may still begin.
        # NOTE: only this tail is kept, so adding to it costs the tail, not the output.
        self.unsent = ""
        self._num_done = 0  # characters of the window's stable text already taken as stable
        self._num_pending = 0  # the window's last U+FFFDs: a character that may still come
        self.is_stopped = False

    def add(self, token_ids: list[int]) -> int:
        """Append tokens; sets is_stopped (and cuts the text) when a stop string appears.
        Returns how many were taken: none past the one that completed a stop string."""
        for i, t in enumerate(token_ids):
            if self.is_stopped:
                return i
            if t >= self._num_vocab or t in self._special:
                continue
            self._ids.append(t)
            window = self._decode(self._ids)
            if self._is_byte_fallback:
                # NOTE: a window ending in a mark may be a run of bytes that becomes text:
                # it waits, up to two windows (then its marks are taken as they are)
                is_waiting = (
                    window.endswith(REPLACEMENT)
                    and self._is_byte(len(self._ids) - 1)  # not a word's own mark
                    and len(self._ids) <= 2 * MAX_WINDOW
                )
                self._num_pending = len(window) - self._num_done if is_waiting else 0
            else:  # byte-level: a character still coming is one last mark
                self._num_pending = int(window.endswith(REPLACEMENT))
            num_stable = len(window) - self._num_pending
            if num_stable > self._num_done:
                start = max(len(self.unsent) - self.holdback, 0)
                self.unsent += window[self._num_done : num_stable]
                self._num_done = num_stable
                self._check_stop(start)
            # NOTE: a run of bytes waiting to be UTF-8 is not cut (it waits two windows)
            if len(self._ids) > MAX_WINDOW and not (self._is_byte_fallback and self._num_pending):
                self._start_window_again()
        return len(token_ids)

    def _start_window_again(self) -> None:
        """The window keeps its last KEPT_TOKENS: its text but the pending marks is all taken
        as stable already. NOTE: its first characters may now be U+FFFD where a character's
        last bytes begin it: taken all the same. A decoder that falls back to bytes is cut
        before a token that is no byte (a run decoded apart from its start would show as
        marks), or, in a run of bytes whole to here, before its last character's bytes
        (kept for the space a sentencepiece decoder strips from a text's first token)."""
        n = len(self._ids)
        cut = n - KEPT_TOKENS
        if self._is_byte_fallback:  # NOTE: nothing is pending here: the text is all taken
            cut = next((c for c in range(cut, n) if not self._is_byte(c)), None)
            if cut is None:
                whole = (k for k in range(1, 5) if self._decode(self._ids[-k:])[:1] != REPLACEMENT)
                cut = n - next(whole, 0)
        del self._ids[:cut]
        self._num_done = max(len(self._decode(self._ids)) - self._num_pending, 0)

    def _is_byte(self, index: int) -> bool:
        return str(self._token_text(self._ids[index])).startswith("<0x")

    def _check_stop(self, start: int) -> None:
        hits = [i for i in (self.unsent.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.unsent = self.unsent[: min(hits)]
            self.is_stopped = True

    def take(self, is_final: bool = False) -> str:
        """The text not yet handed out that can no longer change. At the end, a character
        whose bytes did not all come (max_tokens cut it) is dropped, and so are marks of
        invalid bytes just before it not yet handed out (as vLLM drops them): the text ends
        where its last whole character does. Marks with text after them stay."""
        if is_final and not self.is_stopped:
            self.unsent = self.unsent.rstrip(REPLACEMENT)
        end = len(self.unsent)
        if not (is_final or self.is_stopped):
            end -= self.holdback
        if end <= 0:
            return ""
        out, self.unsent = self.unsent[:end], self.unsent[end:]
        return out
