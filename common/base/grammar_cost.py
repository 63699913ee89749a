"""What following a request's grammar costs the loop that runs its matcher.

xgrammar parses with an Earley parser: an ambiguous grammar (`root ::= root root | "a"`)
costs more with each token, about the square of the output so far, and all of it on a
node's loop, which every sequence in its batch waits on; a replay of the tokens so far (a
request that moved or was preempted) costs the sum. A compile within the frontend's limit
says nothing of this. The meter times each call into xgrammar in the calling thread's CPU
time (another process's load is not the grammar's) and names a grammar too costly once
- two calls in a row pass MAX_CALL_S, or
- its recent calls average more than MIN_SLOW_S and GROWTH times its first NUM_FIRST did
  (a cost that grows with the output; a grammar that is merely slow, the same all along,
  is not refused: a simple EBNF one over a 150k-token vocabulary costs ~2 ms a call), or
- a replay passes MAX_REPLAY_S (before a node that runs it counts as hung).
"""

from __future__ import annotations

import time
from typing import Callable

MAX_CALL_S = 0.05  # a mask or a token
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
        self._num_slow = 0  # calls in a row past MAX_CALL_S
        self.error: str | None = None  # set once, when the grammar is found too costly

    def call(self, fn: Callable, *args):
        """fn(*args), timed."""
        start = time.thread_time()
        try:
            return fn(*args)
        finally:
            self.add(time.thread_time() - start)

    def check_replay(self, num_tokens: int) -> None:
        """After a replay of num_tokens tokens: too costly past MAX_REPLAY_S in all."""
        if self.error is None and self.total_s > MAX_REPLAY_S:
            self._refuse(f"{self.total_s:.1f} s of CPU to follow its {num_tokens} tokens so far")

    def add(self, cost_s: float) -> None:
        """One call of cost_s seconds."""
        self.num_calls += 1
        self.total_s += cost_s
        if self.num_calls <= NUM_FIRST:
            self.first_s += cost_s
            self.recent_s = self.first_s / self.num_calls
        else:
            self.recent_s += RECENT * (cost_s - self.recent_s)
        self._num_slow = self._num_slow + 1 if cost_s > MAX_CALL_S else 0
        if self.error is not None:
            return
        first_mean_s = self.first_s / min(self.num_calls, NUM_FIRST)
        if self._num_slow >= 2:
            self._refuse(f"{cost_s * 1e3:.0f} ms of CPU for one token")
        elif (
            self.num_calls > 2 * NUM_FIRST
            and self.recent_s > MIN_SLOW_S
            and self.recent_s > GROWTH * first_mean_s
        ):
            self._refuse(
                f"{self.recent_s * 1e3:.1f} ms of CPU a token lately, "
                f"{first_mean_s * 1e3:.2f} ms at first"
            )

    def _refuse(self, why: str) -> None:
        self.error = (
            f"the grammar costs too much to follow ({why}, over {self.num_calls} masks and "
            f"tokens): an ambiguous grammar costs more with every token; write it so that each "
            f"text parses one way"
        )
