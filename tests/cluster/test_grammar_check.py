"""The frontend's grammar checker: each grammar compiled once in a process of its own,
killed at the CPU limit, its verdict remembered; the checker gone with the frontend."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from common.base.grammar import GrammarError
from frontend import grammar_check
from frontend.grammar_check import GrammarChecker
from tests.cluster_util import ROOT, is_alive, wait_for

pytestmark = pytest.mark.cluster  # it starts the checker process

# a JSON schema nested 300 deep: seconds of CPU to compile
DEEP = (
    "json_schema",
    '{"type": "array", "items": ' * 300 + '{"type": "integer"}' + "}" * 300,
    "compact",
)


def _error(checker: GrammarChecker, grammar, is_settled_first: bool = True) -> str | None:
    """The grammar's error, None if it compiles; the checker's start waited for first, as
    the frontend's loop waits for it before a request takes the checking thread."""
    if is_settled_first:
        _settle(checker)
    try:
        checker.check(grammar)
    except GrammarError as e:
        return str(e)
    return None


def _vocab_size(model) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]


def test_grammars_are_judged_and_a_slow_one_is_stopped_at_the_limit(tiny_model):
    checker = GrammarChecker(str(tiny_model), _vocab_size(tiny_model), 0.5)
    try:
        assert _error(checker, ("json_schema", '{"type": "object"}', "compact")) is None
        assert _error(checker, ("choice", '["red", "green"]', "any")) is None
        assert "regex does not compile" in _error(checker, ("regex", "[", "compact"))
        assert "not valid JSON" in _error(checker, ("json_schema", "{", "compact"))
        assert "a grammar is one of" in _error(checker, ("nope", "x", "compact"))
        bad_whitespace = _error(checker, ("json_object", "", "tabs"))
        assert "whitespace is one of compact, any, got 'tabs'" in bad_whitespace
        # the compile is stopped at 0.5 s of CPU, not run to its end (seconds)
        pid = checker._proc.pid
        assert os.getpriority(os.PRIO_PROCESS, pid) == 19  # below everything that serves
        # ... and in a session of its own, so that its time is not taken from the frontend's
        # (with autogroups, its group ranked at 10 against every other session's group)
        assert os.getsid(pid) == pid != os.getsid(0)
        if os.path.exists("/proc/self/autogroup"):
            with open(f"/proc/{pid}/autogroup") as f:
                assert f.read().split()[-1] == "10"
        error = _error(checker, DEEP)
        assert "to compile (stopped there)" in error and "0.5s" in error, error
        assert checker.num_killed == 1 and checker._proc.pid == pid  # the checker goes on
        assert _error(checker, ("regex", "a+b", "compact")) is None
        # each verdict is remembered: asked again with no checker running, the same answers
        checker._stop()
        assert _error(checker, DEEP, is_settled_first=False) == error
        assert _error(checker, ("regex", "a+b", "compact"), is_settled_first=False) is None
        assert checker._proc is None and checker.num_killed == 1
        # a checker that died is made again for the next new grammar
        assert _error(checker, ("regex", "c+d", "compact")) is None and checker._proc.poll() is None
    finally:
        checker.close()
    assert checker._proc.poll() is not None
    assert "stopping" in _error(checker, ("regex", "e+f", "compact"), is_settled_first=False)


def _settle(checker: GrammarChecker, timeout_s: float = 120) -> float:
    """Polls is_settled as the frontend's loop does, until it is; the longest poll (s)."""
    longest, deadline = 0.0, time.monotonic() + timeout_s
    while True:
        t0 = time.monotonic()
        is_settled = checker.is_settled()
        longest = max(longest, time.monotonic() - t0)
        if is_settled:
            return longest
        assert time.monotonic() < deadline, "the checker never settled"
        time.sleep(0.02)


def test_a_start_is_never_waited_on_by_a_check_and_a_slow_one_is_kept(tiny_model):
    """A check during the start is no verdict: a "try again" (503) at once, not a wait on
    the checking thread; the start goes on (a restart would throw it away), and once the
    loop's polls see it settled, the grammar is judged by the same checker."""
    checker = GrammarChecker(str(tiny_model), _vocab_size(tiny_model), 0.5)
    try:
        grammar = ("regex", "a+b", "compact")
        t0 = time.monotonic()
        with pytest.raises(grammar_check.GrammarNotJudged, match="still starting") as e:
            checker.check(grammar)
        assert e.value.status == 503 and time.monotonic() - t0 < 5
        pid = checker._proc.pid
        assert _settle(checker) < 0.25
        assert _error(checker, grammar) is None and checker._proc.pid == pid
        assert checker.num_starts == 1 and checker.num_failed_starts == 0
    finally:
        checker.close()


