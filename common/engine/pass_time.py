"""How long a prefill pass on a host's shared cores should take, for the decode steps that
wait for it (cores.py writes its predicted end into the host's table): a node's passes
cost about the same core-seconds a prompt token, measured over each pass at the cores it
held as they changed (a pass that shrank to one core is not taken for a slow one)."""

from __future__ import annotations


class PassTime:
    def __init__(self):
        self.token_cost_s: float | None = None  # core-seconds a token (smoothed); None: unknown
        self.num_tokens = 0  # of the pass under way (0: none)
        self._core_s = 0.0  # core-seconds it has run
        self._left_s = 0.0  # core-seconds predicted still to run
        self._cores = 0  # it runs on now (0: paused)
        self._since = 0.0  # when that changed

    @property
    def is_running(self) -> bool:
        return self.num_tokens > 0

    def begin(self, num_tokens: int, cores: int, now: float) -> float:
        """A pass of num_tokens on cores; its predicted end (0: not known)."""
        self.num_tokens = num_tokens
        self._core_s, self._cores, self._since = 0.0, cores, now
        cost = self.token_cost_s
        self._left_s = -1.0 if cost is None else num_tokens * cost
        return self._end(now)

    def resize(self, cores: int, now: float) -> float:
        """It runs on cores from now; its predicted end (0: not known)."""
        ran = self._cores * (now - self._since)
        self._core_s += ran
        if self._left_s >= 0:
            self._left_s = max(self._left_s - ran, 0.0)
        self._cores, self._since = cores, now
        return self._end(now)

    def resume(self, stopped_at: float, cores: int, now: float) -> float:
        """Its node stopped at stopped_at (its last layer) and runs again now on cores: the
        time between ran nothing. Its predicted end (0: not known)."""
        self.resize(0, max(stopped_at, self._since))
        return self.resize(cores, now)

    def end(self, now: float) -> None:
        """The pass ended: its cost a token, into the node's rate."""
        core_s = self._core_s + self._cores * (now - self._since)
        if self.num_tokens and core_s > 0:
            cost = core_s / self.num_tokens
            old = self.token_cost_s
            self.token_cost_s = cost if old is None else (old + cost) / 2
        self.num_tokens = 0

    def _end(self, now: float) -> float:
        if self._left_s < 0 or not self._cores:
            return 0.0
        return now + self._left_s / self._cores
