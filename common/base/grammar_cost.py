"""What following a request's grammar costs the loop that runs its matcher.

xgrammar parses with an Earley parser: an ambiguous grammar (`root ::= root root | "a"`)
costs more with each token, about the square of the output so far, and all of it on a
node's loop, which every sequence in its batch waits on; a replay of the tokens so far (a
request that moved or was preempted) costs the sum. A compile within the frontend's limit
says nothing of this. The meter times each call into xgrammar in the calling thread's CPU
time (another process's load is not the grammar's) and names a grammar too costly once two
calls in a row pass MAX_CALL_S, its calls average more than MAX_MEAN_S from the
MIN_CALLS-th on, or a replay passes MAX_REPLAY_S. Ordinary grammars cost microseconds a
call, well under all three.
"""

from __future__ import annotations

import time
from typing import Callable

MAX_CALL_S = 0.05  # a mask or a token, twice in a row
# The mean from MIN_CALLS calls on. NOTE: a verify step makes up to 2k + 2 calls a row (its
# drafts' masks): a stall of k + 1 times this a step, at most, before the request ends.
MAX_MEAN_S = 0.002
MIN_CALLS = 64
MAX_REPLAY_S = 2.0  # to follow the tokens a request made before it moved or was preempted


class CostMeter:
    def __init__(self):
        self.num_calls = 0
        self.total_s = 0.0
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
        self._num_slow = self._num_slow + 1 if cost_s > MAX_CALL_S else 0
        if self.error is not None:
            return
        if self._num_slow >= 2:
            self._refuse(f"{cost_s * 1e3:.0f} ms of CPU for one token")
        elif self.num_calls >= MIN_CALLS and self.total_s > MAX_MEAN_S * self.num_calls:
            self._refuse(f"{self.total_s / self.num_calls * 1e3:.1f} ms of CPU a token")

    def _refuse(self, why: str) -> None:
        self.error = (
            f"the grammar costs too much to follow ({why} over {self.num_calls} masks and "
            f"tokens): an ambiguous grammar costs more with every token; write it so that each "
            f"text parses one way"
        )