def test_a_checker_that_cannot_start_is_not_started_again(tmp_path):
    """A start that fails saying why (here: no tokenizer at the model's path) is said to
    every request after it, as this frontend's lack (501), not as the grammar's fault, with
    no new checker started for each."""
    checker = GrammarChecker(str(tmp_path / "no-model"), 512, 0.5)
    try:
        _settle(checker)
        with pytest.raises(grammar_check.GrammarUnavailable, match="not available") as e:
            checker.check(("regex", "a+b", "compact"))
        assert e.value.status == 501
        assert _error(checker, ("regex", "c+d", "compact")) == str(e.value)
        assert checker.num_starts == 1 and checker._proc is None and not checker._verdicts
    finally:
        checker.close()


def _fake_checker(monkeypatch, child: str, **limits) -> GrammarChecker:
    """A checker whose process is `child` (python -c), with the given limits."""
    monkeypatch.setattr(grammar_check, "_CHILD", child)
    for name, value in limits.items():
        monkeypatch.setattr(grammar_check, name, value)
    return GrammarChecker("unused", 512, 0.5)


@pytest.mark.parametrize(
    "child, why",
    [
        ("import time; time.sleep(60)", "no progress in"),  # stuck
        ("while True: pass", "of CPU without starting"),  # spinning
        ("import sys; sys.exit(9)", "exit status 9"),  # ended without a word
        ("print('hello', flush=True); import time; time.sleep(60)", "not a JSON object"),
        ("import json; print(json.dumps({'error': 'EIO', 'is_final': False}))", "EIO"),
    ],
)
def test_a_start_that_fails_is_made_again_then_given_a_rest(monkeypatch, child, why):
    """A start that is stuck, spins, or ends without a final word is the host's trouble of
    the moment: made again by the loop's polls (each returning at once), MAX_STARTS times in
    a row; then grammars get a 503 naming the failure until RETRY_AFTER_S has passed, and
    the checker is tried again."""
    checker = _fake_checker(
        monkeypatch, child, START_STALL_S=2.0, MAX_START_CPU_S=0.3, RETRY_AFTER_S=600.0
    )
    try:
        assert _settle(checker) < 0.25
        assert checker.num_starts == checker.num_failed_starts == grammar_check.MAX_STARTS
        with pytest.raises(grammar_check.GrammarNotJudged, match=why) as e:
            checker.check(("regex", "a+b", "compact"))
        assert f"did not start in {grammar_check.MAX_STARTS} tries" in str(e.value)
        assert "tried again in" in str(e.value) and not checker._verdicts
        assert checker.num_starts == grammar_check.MAX_STARTS and checker._proc is None
        checker._retry_at = 0.0  # the rest is over: the next look starts it again
        assert not checker.is_settled() and checker.num_starts == grammar_check.MAX_STARTS + 1
        assert not any(p.poll() is None for p in checker._dying[:-1])  # the rest reaped
    finally:
        checker.close()


def test_a_checker_that_dies_idle_before_a_verdict_counts_as_a_failed_start(monkeypatch):
    """A checker that says it is ready and ends before any grammar (killed for memory while
    idle) has not started either: counted, and rested at MAX_STARTS."""
    checker = _fake_checker(
        monkeypatch, "print('{\"ready\": true}', flush=True)", RETRY_AFTER_S=600.0
    )
    try:
        for _ in range(20):
            if checker.num_failed_starts == grammar_check.MAX_STARTS:
                break
            _settle(checker)
            time.sleep(0.2)  # it ends meanwhile
        assert checker.num_starts == checker.num_failed_starts == grammar_check.MAX_STARTS
        with pytest.raises(grammar_check.GrammarNotJudged, match="after it said it was ready"):
            checker.check(("regex", "a+b", "compact"))
    finally:
        checker.close()


def test_a_checker_that_dies_at_each_grammar_rests_like_a_failed_start(monkeypatch):
    """A checker that says it is ready but dies at its first grammar (its forks failing,
    killed for memory) has not started: made again MAX_STARTS times, not for every request
    for good, then rested with the reason said."""
    checker = _fake_checker(
        monkeypatch,
        "print('{\"ready\": true}', flush=True); import sys; sys.stdin.readline()",
        RETRY_AFTER_S=600.0,
    )
    try:
        for _ in range(grammar_check.MAX_STARTS):
            with pytest.raises(grammar_check.GrammarNotJudged, match="could not be checked"):
                _error_raised(checker, ("regex", "a+b", "compact"))
        with pytest.raises(grammar_check.GrammarNotJudged, match="failed at a grammar") as e:
            _error_raised(checker, ("regex", "a+b", "compact"))
        assert f"did not start in {grammar_check.MAX_STARTS} tries" in str(e.value)
        assert checker.num_starts == grammar_check.MAX_STARTS and not checker._verdicts
    finally:
        checker.close()


def _error_raised(checker: GrammarChecker, grammar) -> None:
    _settle(checker)
    checker.check(grammar)


