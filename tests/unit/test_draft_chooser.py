"""The decode node's draft chooser on a fake clock: which k each step verifies, from the
rows' acceptance and each batch size's step times; probes while plain steps win, checks
while verifying does; timing noise and stale times that must not turn it on."""

import random

from decode_node.drafts import FIRST_PROBE_GAP, LONG_CHECK_GAP, PROBE_SHARE, DraftChooser


def _geometric(rng: random.Random, p: float):
    """Drafts accepted one after another, each with p, until one is not."""

    def accept(k: int) -> int:
        a = 0
        while a < k and rng.random() < p:
            a += 1
        return a

    return accept


def _run_chooser(chooser, steps: int, cost, accept, rows: int = 4) -> list[int]:
    """steps decode steps of `rows` rows on a fake clock: a step of k costs cost(k) and each
    row accepts accept(k) of its drafts; -> the k of each step."""
    return _run_chooser_on(chooser, [f"r{i}" for i in range(rows)], steps, cost, accept)


def _run_chooser_on(chooser, keys: list[str], steps: int, cost, accept) -> list[int]:
    chosen = []
    for _ in range(steps):
        k = chooser.choose(keys, 4)
        assert chooser.choose(keys, 4) == k  # asked twice (run ahead, then launch): the same
        chooser.observe(keys, k, cost(k), [accept(k) for _ in keys])
        chosen.append(k)
    return chosen


def test_the_chooser_turns_speculation_down_where_drafts_never_match():
    chooser = DraftChooser(4)
    chosen = _run_chooser(chooser, 2000, lambda k: 1.0 + 0.3 * k, lambda k: 0)
    # plain and one draft measured (each kind's first step untimed), then probes of one
    # draft at gaps doubling from what keeps them within PROBE_SHARE (30 steps)
    assert chosen[:4] == [0, 0, 1, 1] and set(chosen) == {0, 1}
    assert chooser.num_probes == chosen[4:].count(1)
    verified = [i for i, k in enumerate(chosen) if k]
    gaps = [b - a for a, b in zip(verified[1:], verified[2:])]
    assert gaps[0] == 31 and all(b == 2 * a - 1 for a, b in zip(gaps, gaps[1:]))
    assert sum(k > 0 for k in chosen) <= 2 + 6


def test_the_chooser_does_not_time_a_kind_of_steps_first():
    """Found measuring: the first verify step at a batch size took 136 ms against 48 (a
    kernel's first call at its shapes, the index's first growth); smoothed in, it held the
    estimate at 2.5x a plain step's and speculation off where drafts paid."""
    chooser, keys = DraftChooser(4), ["r0", "r1"]
    for k, first_s, then_s in ((0, 10.0, 1.0), (1, 11.0, 1.1)):
        chooser.observe(keys, k, first_s, [k, k])
        chooser.observe(keys, k, then_s, [k, k])
    assert chooser._step_s == {((2, (False, False)), 0): 1.0, ((2, (False, False)), 1): 1.1}
    assert chooser.choose(keys, 4) == 4  # all right at a tenth of a step a draft


def test_the_chooser_reckons_a_new_batch_size_from_the_nearest_measured():
    """A node's batch passes through many sizes: trying drafts once at each cost a fresh
    node 15% of its TPOT in a short serving run. A size not measured is reckoned from the
    nearest one that is."""
    chooser = DraftChooser(4)
    _run_chooser(chooser, 200, lambda k: 1.0 + 1.0 * k, lambda k: 0, rows=1)
    at_16 = _run_chooser(chooser, 12, lambda k: 16.0 * (1.0 + 1.0 * k), lambda k: 0, rows=16)
    assert at_16 == [0] * 12  # a draft doubled a step at 1 row: none tried at 16


