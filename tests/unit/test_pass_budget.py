"""A prefill pass bounded in time (--max-pass-time): on a host where the token budget
would take tens of seconds, the budget follows the measured rate."""

from types import SimpleNamespace

from prefill_node.pass_budget import MIN_PASS_TOKENS, PassBudget


def node(token_budget=8192, max_pass_s=2.0):
    return SimpleNamespace(
        pass_budget=PassBudget(token_budget, max_pass_s, block_size=16),
        scheduler=SimpleNamespace(token_budget=token_budget),
    )


def bound(n, num_tokens, elapsed_s):
    n.scheduler.token_budget = n.pass_budget.after_pass(
        n.scheduler.token_budget, num_tokens, elapsed_s
    )
    return n.scheduler.token_budget


def test_a_slow_host_gets_passes_of_about_the_time_asked():
    n = node()
    assert bound(n, 4096, 20.0) == 400  # 204.8 tokens/s x 2 s, in whole blocks
    assert bound(n, 400, 2.0) == 400  # steady: the same rate
    assert bound(n, 400, 0.5) == 992  # faster now: smoothed ((204.8 + 200) / 2 + 800) / 2 x 2 s
    for _ in range(20):
        bound(n, 400, 0.0001)
    assert n.scheduler.token_budget == 8192  # never above --token-budget


def test_never_below_the_floor_and_off_when_asked():
    n = node()
    assert bound(n, 1024, 100.0) == MIN_PASS_TOKENS
    assert bound(node(token_budget=128), 1024, 100.0) == 128  # the budget given, if smaller
    off = node(max_pass_s=0)
    assert bound(off, 4096, 60.0) == 8192
    tiny = node()
    assert bound(tiny, 10, 5.0) == 8192  # too few tokens to measure a rate by
