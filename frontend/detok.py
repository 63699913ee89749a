"""Incremental detokenization with stop strings.

Text is released only once it is stable: a token that ends inside a multi-byte
character waits for the rest of it, and the tail that could still grow into a
stop string is held back. A stop string ends the request and is never streamed.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
# Tokens that may wait in the window for a character's last bytes before the text that no
# longer changes is taken from all but the last MAX_CHAR_BYTES of them.
MAX_PENDING = 8
MAX_CHAR_BYTES = 4  # UTF-8's longest character; a window's token carries at least one byte


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
        self._ids: list[int] = []  # the window's tokens: none that decodes to nothing alone
        self.text = ""  # decoded so far, stable characters only
        self._prefix = 0  # token index where the decode window starts
        self._read = 0  # tokens already turned into text
        self._num_sent = 0  # characters handed out by take()
        self.is_stopped = False

    def add(self, token_ids: list[int]) -> int:
        """Append tokens; sets is_stopped (and cuts the text) when a stop string appears.
        Returns how many were taken: none past the one that completed a stop string."""
        for i, t in enumerate(token_ids):
            if self.is_stopped:
                return i
            self._ids.append(t)
            before = self._decode(self._ids[self._prefix : self._read])
            after = self._decode(self._ids[self._prefix :])
            if len(after) > len(before) and not after.endswith(REPLACEMENT):
                self._commit(before, after, len(self._ids))
            elif not self._decode([t]):
                self._ids.pop()  # a special token, or an id the tokenizer lacks: no bytes
            elif len(self._ids) - self._read > MAX_PENDING:
                self._commit_stable_head(before, after)
        return len(token_ids)

    def _commit(self, before: str, after: str, num_read: int) -> None:
        """Text for the window's tokens [_read, num_read): after (the window's text to
        num_read) past before."""
        start = max(len(self.text) - self.holdback - len(after), 0)
        self.text += after[len(before) :]
        self._prefix = self._read
        self._read = num_read
        self._check_stop(start)

    def _commit_stable_head(self, before: str, after: str) -> None:
        """Takes the text of all but the window's last MAX_CHAR_BYTES tokens where they no
        longer change it: a character cut there is whole in after, or never will be.
        NOTE: a window whose text never ends in a whole character (lone bytes the model
        makes) would otherwise grow with the output and be decoded whole at each token: a
        cost in the output's square on the frontend's loop, which every client shares."""
        n = len(self._ids)
        for num_read in range(n - MAX_CHAR_BYTES, max(n - 2 * MAX_CHAR_BYTES, self._read), -1):
            head = self._decode(self._ids[self._prefix : num_read])
            if head.startswith(before) and after.startswith(head):
                self._commit(before, head, num_read)
                return

    def _check_stop(self, start: int) -> None:
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.is_stopped = True

    def take(self, is_final: bool = False) -> str:
        """The text not yet handed out that can no longer change."""
        if is_final and not self.is_stopped and self._read < len(self._ids):
            # The request ended inside a character (max_tokens cut it): its bytes would show as
            # one U+FFFD, so it is dropped; replacement marks before it (invalid bytes the
            # model made) stay.
            before = self._decode(self._ids[self._prefix : self._read])
            tail = self._decode(self._ids[self._prefix :])[len(before) :]
            self.text += tail[:-1] if tail.endswith(REPLACEMENT) else tail
            self._read = len(self._ids)
        end = len(self.text) if (is_final or self.is_stopped) else len(self.text) - self.holdback
        if end <= self._num_sent:
            return ""
        out = self.text[self._num_sent : end]
        self._num_sent = end
        return out
