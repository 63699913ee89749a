"""The token budget of a prefill pass bounded in time (--max-pass-time).

NOTE: a pass is a stretch in which the node answers nothing; on a slow host the full
--token-budget would be tens of seconds, past its leases, and every prompt in it waits for
the whole pass. So the budget follows the rate measured: what this node computes in
--max-pass-time, within [MIN_PASS_TOKENS, --token-budget].
"""

from __future__ import annotations

from common.base.log import get_logger

MIN_PASS_TOKENS = 256  # a pass bounded in time still holds this many (a matmul's rate falls below)
log = get_logger("prefill")


class PassBudget:
    def __init__(self, token_budget: int, max_pass_s: float, block_size: int):
        self.max_tokens = token_budget  # --token-budget
        self.max_pass_s = max_pass_s  # <= 0: off, every pass may take max_tokens
        self.block_size = block_size
        self.rate: float | None = None  # prompt tokens/s of recent passes (smoothed)

    def seconds_for(self, num_tokens: int) -> float:
        """A prompt's expected prefill at the measured rate (0 until one is measured)."""
        return num_tokens / self.rate if self.rate else 0.0

    def after_pass(self, budget: int, num_tokens: int, elapsed_s: float) -> int:
        """The next passes' budget, once a pass of num_tokens took elapsed_s under budget."""
        if self.max_pass_s <= 0 or num_tokens < MIN_PASS_TOKENS // 4 or elapsed_s <= 0:
            return budget
        rate = num_tokens / elapsed_s
        self.rate = rate if self.rate is None else (self.rate + rate) / 2
        bs = self.block_size
        fit = int(self.rate * self.max_pass_s) // bs * bs
        new = max(min(fit, self.max_tokens), min(MIN_PASS_TOKENS, self.max_tokens))
        if abs(new - budget) * 4 >= budget:
            log.info(
                "token budget per pass %d -> %d (%.0f prompt tokens/s measured, passes of at most "
                "%.1fs)",
                budget,
                new,
                self.rate,
                self.max_pass_s,
            )
        return new
