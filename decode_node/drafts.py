"""How many drafts the next decode step verifies: the k (0 included) expected to make the
most tokens a second, from each row's acceptance so far and each (batch size, k)'s
measured step time, so a load whose drafts do not pay runs plain steps.

Each row's acceptance p is the chance a draft is accepted given those before it were:
of a step that accepted a of its drafts, a were accepted and, where a < k, one was
tried and refused (a step that proposed none: one refused); p is the ratio of the two's
moving sums. A verify step of k is expected to make 1 + p + ... + p^k tokens in that
row. A (batch size, k) not yet measured is tried once. While plain steps win, a verify
step of one draft (the cheapest) is still tried now and then (a probe) to see whether
acceptance has grown; the gap between probes doubles each time one accepts nothing, so
a load that never matches pays for few.
"""

from __future__ import annotations

import numpy as np

PRIOR = 0.3  # a new row's acceptance, until it is measured
SMOOTHING = 0.3  # weight of a new measurement (acceptance and step times alike)
FIRST_PROBE_GAP = 16  # plain steps before the first probe
MAX_PROBE_GAP = 1024


def _bucket(num_rows: int) -> int:
    """Batch sizes measured together: 1, 2, 3-4, 5-8, ..."""
    return 1 << max(num_rows - 1, 0).bit_length()


class DraftChooser:
    def __init__(self, max_k: int):
        self.max_k = max_k
        self.candidates = sorted({0, 1, max(max_k // 2, 1), max_k})
        self._acceptance: dict[str, tuple[float, float]] = {}  # (accepted, tried), decayed
        self._step_s: dict[tuple[int, int], float] = {}
        self._probe_gap = FIRST_PROBE_GAP
        self._num_plain = 0  # plain steps since the last verify step
        self._is_probe = False
        self.num_probes = 0

    def forget(self, key: str) -> None:
        self._acceptance.pop(key, None)

    def opt_out(self, key: str) -> None:
        """The row's request takes no drafts: it counts as one that never accepts any."""
        self._acceptance[key] = (0.0, float("inf"))

    def choose(self, keys: list[str], limit: int) -> int:
        """k for a step over these rows, at most limit (what the rows' blocks and lengths
        allow; 0 where the batch cannot be verified)."""
        self._is_probe = False
        if limit <= 0 or not keys:
            return 0
        bucket = _bucket(len(keys))
        get = self._acceptance.get
        ps = np.fromiter((_ratio(get(key)) for key in keys), np.float64, len(keys))
        best_k, best_rate = 0, 0.0
        for k in sorted({min(k, limit) for k in self.candidates}):
            step_s = self._step_s.get((bucket, k))
            if step_s is None:
                return k  # never measured at this size: measure it
            tokens = _expected_tokens(ps, k)
            if tokens / step_s > best_rate:
                best_k, best_rate = k, tokens / step_s
        if best_k == 0 and self._num_plain >= self._probe_gap:
            self._is_probe = True
            self.num_probes += 1
            return 1
        return best_k

    def observe(self, keys: list[str], k: int, step_s: float, accepted: list[int]) -> None:
        """A collected step of k drafts over these rows took step_s; accepted: each row's
        accepted drafts (a verify step's)."""
        key = (_bucket(len(keys)), k)
        old = self._step_s.get(key)
        self._step_s[key] = step_s if old is None else old + SMOOTHING * (step_s - old)
        if k == 0:
            self._num_plain += 1
            return
        is_won = False
        keep = 1 - SMOOTHING
        for row_key, a in zip(keys, accepted):
            won, tried = self._acceptance.get(row_key, (0.0, 0.0))
            self._acceptance[row_key] = (keep * won + a, keep * tried + a + (a < k))
            is_won |= a > 0
        if self._is_probe:
            # NOTE: a probe that accepted nothing doubles the gap; one that did starts over.
            self._probe_gap = FIRST_PROBE_GAP if is_won else min(2 * self._probe_gap, MAX_PROBE_GAP)
        self._num_plain = 0


def _ratio(counts: tuple[float, float] | None) -> float:
    """A row's acceptance from its (accepted, tried) sums; PRIOR before any."""
    return PRIOR if counts is None or counts[1] <= 0 else counts[0] / counts[1]


def _expected_tokens(ps: np.ndarray, k: int) -> float:
    """The rows' tokens from a step of k drafts: 1 + p + ... + p^k a row, each of its
    drafts accepted with its p ([n] in [0, 1])."""
    ps = np.minimum(ps, 1 - 1e-9)  # NOTE: the closed form divides by 1 - p
    return float(np.sum((1 - ps ** (k + 1)) / (1 - ps)))
