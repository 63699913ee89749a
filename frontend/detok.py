"""Incremental detokenization with stop strings.

Text is released only once it is stable: a token that ends inside a multi-byte
character waits for the rest of it, and the tail that could still grow into a
stop string is held back. A stop string ends the request and is never streamed.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def text_decoder(tokenizer):
    """ids -> text, special tokens skipped. A fast tokenizer that cleans up no spaces
    is called directly: the transformers wrapper would add nothing but time, and this
    runs twice per streamed token."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] = ()):
        self._decode = text_decoder(tokenizer)
        self.stop = list(stop)  # each non-empty: the frontend refuses an empty one
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far, stable characters only
        self._prefix = 0  # token index where the decode window starts
        self._read = 0  # tokens already turned into text
        self._num_sent = 0  # characters handed out by take()
        self.is_stopped = False

    def add(self, token_ids: list[int]) -> None:
        """Append tokens; sets is_stopped (and cuts the text) when a stop string appears."""
        for t in token_ids:
            if self.is_stopped:
                return
            self.token_ids.append(t)
            before = self._decode(self.token_ids[self._prefix : self._read])
            after = self._decode(self.token_ids[self._prefix :])
            if len(after) > len(before) and not after.endswith(REPLACEMENT):
                start = max(len(self.text) - self.holdback - len(after), 0)
                self.text += after[len(before) :]
                self._prefix = self._read
                self._read = len(self.token_ids)
                self._check_stop(start)

    def _check_stop(self, start: int) -> None:
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.is_stopped = True

    def take(self, is_final: bool = False) -> str:
        """The text not yet handed out that can no longer change."""
        if is_final and not self.is_stopped and self._read < len(self.token_ids):
            # The request ended inside a character (max_tokens cut it): its bytes would show as
            # U+FFFD, so they are dropped; replacement marks before them (invalid bytes the
            # model made) stay.
            before = self._decode(self.token_ids[self._prefix : self._read])
            self.text += self._decode(self.token_ids[self._prefix :])[len(before) :].rstrip(
                REPLACEMENT
            )
            self._read = len(self.token_ids)
        end = len(self.text) if (is_final or self.is_stopped) else len(self.text) - self.holdback
        if end <= self._num_sent:
            return ""
        out = self.text[self._num_sent : end]
        self._num_sent = end
        return out
