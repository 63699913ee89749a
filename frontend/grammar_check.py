"""A request's grammar compiled once, in a process of its own that is killed at its CPU limit.

Nodes compile a request's grammar on their loops (common/base/grammar.py), so the frontend
lets through only grammars that compile within MAX_COMPILE_CPU_S. A compile on a thread
of the frontend's could not be stopped once started (a schema nested 300 deep takes seconds
of CPU, a worse one minutes, beside the loop that streams every client's tokens): here it
runs in a child killed as soon as it has spent the limit.

    frontend (GrammarChecker.check)  --JSON line-->  checker process (nice 19, made once:
                                                      the tokenizer's vocabulary loaded)
                                     <--JSON line--    forks one compile per grammar,
                                                      kills it past the CPU limit

The verdicts (compiles, or why not) of the latest MAX_VERDICTS grammars are kept, so a
grammar asked again is answered at once. The checker process reads its requests from its
stdin: when the frontend goes, however it goes, the checker sees the end and exits; each
compile dies with the checker (PR_SET_PDEATHSIG). Nothing here is pickled: the lines are
JSON of strings. The checker process is frontend/grammar_process.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

from common.base.grammar import GrammarError
from common.base.log import get_logger
from frontend.grammar_process import CHECK_TIMEOUT_S, cpu_s_of

log = get_logger("frontend")

# NOTE: the lowest priority first, then the imports (torch, xgrammar, the tokenizer: seconds
# of CPU), so that not even its start takes a core from a node or the frontend's loop; in a
# session of its own, else it would take its time from the frontend (lower_this_process).
# Its replies go to the pipe on a descriptor of their own; what a library prints, to stderr.
_CHILD = (
    "import os, sys; from common.base.lifetime import set_death_signal; set_death_signal(9); "
    "from common.base.threads import lower_this_process; "
    "lower_this_process(19, 10); out = os.dup(1); os.dup2(2, 1); "
    "from frontend.grammar_process import main; sys.exit(main(sys.argv[1:], out))"
)
MAX_VERDICTS = 1024
# NOTE: a start is importing xgrammar and torch and loading the tokenizer, at nice 19 on a
# busy host: seconds, or minutes. A request with a grammar waits for it on the frontend's
# loop (frontend/prompts.py), never on the checking thread, START_WAIT_S at most, then is
# told to try again (503). A start is given up when its CPU time stops growing for
# START_STALL_S (stuck: a lock, a file system) or passes MAX_START_CPU_S (spinning): it is
# made again, MAX_STARTS times in a row, then after RETRY_AFTER_S. Only the child's own word
# (no xgrammar, no tokenizer) is final: a 501 for every grammar.
START_WAIT_S = 60.0
START_STALL_S = 60.0
MAX_START_CPU_S = 120.0
MAX_STARTS = 3
RETRY_AFTER_S = 300.0
# NOTE: the checker forks: no library it loads may start a thread pool (numpy's OpenBLAS,
# loaded with torch, starts one thread per core at import), nor may the tokenizer's.
ONE_THREAD = {
    "TOKENIZERS_PARALLELISM": "false",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_ROOT = Path(__file__).resolve().parent.parent


class GrammarNotJudged(GrammarError):
    """The grammar could not be judged now (the checker starting or replaced, the frontend
    stopping): not the grammar's fault, so 503, and asked again."""

    status = 503


class GrammarUnavailable(GrammarError):
    """Structured outputs cannot be served by this frontend (no xgrammar, no tokenizer, a
    checker that would not start): not the grammar's fault, nor one that passes."""

    status = 501


