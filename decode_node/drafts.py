"""How many drafts the next decode step verifies: the k (0 included) expected to make the
most tokens a second, from each row's acceptance so far and each (batch size, k)'s
measured step time, so a load whose drafts do not pay runs plain steps.

Each row's acceptance p is the chance a draft is accepted given those before it were:
of a step that accepted a of its drafts, a were accepted and, where a < k, one was
tried and refused (a step that proposed none: one refused); p is the ratio of the two's
moving sums with PRIOR_TRIALS drafts more at the batch's rate (the same sums over every
row of its class, itself starting from PRIOR): one step's luck is no rate. Sampled rows
are a class apart from greedy ones (a draft matches a draw less often than an argmax),
and so are batches with a sampled row in their step times (a verify step samples each of
its positions), and batches with a row that has penalties or log-probabilities (each
position's are made). A verify step of k is
expected to make 1 + p + ... + p^k tokens in that row. A batch size's plain steps are
measured first; a step of one draft, until it is measured there, is reckoned to cost
what it did against plain steps at the nearest size measured, of the same kind of batch
if one is, else of another (the very first is tried); a step of more drafts, as those
two say, each draft alike. While plain steps win, a step of one draft (the cheapest) is
still tried now and then (a probe) to see whether acceptance has grown; the gap between
probes doubles with each, and starts over once verifying pays for that kind of batch
(greedy, sampled, costly), so a load that never matches pays for few; and where this
kind's verify steps are measured and none paid at this size since its last failed probe,
it is never so short that probes cost more than PROBE_SHARE of the plain steps' time (a
tiny model's verify step costs 2-20x a plain one: the host's work around it, most of it
indexing the tokens since the last probe; up to ~42x, where MAX_FLOOR_GAP caps that
floor). Doubling alone stops at MAX_PROBE_GAP: a cheap probe's gap stays short enough to
find drafts that start to match within a request's life.
Plain steps are counted per batch size and kind, since that bucket's own last verify step.
While verifying wins, a plain step now and then (a check) brings the plain steps' time up
to date: on cores shared with other work (a prefill node's) a time from before verifying
began may be twice today's. Checks come at gaps doubling from FIRST_CHECK_GAP verify steps
where the win is under CHECK_BELOW, and LONG_CHECK_GAP apart where it is larger (which a
time twice today's does not undo); a check weighs CHECK_WEIGHT in the plain time. No
verify step is reckoned cheaper than a plain one.
"""

from __future__ import annotations

PRIOR = 0.3  # a new row's acceptance, until it is measured
PRIOR_TRIALS = 2.0  # what PRIOR weighs against a row's own drafts
SMOOTHING = 0.3  # weight of a new measurement (acceptance and step times alike)
FIRST_PROBE_GAP = 16  # plain steps before the first probe
MAX_PROBE_GAP = 1024  # where gaps doubling from failed probes stop
MAX_FLOOR_GAP = 4096  # where the gap that keeps dear probes within PROBE_SHARE stops
PROBE_SHARE = 0.01  # a probe's time beyond a plain step's, at most this of the gap's
FIRST_CHECK_GAP = 16  # verify steps before the first plain step that checks they still pay
MAX_CHECK_GAP = 256  # where check gaps, doubling while verifying wins, stop
CHECK_BELOW = 2.0  # verifying that wins by less than this (tokens a second) is checked...
LONG_CHECK_GAP = 1024  # ...at gaps from FIRST_CHECK_GAP; a larger win only this far apart
# NOTE: a check's weight in the plain time: whole, one noisy step (~20-40% apart on shared
# cores) turned verifying off where it paid (a fake clock, times spread log-normally at
# sigma 0.4: 0.77 of the steps verified, 0.85 at half; test_draft_chooser.py)
CHECK_WEIGHT = 0.5
MARGIN = 0.03  # how much more verify steps must make a second than plain ones
RECHECK = 32  # plain steps between reckonings while plain steps win
MAX_AWAY = 1024  # rows' acceptance kept beyond the batch's before it is pruned