def test_no_process_for_the_checker_is_a_failed_start_not_a_crash(monkeypatch):
    """Popen failing (no descriptors, no memory) on the loop's poll: the request is told why
    (503), each try counts as a failed start, and the MAX_STARTS-th rests the checker."""

    def no_process(*args, **kwargs):
        raise OSError(24, "Too many open files")

    checker = _fake_checker(monkeypatch, "unused", RETRY_AFTER_S=600.0)
    monkeypatch.setattr(grammar_check.subprocess, "Popen", no_process)
    try:
        assert checker.is_settled() and checker.num_failed_starts == 1
        with pytest.raises(grammar_check.GrammarNotJudged, match="Too many open files") as e:
            checker.check(("regex", "a+b", "compact"))
        assert "could not be started" in str(e.value) and checker.num_failed_starts == 2
        with pytest.raises(grammar_check.GrammarNotJudged, match="tried again in"):
            checker.check(("regex", "a+b", "compact"))
        assert checker.num_failed_starts == grammar_check.MAX_STARTS and checker.is_settled()
        assert checker.num_failed_starts == grammar_check.MAX_STARTS  # resting: no more tries
    finally:
        checker.close()


def test_a_checker_that_stops_reading_does_not_hold_the_thread(monkeypatch):
    """A grammar's line larger than the pipe holds, to a checker that no longer reads: the
    write gives up at CHECK_TIMEOUT_S (a 503), rather than holding the checking thread, and
    every client's long prompts behind it, for good."""
    checker = _fake_checker(
        monkeypatch,
        "print('{\"ready\": true}', flush=True); import time; time.sleep(60)",
        CHECK_TIMEOUT_S=0.5,
    )
    try:
        _settle(checker)
        t0 = time.monotonic()
        with pytest.raises(grammar_check.GrammarNotJudged, match="TimeoutError"):
            checker.check(("regex", "a" * 300_000, "compact"))
        assert time.monotonic() - t0 < 3  # the read's deadline, not the write's, is 5.5 s
        assert "did not take the whole line" in checker._failed
    finally:
        checker.close()


def test_polls_during_a_check_see_a_start_under_way(monkeypatch):
    """While a check holds the checker (here: the lock held), the loop's poll answers from
    what it can see: a start under way is not settled, so a request keeps waiting on the
    loop rather than taking the thread to be told to try again."""
    checker = _fake_checker(monkeypatch, "import time; time.sleep(60)")
    try:
        assert not checker.is_settled() and checker.is_starting
        with checker._lock:
            assert not checker.is_settled()
        checker._ready = {}
        with checker._lock:
            assert checker.is_settled()
    finally:
        checker.close()


def test_closing_under_a_start_is_a_stop_not_a_failed_start(monkeypatch):
    """close() while a start is under way: a request is told the frontend is stopping (503),
    and nothing is remembered as the checker's failure or the grammar's."""
    checker = _fake_checker(monkeypatch, "import time; time.sleep(60)")
    assert not checker.is_settled()
    proc = checker._proc
    checker.close()
    assert proc.poll() is not None and checker.is_settled()
    with pytest.raises(grammar_check.GrammarNotJudged, match="stopping"):
        checker.check(("regex", "a+b", "compact"))
    assert checker.num_failed_starts == 0 and checker._unavailable is None
    assert not checker._verdicts and checker.num_starts == 1


PARENT = r"""
import json, sys, time
from frontend.grammar_check import GrammarChecker
c = GrammarChecker(sys.argv[1], int(sys.argv[2]), 0.5)
while not c.is_settled():
    time.sleep(0.05)
c.check(("regex", "a+", "compact"))
print(json.dumps({"checker": c._proc.pid}), flush=True)
sys.stdin.readline()
"""


def test_the_checker_ends_with_the_frontend_however_it_ends(tiny_model):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tiny_model), str(_vocab_size(tiny_model))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        checker_pid = json.loads(parent.stdout.readline())["checker"]
        assert is_alive(checker_pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_for(lambda: not is_alive(checker_pid), 10, "the checker ended with its frontend")
    finally:
        parent.kill()
        parent.wait()


def test_the_checker_forks_each_compile_with_no_other_thread_running(tiny_model):
    """Fork after threads: a compile forked while another thread of the checker held a lock
    (torch's, xgrammar's, the tokenizer's pool) would wait on it for good. The checker
    loads torch, xgrammar and the tokenizer, yet runs no thread besides its main one, at
    every fork and after every kind of grammar (the killed compile's included)."""
    checker = GrammarChecker(str(tiny_model), _vocab_size(tiny_model), 0.5)
    try:
        for grammar in [
            ("json_schema", '{"type": "object"}', "compact"),
            ("json_object", "", "any"),
            ("regex", "[a-c]+", "compact"),
            ("choice", '["x", "y"]', "compact"),
            ("grammar", 'root ::= "a" | "b"', "compact"),
            ("regex", "[", "compact"),
            DEEP,
        ]:
            _error(checker, grammar)
        assert checker.max_threads_at_fork == 1
        assert os.listdir(f"/proc/{checker._proc.pid}/task") == [str(checker._proc.pid)]
    finally:
        checker.close()