class GrammarChecker:
    """check(grammar) returns if the grammar compiles within max_cpu_s of CPU, or raises
    GrammarError saying why not. Safe to call from several threads (one check at a time);
    is_settled() never waits, for the frontend's loop. Nothing here waits for a start."""

    def __init__(self, model: str, vocab_size: int, max_cpu_s: float):
        self.model, self.vocab_size, self.max_cpu_s = model, vocab_size, max_cpu_s
        # grammar -> error, None if it compiles
        self._verdicts: OrderedDict[tuple, str | None] = OrderedDict()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._dying: list[subprocess.Popen] = []  # killed, not yet reaped
        self._buf = b""
        self._ready: dict | None = None  # its first line, once it said it
        self._started_at = self._progress_at = self._start_cpu_s = 0.0
        self._unavailable: str | None = None  # why it cannot start, for good
        self._failed: str | None = None  # why the last start failed
        self._retry_at = 0.0  # after MAX_STARTS failed starts in a row: none before this
        self._is_launching = False  # in _start
        self._is_proven = False  # the running checker has judged a grammar
        self._is_closed = False
        self.num_starts = 0
        self.num_failed_starts = 0  # in a row: stuck, spinning or ended without a word
        self.num_killed = 0  # compiles stopped at the CPU limit
        self.max_threads_at_fork = 0  # the checker's threads when it forked a compile (1: safe)

    def check(self, grammar: tuple[str, str, str]) -> None:
        key = tuple(grammar)
        with self._lock:
            if key not in self._verdicts:
                reply = self._ask(key)
                if reply.get("is_transient"):
                    raise GrammarNotJudged(reply["error"])  # not remembered: asked again
                if reply.get("is_unavailable"):
                    raise GrammarUnavailable(reply["error"])  # no verdict on this grammar
                self._verdicts[key] = reply.get("error")
                while len(self._verdicts) > MAX_VERDICTS:
                    self._verdicts.popitem(last=False)
            self._verdicts.move_to_end(key)
            if self._verdicts[key] is not None:
                raise GrammarError(self._verdicts[key])

    @property
    def is_starting(self) -> bool:
        """A start under way (read without the lock: a hint, right by the next look)."""
        return not self._is_closed and (
            self._is_launching or (self._proc is not None and self._ready is None)
        )

    def is_settled(self) -> bool:
        """Whether a check would find no start under way (a start is begun where none runs);
        never waits: the frontend's loop polls it (frontend/prompts.py)."""
        if not self._lock.acquire(blocking=False):  # a check holds it
            return not self.is_starting
        try:
            return self._is_closed or self._settle()
        finally:
            self._lock.release()

    def _ask(self, grammar: tuple) -> dict:
        """The checker's reply to one grammar, or why there is none now."""
        if self._is_closed or not self._settle():
            return {
                "error": "the frontend is stopping"
                if self._is_closed
                else "the grammar checker is still starting (a busy host): try again",
                "is_transient": True,
            }
        if self._unavailable is not None:
            return {"error": self._unavailable, "is_unavailable": True}
        if self._proc is None:  # resting after MAX_STARTS failed starts, or none made
            rest_s = self._retry_at - time.monotonic()
            return {
                "error": "structured outputs are not available now: the grammar checker "
                + (
                    f"did not start in {MAX_STARTS} tries (the last: {self._failed}); it is "
                    f"tried again in {rest_s:.0f}s"
                    if rest_s > 0
                    else f"could not be started ({self._failed}): try again"
                ),
                "is_transient": True,
            }
        try:
            self._write_line(json.dumps(list(grammar)).encode() + b"\n", CHECK_TIMEOUT_S)
            reply = self._read_line(CHECK_TIMEOUT_S + 10 * self.max_cpu_s)
        except (OSError, TimeoutError, ValueError) as e:
            # NOTE: a checker that stopped answering (or answers nonsense) is replaced; this
            # grammar is not judged by it (the next request asks the new one). One that has
            # judged nothing yet counts as a failed start: else one that dies at every
            # grammar would be made again for every request, for good.
            why = f"it failed at a grammar ({type(e).__name__}: {e})"
            if self._is_proven:
                log.warning("the grammar checker (pid %d): %s; replaced", self._proc.pid, why)
                self._stop()
            else:
                self._fail_start(why, is_ended=isinstance(e, OSError))
            return {
                "error": f"the grammar could not be checked ({type(e).__name__}): try again",
                "is_transient": True,
            }
        self._is_proven, self.num_failed_starts = True, 0
        num_threads = reply.get("num_threads", 0)
        if isinstance(num_threads, int) and num_threads > self.max_threads_at_fork:
            self.max_threads_at_fork = num_threads
            if num_threads > 1:  # see _compile_in_child
                log.error(
                    "the grammar checker forked a compile with %d threads running: a compile "
                    "may hang (each is still stopped at %.0fs)",
                    num_threads,
                    CHECK_TIMEOUT_S,
                )
        if reply.get("is_killed"):
            self.num_killed += 1
            log.warning(
                "a %s was refused: its compile was stopped at %gs of CPU",
                grammar[0],
                self.max_cpu_s,
            )
        return reply

    def _settle(self) -> bool:
        """Whether no start is under way, after one look at it (never a wait): a checker
        made where none runs (or a ready one ended since), a stuck or spinning start given
        up. Lock held."""
        self._dying = [p for p in self._dying if p.poll() is None]
        if self._unavailable is not None:
            return True
        if self._proc is None and time.monotonic() < self._retry_at:
            return True
        if self._ready is not None and self._proc is not None and self._proc.poll() is not None:
            if not self._is_proven:  # NOTE: as a death at its first grammar (see _ask)
                return self._fail_start("it ended after it said it was ready", is_ended=True)
            self._start()
        elif self._proc is None:
            self._start()
        if self._proc is None or self._ready is not None:  # none could be made; or ready
            return True
        try:
            line = self._read_line(0.0)
        except TimeoutError:
            why = self._stalled()
            return False if why is None else self._fail_start(why)
        except (OSError, ValueError) as e:
            return self._fail_start(str(e), is_ended=isinstance(e, OSError))
        if "error" in line and line.get("is_final", True):  # no xgrammar, no tokenizer
            self._stop()
            self._unavailable = str(line["error"])
            log.error("the grammar checker cannot start: %s", self._unavailable)
            return True
        if "error" in line:
            return self._fail_start(str(line["error"]))
        self._ready = line
        log.info(
            "the grammar checker (pid %d) started in %.1fs",
            self._proc.pid,
            time.monotonic() - self._started_at,
        )
        return True

    def _stalled(self) -> str | None:
        """Why a silent start is given up, if it is: its CPU time no longer grows (or, where
        /proc cannot say, it is silent that long), or it has spent too much."""
        now, cpu_s = time.monotonic(), cpu_s_of(self._proc.pid)
        if cpu_s is not None and cpu_s > self._start_cpu_s:
            self._start_cpu_s, self._progress_at = cpu_s, now
        if cpu_s is not None and cpu_s > MAX_START_CPU_S:
            return f"it spent {cpu_s:.0f}s of CPU without starting"
        if now - self._progress_at > START_STALL_S:
            return f"no progress in {START_STALL_S:.0f}s"
        return None

    def _fail_start(self, why: str, is_ended: bool = False) -> bool:
        """A start stuck, spinning or ended without a word: made again, MAX_STARTS times in
        a row, then not before RETRY_AFTER_S. True where none is made now."""
        pid = self._proc.pid
        try:  # NOTE: its pipe closes just before it ends; a moment at most
            code = self._proc.wait(0.05) if is_ended else None
        except subprocess.TimeoutExpired:
            code = None
        self._stop()
        if self._is_closed:
            return False
        self._note_failure(f"{why}, exit status {code}" if code is not None else why, pid)
        if time.monotonic() >= self._retry_at:
            self._start()
        return self._proc is None

    def _note_failure(self, why: str, pid: int | None = None) -> None:
        """One more failed start in a row; the MAX_STARTS-th rests the checker."""
        self.num_failed_starts += 1
        self._failed = why
        if self.num_failed_starts % MAX_STARTS:
            log.warning("the grammar checker (pid %s) did not start (%s): again", pid or "-", why)
            return
        self._retry_at = time.monotonic() + RETRY_AFTER_S
        log.error(
            "the grammar checker did not start in %d tries (the last: %s): structured "
            "outputs are refused for %.0fs, then it is tried again",
            MAX_STARTS,
            why,
            RETRY_AFTER_S,
        )

    def _start(self) -> None:
        self._is_launching = True  # NOTE: a poll meanwhile (lock held) sees a start under way
        try:
            self._stop()
            path = os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH")) if p)
            argv = [sys.executable, "-c", _CHILD, self.model, str(self.vocab_size)]
            try:
                self._proc = subprocess.Popen(
                    [*argv, str(self.max_cpu_s)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env={**os.environ, "PYTHONPATH": path, **ONE_THREAD},
                    cwd=_ROOT,
                )
            except OSError as e:  # no memory, descriptors or processes left: as a failed start
                self._note_failure(f"no process could be made: {e}")
                return
            os.set_blocking(self._proc.stdin.fileno(), False)  # see _write_line
            self.num_starts += 1
            self._buf, self._ready, self._is_proven = b"", None, False
            self._started_at = self._progress_at = time.monotonic()
            self._start_cpu_s = 0.0
            if self._is_closed:  # NOTE: close() ran meanwhile, and may not have seen this one
                self._stop()
        finally:
            self._is_launching = False

    def _write_line(self, data: bytes, timeout_s: float) -> None:
        """All of data to the checker, or TimeoutError. NOTE: a grammar's line may be more
        than the pipe holds (64 KiB), and a checker that stopped reading must not hold the
        checking thread for good."""
        deadline, fd = time.monotonic() + timeout_s, self._proc.stdin.fileno()
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"the grammar checker did not take the whole line in {timeout_s:g}s"
                )
            if _is_ready(fd, select.POLLOUT, left):
                with contextlib.suppress(BlockingIOError):
                    view = view[os.write(fd, view) :]

    def _read_line(self, timeout_s: float) -> dict:
        """The checker's next line, a JSON object (ValueError if it is not one)."""
        deadline = time.monotonic() + timeout_s
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if not _is_ready(fd, select.POLLIN, max(left, 0.0)):
                if left <= 0:
                    raise TimeoutError(f"no answer in {timeout_s:g}s")
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise OSError("the grammar checker ended")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            raise ValueError(f"the grammar checker wrote {line[:80]!r}, not a JSON object")
        return obj

    def _stop(self) -> None:
        """The checker killed, not waited for: one stuck in the kernel may take a while to
        die, and the loop must not wait on it (reaped by a later _settle)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            for pipe in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):  # NOTE: a flush into a closed pipe
                    pipe.close()
            self._dying.append(proc)

    def close(self) -> None:
        """Without the lock: a check under way sees its checker end and answers at once."""
        self._is_closed = True
        proc = self._proc
        if proc is not None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(1.0)


def _is_ready(fd: int, event: int, timeout_s: float) -> bool:
    """Whether fd is ready for event within timeout_s. NOTE: poll, not select: a frontend
    holding a thousand clients' sockets has pipes past select's limit of 1024."""
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(timeout_s * 1000))