def _size(num_rows: int) -> int:
    """Batch sizes measured together: 1, 2, 3-4, 5-8, ..."""
    return 1 << max(num_rows - 1, 0).bit_length()


class DraftChooser:
    def __init__(self, max_k: int):
        self.max_k = max_k
        self.candidates = sorted({0, 1, max(max_k // 2, 1), max_k})
        self._acceptance: dict[str, tuple[float, float]] = {}  # (accepted, tried), decayed
        self._sampled: set[str] = set()  # rows that sample (the rest take the argmax)
        self._costly: set[str] = set()  # rows with penalties or log-probabilities
        self._pooled = [(0.0, 0.0), (0.0, 0.0)]  # the same over every greedy, sampled row
        # (batch size, (whether a row samples, one has penalties or logprobs)), k -> step time
        self._step_s: dict[tuple[tuple[int, tuple[bool, bool]], int], float] = {}
        self._is_warm: set = set()  # the kinds of step seen once (their first is not timed)
        # per kind of batch (sampled, costly): verifying that pays for greedy rows says
        # nothing of sampled ones' probes
        self._probe_gap: dict[tuple[bool, bool], int] = {}
        # (batch size, kind)s where a timed verify step made more tokens a second than plain
        # steps (by MARGIN), since their last failed probe
        self._has_paid: set[tuple[int, tuple[bool, bool]]] = set()
        # (batch size, kind) -> its plain steps since its own last verify step (NOTE: per
        # bucket: a size whose turns come between another's verify steps still probes)
        self._plain: dict[tuple[int, tuple[bool, bool]], int] = {}
        self._is_probing = False  # the last choice was a probe
        self._is_checking = False  # the last choice was a check (choose)
        self._verified: dict[tuple[int, tuple[bool, bool]], int] = {}  # since its last plain
        self._check_gap: dict[tuple[int, tuple[bool, bool]], int] = {}  # verify steps a check
        self._next_gap = FIRST_PROBE_GAP  # the probe gap after it, should it fail
        self._plain_until = (0, 0)  # (bucket, plain steps): plain until then (choose)
        self.num_probes = 0
        # the last batch's keys and bucket (NOTE: asked twice a step of the same rows; at
        # batch 32 is_resting and observe took 1.9 us a step with two set scans each, 0.9
        # us with it kept): rows joining or leaving a class clear it
        self._last: tuple[list[str], tuple[int, tuple[bool, bool]]] | None = None

    def join(
        self, key: str, is_sampled: bool, is_opted_out: bool = False, is_costly: bool = False
    ) -> None:
        """A row joins: whether it samples, whether its request takes no drafts (it counts
        as one that never accepts any), and whether it has penalties or log-probabilities
        (a verify step with such a row scores each position's: its times are apart)."""
        if is_sampled:
            self._sampled.add(key)
        if is_costly:
            self._costly.add(key)
        if is_opted_out:
            self._acceptance[key] = (0.0, float("inf"))
        self._last = None

    def forget(self, key: str) -> None:
        self._last = None
        self._acceptance.pop(key, None)
        self._sampled.discard(key)
        self._costly.discard(key)

    def _bucket(self, keys: list[str]) -> tuple[int, tuple[bool, bool]]:
        """Steps measured together: a batch size's, of a kind (a sampled row or none, a row
        with penalties or log-probabilities or none)."""
        last = self._last
        if last is not None and last[0] == keys:
            return last[1]
        kind = (not self._sampled.isdisjoint(keys), not self._costly.isdisjoint(keys))
        bucket = _size(len(keys)), kind
        self._last = list(keys), bucket  # NOTE: a copy: the caller's list may change
        return bucket

    def choose(self, keys: list[str], limit: int) -> int:
        """k for a step over these rows, at most limit (what the rows' blocks and lengths
        allow; 0 where the batch cannot be verified). NOTE: asked again before the step is
        observed, it answers the same and counts nothing twice."""
        self._is_probing = self._is_checking = False
        if limit <= 0 or not keys or self.is_resting(keys):
            return 0
        bucket = self._bucket(keys)
        plain_s, one_s = self._step_s.get((bucket, 0)), self._step_s.get((bucket, 1))
        if plain_s is None:
            return 0  # a plain step measures this size first
        is_own_kind = True  # whether one_s is this kind of batch's (else another's)
        if one_s is None:  # reckoned from the nearest size measured, or measured if none is
            near = self._nearest_ratio(bucket)
            if near is None:  # tried at once, then (where none was proposed) at probe gaps
                gap = self._probe_gap.get(bucket[1], 0)
                if self._plain.get(bucket, 0) < gap:
                    return 0
                self._is_probing = gap > 0
                self._next_gap = min(2 * gap, MAX_PROBE_GAP)
                return 1
            ratio, is_own_kind = near
            one_s = plain_s * ratio
        get, sampled = self._acceptance.get, self._sampled
        priors = [_ratio(pooled, PRIOR) for pooled in self._pooled]
        ps = [_ratio(get(key), priors[key in sampled]) for key in keys]
        # NOTE: verifying must beat plain steps by a margin: where no draft is accepted
        # the two cost alike at a small batch, and noise alone would pick either
        best_k, best_rate = 0, len(keys) / max(plain_s, 1e-9) * (1 + MARGIN)
        ks = sorted({min(k, limit) for k in self.candidates} - {0})
        costs = self._verify_costs(bucket, plain_s, one_s, ks)
        for k, made, step_s in zip(ks, _expected_tokens(ps, ks), costs):
            rate = made / max(step_s, 1e-9)
            if rate > best_rate:
                best_k, best_rate = k, rate
        kind = bucket[1]
        # NOTE: probes cost at most PROBE_SHARE of the plain steps' time where this kind's
        # verify steps are measured and none paid at this size since its last failed probe
        # (up to a verify step of ~42x a plain one: MAX_FLOOR_GAP); where one paid
        # (acceptance may come back), or their cost is another kind's (a guess), probes
        # come at gaps doubling from FIRST_PROBE_GAP
        is_bound = is_own_kind and bucket not in self._has_paid
        extra = (one_s - plain_s) / max(plain_s, 1e-9) / PROBE_SHARE  # in plain steps
        floor = min(max(int(extra) if is_bound else 0, FIRST_PROBE_GAP), MAX_FLOOR_GAP)
        # NOTE: the gap is kept per kind, the floor per size: a reset where verifying paid
        # at another size lets no dear probe through here
        gap = max(self._probe_gap.get(kind, floor), floor)
        if best_k:
            self._probe_gap[kind] = FIRST_PROBE_GAP  # verifying pays: probe soon once it stops
            # NOTE: a plain step now and then (a check): the plain time it is weighed against
            # is otherwise from before verifying began (on shared cores, maybe 2x today's);
            # a win of CHECK_BELOW or more holds against that, and is checked seldom
            is_close = best_rate * plain_s < CHECK_BELOW * len(keys)
            gap = self._check_gap.get(bucket, FIRST_CHECK_GAP) if is_close else LONG_CHECK_GAP
            self._is_checking = self._verified.get(bucket, 0) >= gap
            return 0 if self._is_checking else best_k
        self._check_gap.pop(bucket, None)  # plain steps win: checks start over
        num_plain = self._plain.get(bucket, 0)
        self._is_probing = num_plain >= gap
        if self._is_probing:  # should it fail, the next waits twice as long, and long enough
            # NOTE: not the floor: the gap is kept per kind and the floor is this size's
            # (each choose applies its own); stored, a dear size's would hold a cheap one's
            self._next_gap = min(2 * gap, MAX_PROBE_GAP)
        # NOTE: reckoned again after RECHECK more plain steps or at another batch size, the
        # probe's time included (the rows' acceptance changes only when they are verified)
        until = min(num_plain + RECHECK, gap)
        self._plain_until = (bucket, until) if not self._is_probing else (0, 0)
        return 1 if self._is_probing else 0

    def _verify_costs(
        self, bucket: tuple[int, tuple[bool, bool]], plain_s: float, one_s: float, ks: list[int]
    ) -> list[float]:
        """Each k of ks's step time: measured at this bucket where it is, else a plain step's
        and k drafts at the dearest a draft cost in one_s (one draft's, maybe reckoned from
        another size) or in the measured steps of ks. NOTE: never below a plain step's (a
        verify step does its work and more): a noisy CPU timed one below it, and drafts
        reckoned to save time were verified at any acceptance."""
        measured = {k: self._step_s[(bucket, k)] for k in ks if (bucket, k) in self._step_s}
        per_draft = max([one_s - plain_s, 0.0] + [(s - plain_s) / k for k, s in measured.items()])
        return [max(measured.get(k, plain_s + k * per_draft), plain_s) for k in ks]

    def _nearest_ratio(self, bucket: tuple[int, tuple[bool, bool]]) -> tuple[float, bool] | None:
        """A step of one draft's time over a plain step's at the nearest batch size that has
        both measured, of the same kind of batch if one has, else of any (the larger of
        two as near: the dearer), and whether it is the same kind's; None if none has."""
        size, kind = bucket
        measured = [b for b, k in self._step_s if k == 1 and (b, 0) in self._step_s]
        if not measured:
            return None
        near = min(
            measured,
            key=lambda b: (b[1] != kind, abs(b[0].bit_length() - size.bit_length()), -b[0]),
        )
        return self._step_s[(near, 1)] / max(self._step_s[(near, 0)], 1e-9), near[1] == kind

    @property
    def is_checking(self) -> bool:
        """The last choice was a check: the next step is chosen once it is observed."""
        return self._is_checking

    def is_resting(self, keys: list[str]) -> bool:
        """Plain steps won lately for a batch like this one and nothing was verified since:
        the next step is plain, unreckoned (and what limits its drafts need not be asked)."""
        until = self._plain_until
        bucket = self._bucket(keys)
        return until[0] == bucket and self._plain.get(bucket, 0) < until[1]

    def observe_none_proposed(self, keys: list[str], k: int) -> None:
        """A step chosen to verify k drafts found none in any row (the host proposes them
        before its launch) and runs plain, observed as one: each row refused a draft, and a
        probe failed (the next waits twice as long)."""
        bucket = self._bucket(keys)
        self._learn_acceptance(keys, k, [0] * len(keys))
        if self._is_probing:
            self._probe_gap[bucket[1]] = self._next_gap
            self.num_probes += 1
            self._is_probing = False
        elif not self._probe_gap.get(bucket[1]):
            # NOTE: a first try (no step of one draft timed anywhere), or the try again after
            # an untimed probe that found drafts (a gap of 0: observe): probes from now on
            self._probe_gap[bucket[1]] = FIRST_PROBE_GAP
        self._plain[bucket] = 0  # NOTE: the next probe's gap counts from this one

    def observe(self, keys: list[str], k: int, step_s: float, accepted: list[int]) -> None:
        """A collected step of k drafts over these rows took step_s; accepted: each row's
        accepted drafts (a verify step's)."""
        key = (self._bucket(keys), k)
        old = self._step_s.get(key)
        is_timed = key in self._is_warm
        if not is_timed:
            # NOTE: a kind of step's first pays for its set-up (a kernel's first call at its
            # shapes, an empty index's growth: 136 against 48 ms at Qwen3-0.6B's shape):
            # not its time
            self._is_warm.add(key)
        elif self._is_checking and k == 0:  # today's plain time weighs more than one step's
            self._step_s[key] = step_s if old is None else old + CHECK_WEIGHT * (step_s - old)
            gap = self._check_gap.get(key[0], FIRST_CHECK_GAP)
            self._check_gap[key[0]] = min(2 * gap, MAX_CHECK_GAP)
        else:
            self._step_s[key] = step_s if old is None else old + SMOOTHING * (step_s - old)
        if max(len(self._acceptance), len(self._sampled), len(self._costly)) > len(keys) + MAX_AWAY:
            # NOTE: rows that left without forget() (a preempted request aborted): dropped
            # here, with those merely preempted, which start over at their class's rate
            # (a resume joins again: its class is known)
            self._acceptance = {
                key: self._acceptance[key] for key in keys if key in self._acceptance
            }
            self._sampled.intersection_update(keys)
            self._costly.intersection_update(keys)
        if k == 0:
            self._plain[key[0]] = self._plain.get(key[0], 0) + 1
            self._verified[key[0]] = 0
            self._is_checking = False
            return
        self._verified[key[0]] = self._verified.get(key[0], 0) + 1
        self._plain_until = (0, 0)
        plain_s = self._step_s.get((key[0], 0))
        is_paid = key[0] in self._has_paid  # NOTE: where this step's own gain is unknown
        if plain_s is not None and is_timed:  # whether verifying paid here (probe gaps)
            # NOTE: a step timed below a plain one costs a plain one's (_verify_costs)
            gain = (len(keys) + sum(accepted)) / len(keys) * plain_s / max(step_s, plain_s, 1e-12)
            is_paid = gain > 1 + MARGIN
            if is_paid:
                self._has_paid.add(key[0])
            elif self._is_probing and gain < 1:  # a probe that lost to plain steps
                self._has_paid.discard(key[0])
        if self._is_probing:  # the next probe of this kind waits longer (choose) unless it paid
            gap = FIRST_PROBE_GAP if is_paid else self._next_gap
            # NOTE: an untimed probe (its kind's first) whose drafts were taken: whether it
            # paid is unknown; tried again soon (timed), not a doubled gap later: on the next
            # step where no size has a step of one draft timed (choose), else at the floor
            self._probe_gap[key[0][1]] = 0 if not is_timed and sum(accepted) else gap
            self.num_probes += 1
            self._is_probing = False
        self._learn_acceptance(keys, k, accepted)
        self._plain[key[0]] = 0

    def _learn_acceptance(self, keys: list[str], k: int, accepted: list[int]) -> None:
        """Each row's drafts of a step of k, and its class's: a accepted, one refused where
        a < k."""
        keep = 1 - SMOOTHING
        sums = [[0, 0], [0, 0]]  # accepted, tried: greedy rows', sampled rows'
        for row_key, a in zip(keys, accepted):
            won, tried = self._acceptance.get(row_key, (0.0, 0.0))
            self._acceptance[row_key] = (keep * won + a, keep * tried + a + (a < k))
            pooled = sums[row_key in self._sampled]
            pooled[0], pooled[1] = pooled[0] + a, pooled[1] + a + (a < k)
        for i, (won, tried) in enumerate(sums):
            if tried:  # NOTE: a class with no row here keeps its rate as it was
                old_won, old_tried = self._pooled[i]
                self._pooled[i] = (keep * old_won + won, keep * old_tried + tried)


def _ratio(counts: tuple[float, float] | None, prior: float) -> float:
    """An acceptance from (accepted, tried) sums and PRIOR_TRIALS drafts at prior."""
    won, tried = counts or (0.0, 0.0)
    return (won + prior * PRIOR_TRIALS) / (tried + PRIOR_TRIALS)


def _expected_tokens(ps: list[float], ks: list[int]) -> list[float]:
    """The rows' tokens from a step of k drafts, for each k of ks: 1 + p + ... + p^k a row,
    each of its drafts accepted with its p (in [0, 1]). NOTE: plain Python: numpy's calls
    on a few rows, cold after a forward, cost a tiny model's choose ~80 us (~2% of its
    plain steps' time when it reckoned every 8 steps)."""
    ps = [min(p, 1 - 1e-9) for p in ps]  # NOTE: the closed form divides by 1 - p
    return [sum((1 - p ** (k + 1)) / (1 - p) for p in ps) for k in ks]