def test_the_chooser_forgets_rows_that_left_unannounced():
    chooser = DraftChooser(4)
    for i in range(3000):  # requests that leave without forget(): aborted while preempted
        chooser.join(f"gone{i}", is_sampled=True)
        chooser.observe([f"gone{i}"], 1 if i < 1500 else 0, 1.0, [1] if i < 1500 else [])
    # plain steps too: a load that seldom verifies leaks nothing either
    assert len(chooser._acceptance) <= 1 + 1024 and len(chooser._sampled) <= 1 + 1024
    # a row still running keeps its class; one that comes back (a resume) joins again
    chooser.observe(["gone2999"], 0, 1.0, [])
    assert "gone2999" in chooser._sampled


def test_the_chooser_verifies_where_drafts_pay_and_as_many_as_pay():
    # every draft accepted, a draft costs a tenth of a step: the most drafts
    every = _run_chooser(DraftChooser(4), 200, lambda k: 1.0 + 0.1 * k, lambda k: k)
    assert every[-100:] == [4] * 100  # a win of 3.6x: no plain step checks it
    # each draft accepted with p = 0.7, a draft costs half a step: one or two pay (1.7
    # tokens for 1.5, 2.19 for 2), four do not (2.77 for 3)
    geometric = _geometric(random.Random(0), 0.7)
    some = _run_chooser(DraftChooser(4), 400, lambda k: 1.0 + 0.5 * k, geometric, rows=16)
    assert sum(k in (1, 2) for k in some[-100:]) > 80 and 4 not in some[-100:]
    # acceptance that comes later is found by a probe
    late = iter([0] * 100 + [4] * 10**6)
    chosen = _run_chooser(
        DraftChooser(4), 400, lambda k: 1.0 + 0.1 * k, lambda k: min(next(late), k)
    )
    assert chosen[-50:] == [4] * 50


def test_the_chooser_keeps_sampled_rows_and_their_steps_apart_from_greedy_ones():
    """Greedy rows whose drafts all match say nothing of sampled rows' (a draw matches less
    often), nor do greedy steps' times of steps with a sampled row (each of a verify step's
    positions is sampled): a sampled load that follows starts from its own class."""
    chooser = DraftChooser(4)
    greedy = _run_chooser(chooser, 100, lambda k: 1.0 + 0.1 * k, lambda k: k)
    assert greedy[-50:] == [4] * 50
    for key in (f"r{i}" for i in range(4)):
        chooser.forget(key)
    # Sampled rows: nothing accepted, and a verify step dear. The first of them are tried
    # (their class has no rate of its own yet); the next ones start from that.
    keys = [f"s{i}" for i in range(4)]
    for key in keys:
        chooser.join(key, is_sampled=True)
    first = _run_chooser_on(chooser, keys, 60, lambda k: 1.5 + 1.0 * k, lambda k: 0)
    assert 0 < sum(k > 0 for k in first) <= 6
    for key in keys:
        chooser.forget(key)
    later = [f"t{i}" for i in range(4)]
    for key in later:
        chooser.join(key, is_sampled=True)
    chosen = _run_chooser_on(chooser, later, 60, lambda k: 1.5 + 1.0 * k, lambda k: 0)
    assert sum(k > 0 for k in chosen) <= 3  # probes at most
    # A greedy batch still verifies at once: its class's rate and step times are its own.
    back = [f"g{i}" for i in range(4)]
    assert chooser.choose(back, 4) == 4


