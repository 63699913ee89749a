"""A request's grammar matcher: what its next token may be (its grammar's mask, a fixed
mask beside it, the last tokens of its bad words of several tokens), past the tokens it
has made so far, and why it cannot go on (its grammar costs too much to follow, or has no
way on from here)."""

from __future__ import annotations

import torch

from common.base.grammar import GrammarError, Grammars, num_words
from common.base.grammar_cost import CostMeter


def matcher_for(
    params, tokens: list[int], vocab_size: int, grammars: Grammars | None, compiled=None
) -> "Matcher":
    """The matcher of a request whose mask changes token by token (params.is_masked_per_step:
    a grammar, from grammars, or a bad word of several tokens), past the tokens it has
    generated so far. compiled: its grammar, compiled already (Compiles.take). GrammarError:
    following those tokens cost too much (grammar_cost.py), or the grammar cannot go on
    from where they led."""
    g = grammars.xgrammar_matcher(params.grammar, compiled) if params.grammar else None
    is_json = g is not None and params.grammar[0].startswith("json")
    m = Matcher(
        vocab_size,
        g,
        grammars.json_safe if is_json else None,
        [w for w in params.bad_words_ids if len(w) > 1],
        grammars.stop_only if g is not None else None,
    )
    for i, t in enumerate(tokens):
        m.accept(t)
        m.cost.check_replay(i + 1)
        if m.cost.error is not None:
            break  # NOTE: not a moment more of it: the request fails
    if m.cost.error is None and tokens:
        m.fill()  # where they led: a grammar with no way on from there fails the request
    if m.error is not None:
        raise GrammarError(m.error)
    return m


# NOTE: a grammar's own dead end, or one the request's other rules make (min_tokens holds
# back the EOS a whole grammar allows alone; bad_words, logit_bias, allowed_token_ids)
NO_WAY_ON = (
    "the grammar cannot go on from here, under its rules and the request's own (min_tokens, "
    "bad_words, logit_bias, allowed_token_ids)"
)


class Matcher:
    """What one request's next token may be: its grammar's mask, a fixed mask beside it,
    and no last token of a bad word whose other tokens the output just ended with
    (vLLM's meaning of bad_words: a sequence never completed; one-token words are
    masked with the rest of the request's fixed masks, logits.py)."""

    def __init__(
        self,
        vocab_size: int,
        grammar=None,
        also: torch.Tensor | None = None,
        bad_words: list[tuple[int, ...]] = (),
        stop_only: torch.Tensor | None = None,
    ):
        self._m = grammar  # an xgrammar GrammarMatcher, or None
        self._stop_only = stop_only  # [W]: EOS alone, once the grammar has ended
        self.bits = torch.zeros(num_words(vocab_size), dtype=torch.int32)  # the next token's mask
        self._also = also
        self._bad_words = bad_words
        self._tail: list[int] = []  # the last tokens, as many as the longest bad word needs
        self.cost = CostMeter()  # its calls into xgrammar; cost.error: too costly to go on
        self._dead_end: str | None = None  # set once a mask allows no token at all

    @property
    def error(self) -> str | None:
        """Why the request cannot go on under its grammar: following it costs too much, or
        the next token's mask allows none (the grammar has no way on from here)."""
        return self.cost.error or self._dead_end

    def fill(self) -> torch.Tensor:
        """The next token's mask ([W] int32 words; this matcher's buffer)."""
        if self._m is not None:
            # NOTE: a matcher that accepted EOS has ended and may not be asked for a mask
            # (xgrammar raises); with ignore_eos the request goes on, on EOS alone.
            if self._m.is_terminated():
                self.bits.copy_(self._stop_only)
            else:
                self.cost.call(self._m.fill_next_token_bitmask, self.bits[None])
        else:
            self.bits.fill_(-1)
        if self._also is not None:
            self.bits &= self._also
        for w in self._bad_words:
            if (
                len(self._tail) >= len(w) - 1
                and tuple(self._tail[len(self._tail) - len(w) + 1 :]) == w[:-1]
            ):
                self.bits[w[-1] // 32] &= ~(1 << (w[-1] % 32)) if w[-1] % 32 != 31 else 0x7FFFFFFF
        if self._dead_end is None and not bool(self.bits.any()):
            # NOTE: a step under this mask could only make a token it forbids
            self._dead_end = f"{NO_WAY_ON}: it allows no next token here"
        return self.bits

    def fill_ahead(self, drafts: list[int]) -> torch.Tensor:
        """The masks of a verify step's positions ([len(drafts) + 1, W] int32 words, a new
        tensor): position j's as if drafts 0..j-1 had been made. The matcher takes the
        drafts its masks allow and rolls them back: it ends as it began. NOTE: past a
        draft its mask refuses (or none, -1) the masks repeat that position's: the draft is
        never accepted there (the step's token is masked to others), so none after it is."""
        out = torch.empty(len(drafts) + 1, self.bits.shape[0], dtype=torch.int32)
        tail, num_taken = self._tail, 0
        out[0] = self.fill()
        dead_end = self._dead_end  # NOTE: the next position's alone: drafts may be refused
        for j, token in enumerate(drafts):
            word = token // 32
            is_allowed = 0 <= word < out.shape[1] and (int(out[j, word]) >> (token % 32)) & 1
            if is_allowed and self._m is not None and not self._m.is_terminated():
                is_allowed = self.cost.call(self._m.accept_token, token)
                num_taken += is_allowed
            if not is_allowed or self.cost.error is not None:  # NOTE: refused: no more of it
                out[j + 1 :] = out[j]
                break
            if self._bad_words:
                self._tail = (self._tail + [token])[-max(len(w) for w in self._bad_words) :]
            out[j + 1] = self.fill()
        if num_taken:
            self.cost.call(self._m.rollback, num_taken)
        self._tail, self._dead_end = tail, dead_end
        return out

    def accept(self, token: int) -> bool:
        """False if the grammar did not allow it (it was not masked to it): error says so."""
        if self._bad_words:
            self._tail = (self._tail + [token])[-max(len(w) for w in self._bad_words) :]
        if self._m is not None and self._m.is_terminated():
            # NOTE: the grammar is whole and its mask allows only EOS: with ignore_eos the
            # request runs on to max_tokens on EOS tokens (not shown), which is no error.
            return True
        is_allowed = self._m is None or bool(self.cost.call(self._m.accept_token, token))
        if not is_allowed and self._dead_end is None:
            # NOTE: made under a mask that allowed nothing (or past it): not an output to keep
            self._dead_end = f"{NO_WAY_ON}: token {token} was made, which it does not allow"
        return is_allowed
