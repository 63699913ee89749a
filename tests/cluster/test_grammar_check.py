"""The frontend's grammar checker: each grammar compiled once in a process of its own,
killed at the CPU limit, its verdict remembered; the checker gone with the frontend."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
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


def _error(checker: GrammarChecker, grammar) -> str | None:
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
        assert (
            _error(checker, DEEP) == error and _error(checker, ("regex", "a+b", "compact")) is None
        )
        assert checker._proc is None and checker.num_killed == 1
        # a checker that died is made again for the next new grammar
        assert _error(checker, ("regex", "c+d", "compact")) is None and checker._proc.poll() is None
    finally:
        checker.close()
    assert checker._proc.poll() is not None
    assert "stopping" in _error(checker, ("regex", "e+f", "compact"))


def test_a_checker_slow_to_start_is_waited_for_not_restarted(tiny_model, monkeypatch):
    """A start that outlives a request's wait (a busy host) is no verdict: the grammar is
    refused with a "try again" (503), and the next request waits on the same start, which a
    restart would throw away, and is judged."""
    monkeypatch.setattr(grammar_check, "READY_WAIT_S", 0.01)
    checker = GrammarChecker(str(tiny_model), _vocab_size(tiny_model), 0.5)
    try:
        grammar = ("regex", "a+b", "compact")
        with pytest.raises(grammar_check.GrammarNotJudged, match="still starting") as e:
            checker.check(grammar)
        assert e.value.status == 503
        pid = checker._proc.pid
        monkeypatch.setattr(grammar_check, "READY_WAIT_S", 120.0)
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
        ("import time; time.sleep(60)", "silent"),  # hung
        ("import sys; sys.exit(9)", "exit status 9"),  # ended without a word
        ("print('hello', flush=True); import time; time.sleep(60)", "not a JSON object"),
    ],
)
def test_a_start_that_hangs_or_ends_silently_is_made_again_then_given_up(monkeypatch, child, why):
    """Such a start is the host's trouble, not a reason to give up at once: the checker is
    made again, MAX_STARTS times in all, each request meanwhile told to try again; then
    structured outputs are said unavailable, naming the last start's failure."""
    checker = _fake_checker(monkeypatch, child, START_TIMEOUT_S=0.3, READY_WAIT_S=1.0)
    grammar = ("regex", "a+b", "compact")
    try:
        for _ in range(grammar_check.MAX_STARTS - 1):
            with pytest.raises(grammar_check.GrammarNotJudged, match="still starting"):
                checker.check(grammar)
        with pytest.raises(grammar_check.GrammarUnavailable, match=why) as e:
            checker.check(grammar)
        assert f"did not start in {grammar_check.MAX_STARTS} tries" in str(e.value)
        assert checker.num_starts == checker.num_failed_starts == grammar_check.MAX_STARTS
        with pytest.raises(grammar_check.GrammarUnavailable):
            checker.check(("regex", "c+d", "compact"))
        assert checker.num_starts == grammar_check.MAX_STARTS and checker._proc is None
    finally:
        checker.close()


def test_polling_a_start_never_waits_and_starts_one_checker(monkeypatch):
    """The frontend's loop polls is_settled while a request's grammar waits for the start:
    each poll returns at once, and all of them share one start."""
    checker = _fake_checker(
        monkeypatch, "import time; time.sleep(1.5); print('{}', flush=True); time.sleep(60)"
    )
    try:
        polls, t0 = 0, time.monotonic()
        while not checker.is_settled():
            polls += 1
            time.sleep(0.02)
        assert polls > 10 and time.monotonic() - t0 < 30 and checker.num_starts == 1
        assert checker._ready == {} and checker.is_settled()
    finally:
        checker.close()


def test_closing_under_a_start_wait_is_a_stop_not_a_failed_start(monkeypatch):
    """close() while a check waits on the start: the request is told the frontend is
    stopping (503), and nothing is remembered as the checker's failure or the grammar's."""
    checker = _fake_checker(monkeypatch, "import time; time.sleep(60)", READY_WAIT_S=30.0)
    closer = threading.Timer(0.5, checker.close)
    closer.start()
    t0 = time.monotonic()
    with pytest.raises(grammar_check.GrammarNotJudged, match="stopping"):
        checker.check(("regex", "a+b", "compact"))
    assert time.monotonic() - t0 < 10
    assert checker.num_failed_starts == 0 and checker._unavailable is None
    assert not checker._verdicts
    closer.join()


PARENT = r"""
import json, sys
from frontend.grammar_check import GrammarChecker
c = GrammarChecker(sys.argv[1], int(sys.argv[2]), 0.5)
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