def test_the_chooser_times_steps_with_a_costly_row_apart():
    """A verify step with a row that has penalties or log-probabilities scores each of its
    positions' (many times a plain verify step's work): its times do not stand for a
    plain batch's, nor the other way round."""
    chooser = DraftChooser(4)
    cheap = _run_chooser(chooser, 100, lambda k: 1.0 + 0.1 * k, lambda k: k)
    assert cheap[-20:] == [4] * 20
    keys = ["r0", "r1", "r2", "c"]
    chooser.join("c", is_sampled=False, is_costly=True)
    costly = _run_chooser_on(chooser, keys, 60, lambda k: 1.0 + 2.0 * k, lambda k: k // 2)
    assert costly[0] == 0 and costly[-20:].count(0) >= 18  # measured plain first, then dear
    chooser.forget("c")
    assert chooser.choose(["r0", "r1", "r2", "r3"], 4) == 4  # the plain batch's own times


def test_a_sampled_loads_probes_keep_their_gaps_while_greedy_rows_verify():
    """Probes of one draft come at gaps that double while they fail; verifying that pays
    for greedy rows (a load of both in turn) starts the gap over for greedy batches alone."""
    chooser = DraftChooser(4)
    greedy, sampled = ["g0", "g1"], ["s0", "s1"]
    for key in sampled:
        chooser.join(key, is_sampled=True)
    chosen = []
    for _ in range(40):  # in turn: 5 greedy steps (drafts all right), 20 sampled (none)
        _run_chooser_on(chooser, greedy, 5, lambda k: 1.0 + 0.1 * k, lambda k: k)
        chosen += _run_chooser_on(chooser, sampled, 20, lambda k: 1.0 + 0.5 * k, lambda k: 0)
    assert sum(k > 0 for k in chosen[-400:]) <= 4  # 800 sampled steps: gaps of 50 doubling


def test_probes_where_a_verify_step_is_dear_cost_at_most_a_share_of_plain_steps():
    """A tiny model's verify step costs 2-20x a plain one (the host's work around it): probes
    16 steps apart cost 5% and more of a load whose drafts never match. Where verifying
    never paid, a probe waits at least as many plain steps as it costs over PROBE_SHARE;
    where it paid, probes come soon after it stops paying."""
    chooser = DraftChooser(4)
    chosen = _run_chooser(chooser, 3000, lambda k: 1.0 + 0.8 * k, lambda k: 0, rows=1)
    verified = [i for i, k in enumerate(chosen) if k]
    gaps = [b - a for a, b in zip(verified, verified[1:])]
    # plain steps, then one draft measured (the first of each untimed), then probes
    assert verified[:2] == [2, 3] and all(g > 0.8 / PROBE_SHARE for g in gaps[1:])
    assert len(gaps) >= 4
    assert 0.8 * len(verified[2:]) / (len(chosen) - verified[1]) <= PROBE_SHARE
    # where one draft costs a tenth more, the gaps double from FIRST_PROBE_GAP as before
    cheap = _run_chooser(DraftChooser(4), 200, lambda k: 1.0 + 0.1 * k, lambda k: 0, rows=1)
    assert [i for i, k in enumerate(cheap) if k][:4] == [2, 3, 20, 53]
    # drafts that paid, then stopped: probes at gaps doubling from FIRST_PROBE_GAP (30 steps
    # would keep them within PROBE_SHARE)
    late = iter([4] * 100 + [0] * 10**6)
    paid = _run_chooser(
        DraftChooser(4), 300, lambda k: 1.0 + 0.3 * k, lambda k: min(next(late), k), rows=1
    )
    verified = [i for i, k in enumerate(paid) if k]
    assert paid[100] == 4 and [b - a for a, b in zip(verified, verified[1:])][-3:] == [17, 33, 65]


def test_a_kind_of_batch_never_verified_is_reckoned_from_another_kinds_steps():
    """Sampled rows' first batch has no verify step of its own measured: where greedy
    batches' say a draft is dear, it runs plain steps but for probes (trying drafts at
    once cost the tiny model two verify steps, the first untimed, a new kind of batch).
    Its probes come at gaps doubling from FIRST_PROBE_GAP until its own cost is measured
    (another kind's is a guess), then at gaps that keep them within PROBE_SHARE."""
    chooser = DraftChooser(4)
    _run_chooser(chooser, 40, lambda k: 1.0 + 0.8 * k, lambda k: 0)
    keys = [f"s{i}" for i in range(4)]
    for key in keys:
        chooser.join(key, is_sampled=True)
    chosen = _run_chooser_on(chooser, keys, 300, lambda k: 1.2 + 1.0 * k, lambda k: 0)
    verified = [i for i, k in enumerate(chosen) if k]
    # plain steps (measured, then counted for this batch's kind alone), then a probe, untimed
    assert verified[0] == FIRST_PROBE_GAP
    gaps = [b - a for a, b in zip(verified, verified[1:])]
    assert gaps[0] == 2 * FIRST_PROBE_GAP + 1  # the first probe untimed: its cost a guess
    assert all(g > 1.0 / 1.2 / PROBE_SHARE for g in gaps[1:]) and len(verified) == 3


def test_probes_stay_within_their_share_at_a_size_where_verifying_never_paid():
    """Found in review: a kind marked as paying from an estimate (another size's cheap
    verify step and the prior acceptance) kept probing every 16-64 steps at a size where a
    verify step cost 4x, for the node's life. Whether verifying paid is measured, per
    batch size."""
    chooser = DraftChooser(4)
    alone = _run_chooser(chooser, 50, lambda k: 1.0 + 0.1 * k, lambda k: 0, rows=1)
    assert 1 in alone
    chooser.forget("r0")
    at_8 = _run_chooser(chooser, 400, lambda k: 1.0 + 3.0 * k, lambda k: 0, rows=8)
    # its own cost measured (by the second probe, the first untimed), probes keep their share
    # (the estimate's mark: probes at 117 and 246, 1.8%)
    after = at_8[60:]
    assert sum(3.0 * k for k in after) / len(after) <= PROBE_SHARE


def test_probes_keep_their_share_at_a_size_while_another_size_verifies():
    """Found in review: the probe gap is kept per kind of batch and verifying that paid at
    one size (a row alone, drafts all right) set it back to 16 for every size: a batch of 8,
    where a verify step costs 4x and nothing matches, probed 16 steps into each of its
    turns (15% of its time in turns of 20 steps)."""
    chooser = DraftChooser(4)
    alone, eight = ["a"], [f"r{i}" for i in range(8)]
    at_8 = []
    for _ in range(30):
        _run_chooser_on(chooser, alone, 20, lambda k: 1.0 + 0.1 * k, lambda k: k)
        at_8 += _run_chooser_on(chooser, eight, 40, lambda k: 1.0 + 3.0 * k, lambda k: 0)
    later = at_8[400:]  # its own cost and pay measured
    assert sum(3.0 * k for k in later) / len(later) <= PROBE_SHARE


def test_a_size_whose_turns_come_between_anothers_verify_steps_still_finds_its_drafts():
    """Found in review: plain steps were counted since any verify step, so a batch of 8
    (a verify step dear: 1.8x) taking turns of 40 steps with a row alone that verified never
    reached its probe gap and never found the drafts that matched later. A probe that
    pays brings the next soon."""
    chooser = DraftChooser(4)
    alone, eight = ["a"], [f"r{i}" for i in range(8)]
    turns = iter([0] * 30 + [4] * 10**6)
    at_8 = []
    for _ in range(60):
        _run_chooser_on(chooser, alone, 20, lambda k: 1.0 + 0.1 * k, lambda k: k)
        accept = next(turns)
        at_8 += _run_chooser_on(
            chooser, eight, 40, lambda k: 1.0 + 0.8 * k, lambda k: min(accept, k)
        )
    assert sum(k > 0 for k in at_8[: 30 * 40]) <= 30 * 40 * PROBE_SHARE / 0.8 + 2
    assert sum(k > 0 for k in at_8[-400:]) > 300  # found, and verified from then on


def test_a_probe_that_only_breaks_even_where_drafts_once_paid_does_not_bring_the_next_soon():
    """Review: a probe whose gain was between 1 and 1 + MARGIN at a size where verifying had
    paid set the next probe FIRST_PROBE_GAP steps on, forever (the size stayed marked as
    paid): probes every 17 steps that never pay. Only a probe that pays brings the next
    soon; one that breaks even waits longer, as one that loses does."""
    chooser = DraftChooser(4)
    keys = ["r0", "r1", "r2", "r3"]
    verified = []
    for step in range(1500):
        k = chooser.choose(keys, 4)
        # 100 steps where every draft is right, then one row's first draft alone: a probe
        # of one draft makes 5 tokens where 4 plain steps' rows make 4, at 1.24x the time
        accepted = [k] * 4 if step < 100 else [min(k, 1), 0, 0, 0]
        chooser.observe(keys, k, 1.0 + 0.24 * k, accepted)
        if k and step >= 100:
            verified.append(step)
    gaps = [b - a for a, b in zip(verified, verified[1:])]
    assert len(gaps) >= 3 and gaps[-1] > 2 * FIRST_PROBE_GAP and gaps[-1] >= 2 * gaps[-3]


def test_a_verify_step_timed_below_a_plain_one_is_not_reckoned_to_save_time():
    """Found serving on two shared cores: a verify step timed 3% below the plain steps
    (noise: the prefill node's work came and went) made more drafts reckon cheaper still,
    and the node verified at any acceptance (TPOT 1.5x in a saturated run)."""
    chooser = DraftChooser(4)
    chosen = _run_chooser(chooser, 1000, lambda k: 0.9 if k else 1.0, lambda k: 0)
    assert sum(k > 0 for k in chosen[-500:]) <= 6  # probes at most


def _run_after_busy_plain_steps(plain_s: float, steps: int, cost, accept) -> list[int]:
    """Plain steps of 4 rows timed at plain_s (the cores were busy), then steps on the fake
    clock: -> the k of each."""
    chooser, keys = DraftChooser(4), [f"r{i}" for i in range(4)]
    for _ in range(20):
        chooser.observe(keys, 0, plain_s, [])
    return _run_chooser_on(chooser, keys, steps, cost, accept)


def test_a_plain_step_checks_now_and_then_that_verifying_still_pays():
    """Plain steps timed while the cores were busy (2x) stood against verify steps timed
    after: with drafts accepted at 0.3, verifying seemed to pay (by under 2x) where plain
    steps win today. A plain step among the verify steps brings their time up to date."""
    rng = random.Random(0)
    chosen = _run_after_busy_plain_steps(3.0, 600, lambda k: 1.5 + 0.5 * k, _geometric(rng, 0.3))
    assert sum(k > 0 for k in chosen[-300:]) <= 6  # probes at most


def test_a_win_of_2x_or_more_is_still_checked_seldom():
    """A plain time 3.5x today's made verifying 4 drafts look a win of over 2x (accepted at
    0.9, a draft costing a plain step): not checked at all, it verified for good at 0.8x
    plain steps' tokens a second. Checked once in LONG_CHECK_GAP verify steps, it stops."""
    rng = random.Random(0)
    chosen = _run_after_busy_plain_steps(3.5, 3000, lambda k: 1.0 + 1.0 * k, _geometric(rng, 0.9))
    assert 0 in chosen[: LONG_CHECK_GAP + 20] and sum(k > 0 for k in chosen[-1000:]) <= 20


def _share_verified_with_noise(seed: int) -> float:
    """Steps of one row (54 ms, a draft 0.8 ms) on a noisy clock (times spread log-normally,
    sigma 0.4), drafts accepted at 0.6 (about 1.3 of 4): the share of the steps that
    verified, after the first two requests."""
    rng, chooser = random.Random(seed), DraftChooser(4)
    accept = _geometric(rng, 0.6)
    num_steps = num_verified = 0
    for r in range(8):
        key, made = f"q{r}", 0
        chooser.join(key, is_sampled=False)
        while made < 64:
            k = chooser.choose([key], 4)
            accepted = accept(k)
            chooser.observe([key], k, (0.054 + 0.0008 * k) * rng.lognormvariate(0, 0.4), [accepted])
            made += 1 + accepted
            num_steps, num_verified = num_steps + (r >= 2), num_verified + (r >= 2 and k > 0)
        chooser.forget(key)
    return num_verified / num_steps


def test_one_noisy_check_does_not_turn_verifying_off_where_it_pays():
    """A check (one plain step) on a noisy clock: taken whole as the plain time, a fast one
    made verifying look a loss; verifying then waited for probes to come back."""
    shares = [_share_verified_with_noise(seed) for seed in range(100)]
    assert sum(shares) / len(shares) > 0.82  # whole: 0.77; at half: 0.85


def _run_on_host(chooser, keys: list[str], steps: int, proposes) -> list[int]:
    """steps decode steps as the host runs them: a step chosen to verify k proposes its
    drafts first; where proposes(step) is false, no row has one and the step runs plain
    (1.0 on the fake clock), observed as one; else every draft is accepted (a step of k
    costs 1.0 + 0.1 k). -> the k chosen for each step."""
    chosen = []
    for step in range(steps):
        k = chooser.choose(keys, 4)
        chosen.append(k)
        if k and not proposes(step):
            chooser.observe_none_proposed(keys, k)
            chooser.observe(keys, 0, 1.0, [])
            continue
        chooser.observe(keys, k, 1.0 + 0.1 * k, [k] * len(keys) if k else [])
    return chosen


def test_a_load_whose_drafts_are_never_found_tries_them_at_doubling_gaps():
    """Review: where a step chosen to verify found no draft and ran plain, observed as a
    plain step, the chooser tried again on the very next step (on this fake clock, 800
    tries in 1,000 steps against a handful). A step that found none closes its probe as
    failed, and the next waits twice as long."""
    chooser, keys = DraftChooser(4), ["r0", "r1"]
    chosen = _run_on_host(chooser, keys, 1000, lambda step: False)
    tried = [i for i, k in enumerate(chosen) if k]
    assert tried[0] == 2  # two plain steps (the first untimed), then a first try
    gaps = [b - a for a, b in zip(tried, tried[1:])]
    assert gaps[0] == FIRST_PROBE_GAP and all(b == 2 * a for a, b in zip(gaps, gaps[1:]))
    assert len(tried) <= 7 and chooser.num_probes == len(tried) - 1


def test_drafts_that_stop_being_found_turn_verifying_off():
    """Review: rows whose step found no draft were not counted as refusing one, so their
    acceptance never fell: a load whose drafts stopped matching chose verify steps on every
    step (each proposing its drafts for nothing). Each such step counts a refusal a row."""
    chooser, keys = DraftChooser(4), ["r0", "r1"]
    chosen = _run_on_host(chooser, keys, 1200, lambda step: step < 200)
    assert chosen[150:200] == [4] * 50  # every draft accepted: verifying pays
    assert sum(k > 0 for k in chosen[400:]) <= 6
    assert max(won / tried for won, tried in chooser._acceptance.values()) < 0.1


def test_drafts_found_after_a_quiet_start_are_verified_from_the_probe_that_finds_them():
    """Review: a load whose first drafts came late found them in a probe that was its kind's
    first verify step (not timed): taken for a failed probe, the next verify step came a
    doubled gap later (1,025 steps on). An untimed probe whose drafts were taken tries
    again on the next step, timed."""
    chooser, keys = DraftChooser(4), ["r0", "r1"]
    chosen = _run_on_host(chooser, keys, 1500, lambda step: step >= 600)
    verified = [i for i, k in enumerate(chosen) if k and i >= 600]
    assert verified[0] < 1100 and verified[1] == verified[0] + 1  # the probe, then timed
    assert all(chosen[verified[0] + 8 :])  # every draft accepted: verifying pays


def test_a_probe_that_found_drafts_once_does_not_try_every_step_after():
    """Review: after an untimed probe found drafts (its gap set to 0, to try again at once),
    a try that found none kept the gap at 0: every later step proposed drafts for nothing
    (989 of 989 steps on this fake clock) and none ran ahead."""
    chooser, keys = DraftChooser(4), ["r0", "r1"]
    found = []

    def proposes(step: int) -> bool:  # once: the first probe after step 600
        if step >= 600 and not found:
            found.append(step)
            return True
        return False

    chosen = _run_on_host(chooser, keys, 2000, proposes)
    assert found and sum(k > 0 for k in chosen[found[0] + 1 :]) <= 8
