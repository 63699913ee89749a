"""What following a request's grammar costs the loop that runs its matcher.

xgrammar parses with an Earley parser: an ambiguous grammar (`root ::= root root | "a"`)
costs more with each token, about the square of the output so far, and all of it on a
node's loop, which every sequence in its batch waits on; a replay of the tokens so far (a
request that moved or was preempted) costs the sum. Some grammars cost much all along (a
word's character class at the start of each sentence, over a vocabulary of 150k tokens:
~100 ms a mask). A compile within the frontend's limit says nothing of either. The meter
times each call into xgrammar in the calling thread's CPU time (another process's load is
not the grammar's) and names a grammar too costly once
- one call passes MAX_CALL_S (an ambiguous grammar over a vocabulary with tokens of a
  hundred spaces went from 1 s to 4.5 s a call: the next is not waited for), or
- its calls cost more than MAX_MEAN_S each on average, beyond ALLOWANCE_S in all
  (ordinary grammars cost 0.01-2.5 ms a call), or
- its recent calls average more than MIN_SLOW_S and GROWTH times its first NUM_FIRST did:
  a cost that grows with the output, found well before the mean passes its limit, or
- a replay passes MAX_REPLAY_S (before a node that runs it counts as hung).
NOTE: a call is judged once it has returned: one call's stall is bounded only by how much
more it costs than the one before. Each node that takes a request over meters it afresh.
"""

from __future__ import annotations

import time
from typing import Callable

MAX_CALL_S = 0.25  # one mask or token (a word's start over 150k tokens: ~0.1 s)
MAX_MEAN_S = 0.01  # a mask or a token, on average
ALLOWANCE_S = 2.0  # what a request's calls may take beyond MAX_MEAN_S each
# NOTE: a verify step makes up to 2k + 2 calls a row (its drafts' masks): the stall a step
# before a growing cost is refused is up to k + 1 times that of a plain step.
MIN_SLOW_S = 0.01
GROWTH = 4.0
NUM_FIRST = 64  # the first calls: what the grammar costs before its output grows
RECENT = 1 / 32  # each call's weight in the recent mean (a moving average)
MAX_REPLAY_S = 20.0  # under --hung-after's default of 30 s


class CostMeter:
    def __init__(self):
        self.num_calls = 0
        self.total_s = 0.0
        self.first_s = 0.0  # the first NUM_FIRST calls'
        self.recent_s = 0.0  # the recent calls' mean
        self.error: str | None = None  # set once, when the grammar is found too costly

    def call(self, fn: Callable, *args):
        """fn(*args), timed."""
        start = time.thread_time()
        try:
            return fn(*args)
        finally:
            self.add(time.thread_time() - start)

    def check_replay(self, num_tokens: int) -> None:
        """During a replay, num_tokens tokens into it: too costly past MAX_REPLAY_S in all."""
        if self.error is None and self.total_s > MAX_REPLAY_S:
            self._refuse(
                f"{self.total_s:.1f} s of CPU to follow its first {num_tokens} tokens again",
                f"at most {MAX_REPLAY_S:.0f} s",
            )

    def add(self, cost_s: float) -> None:
        """One call of cost_s seconds."""
        self.num_calls += 1
        self.total_s += cost_s
        if self.num_calls <= NUM_FIRST:
            self.first_s += cost_s
            self.recent_s = self.first_s / self.num_calls
        else:
            self.recent_s += RECENT * (cost_s - self.recent_s)
        if self.error is not None:
            return
        first_mean_s = self.first_s / min(self.num_calls, NUM_FIRST)
        if cost_s > MAX_CALL_S:
            self._refuse(
                f"{cost_s * 1e3:.0f} ms of CPU for one mask or token",
                f"at most {MAX_CALL_S * 1e3:.0f} ms",
            )
        elif self.total_s > ALLOWANCE_S + MAX_MEAN_S * self.num_calls:
            self._refuse(
                f"{self.total_s / self.num_calls * 1e3:.1f} ms of CPU a mask or token",
                f"at most {MAX_MEAN_S * 1e3:.0f} ms on average",
            )
        elif (
            self.num_calls > 2 * NUM_FIRST
            and self.recent_s > MIN_SLOW_S
            and self.recent_s > GROWTH * first_mean_s
        ):
            self._refuse(
                f"{self.recent_s * 1e3:.1f} ms of CPU a mask or token lately, "
                f"{first_mean_s * 1e3:.2f} ms at first",
                "a cost that grows with the output, as an ambiguous grammar's does",
            )

    def _refuse(self, why: str, limit: str) -> None:
        self.error = (
            f"the grammar costs too much to follow: {why}, over {self.num_calls} masks and "
            f"tokens ({limit}); the rest of the batch waits on it"
        )
