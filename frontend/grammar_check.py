"""A request's grammar compiled once, in a process of its own that is killed at its CPU limit.

Nodes compile a request's grammar on their loops (common/base/grammar.py), so the frontend
lets through only grammars that compile within MAX_COMPILE_CPU_S. Checking that by
compiling on one of the frontend's own threads cannot stop a compile once it has started:
a schema nested 300 deep takes seconds of CPU, a worse one minutes, all of it on the
frontend's two cores beside the loop that streams every client's tokens, and the thread
is held meanwhile. Here the compile runs in a child that is killed as soon as it has
spent the limit, so no client's grammar costs the host more than that.

    frontend (GrammarChecker.check)  --JSON line-->  checker process (nice 19, made once:
                                                      the tokenizer's vocabulary loaded)
                                     <--JSON line--    forks one compile per grammar,
                                                      kills it past the CPU limit

The verdicts (compiles, or why not) of the latest MAX_VERDICTS grammars are kept, so a
grammar asked again is answered at once. The checker process reads its requests from its
stdin: when the frontend goes, however it goes, the checker sees the end and exits; each
compile dies with the checker (PR_SET_PDEATHSIG). Nothing here is pickled: the lines are
JSON of strings.

main(MODEL, VOCAB_SIZE, MAX_CPU_S) is the checker process (at nice 19, set before anything
is imported).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

from common.base.grammar import GrammarError
from common.base.log import get_logger

log = get_logger("frontend")

# NOTE: the lowest priority first, then the imports (torch, xgrammar, the tokenizer: seconds
# of CPU), so that not even its start takes a core from a node or the frontend's loop; in a
# session of its own, else it would take its time from the frontend (lower_this_process).
_CHILD = (
    "import sys; from common.base.threads import lower_this_process; "
    "lower_this_process(19, 10); "
    "from frontend.grammar_check import main; sys.exit(main(sys.argv[1:]))"
)
MAX_VERDICTS = 1024
START_TIMEOUT_S = 120.0  # importing xgrammar and torch, loading the tokenizer, on a busy host
CHECK_TIMEOUT_S = 30.0  # a compile starved of CPU this long is answered "try again"
POLL_S = 0.01
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


class GrammarChecker:
    """check(grammar) returns if the grammar compiles within max_cpu_s of CPU, or raises
    GrammarError saying why not. Safe to call from several threads (one check at a time)."""

    def __init__(self, model: str, vocab_size: int, max_cpu_s: float):
        self.model, self.vocab_size, self.max_cpu_s = model, vocab_size, max_cpu_s
        # grammar -> error, None if it compiles
        self._verdicts: OrderedDict[tuple, str | None] = OrderedDict()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._ready: dict | None = None  # its first line, once it said it
        self._started_at = 0.0
        self._unavailable: str | None = None  # why its start failed, for good
        self._is_closed = False
        self.num_killed = 0  # compiles stopped at the CPU limit
        self.max_threads_at_fork = 0  # the checker's threads when it forked a compile (1: safe)

    def check(self, grammar: tuple[str, str, str]) -> None:
        key = tuple(grammar)
        with self._lock:
            if key not in self._verdicts:
                reply = self._ask(key)
                if reply.get("is_transient"):
                    raise GrammarNotJudged(reply["error"])  # not remembered: asked again
                self._verdicts[key] = reply.get("error")
                while len(self._verdicts) > MAX_VERDICTS:
                    self._verdicts.popitem(last=False)
            self._verdicts.move_to_end(key)
            if self._verdicts[key] is not None:
                raise GrammarError(self._verdicts[key])

    def _ask(self, grammar: tuple) -> dict:
        """The checker's reply to one grammar; the checker made (again) if it is not running."""
        if self._is_closed:
            return {"error": "the frontend is stopping", "is_transient": True}
        if self._unavailable is not None:  # its start failed: not asked again
            return {"error": self._unavailable, "is_transient": False}
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        if self._ready is None and not self._wait_ready():
            return {
                "error": "the grammar checker is still starting (a busy host): try again",
                "is_transient": True,
            }
        if self._unavailable is not None:
            return {"error": self._unavailable, "is_transient": False}
        try:
            self._proc.stdin.write(json.dumps(list(grammar)).encode() + b"\n")
            self._proc.stdin.flush()
            reply = self._read_line(CHECK_TIMEOUT_S + 10 * self.max_cpu_s)
        except (OSError, TimeoutError) as e:
            # NOTE: a checker that stopped answering is replaced; this grammar is not
            # judged by it (the next request asks the new one).
            self._stop()
            return {
                "error": f"the grammar could not be checked ({type(e).__name__}): try again",
                "is_transient": True,
            }
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

    def _start(self) -> None:
        self._stop()
        path = os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, **ONE_THREAD}
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, self.model, str(self.vocab_size), str(self.max_cpu_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=_ROOT,
        )
        self._buf, self._ready, self._started_at = b"", None, time.monotonic()

    def _wait_ready(self) -> bool:
        """Whether the checker said it is ready (or why it cannot be: _unavailable), waiting
        up to START_TIMEOUT_S for it. NOTE: one that is only slow (a busy host) is kept: the
        next request waits on the same start, which a restart would throw away."""
        try:
            self._ready = self._read_line(START_TIMEOUT_S)
        except TimeoutError:
            log.warning(
                "the grammar checker (pid %d) has not started after %.0fs (a busy host?)",
                self._proc.pid,
                time.monotonic() - self._started_at,
            )
            return False
        except OSError as e:
            self._ready = {
                "error": f"structured outputs are not available: the grammar checker did not "
                f"start ({e})"
            }
        if "error" in self._ready:
            self._stop()
            self._unavailable = str(self._ready["error"])
            log.error("the grammar checker did not start: %s", self._unavailable)
            return True
        log.info(
            "the grammar checker (pid %d) started in %.1fs",
            self._proc.pid,
            time.monotonic() - self._started_at,
        )
        return True

    def _read_line(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer in {timeout_s:.0f}s")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise OSError("the grammar checker ended")
                self._buf += chunk
        line, rest = self._buf.split(b"\n", 1)
        self._buf = rest
        return json.loads(line)

    def _stop(self) -> None:
        proc = self._proc
        self._proc = None
        if proc is not None:
            proc.kill()
            proc.wait()
            proc.stdin.close()
            proc.stdout.close()

    def close(self) -> None:
        """Without the lock: a check under way sees its checker end and answers at once."""
        self._is_closed = True
        proc = self._proc
        if proc is not None:
            proc.kill()
            proc.wait()


# ----------------------------------------------------------------------------------------
# The checker process.


def _cpu_s(pid: int) -> float | None:
    """The CPU time (user + system) a live child has used; None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _num_threads() -> int:
    """This process's threads (0 where /proc cannot say)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _compile_in_child(grammars, grammar: list, max_cpu_s: float) -> dict:
    """Fork; the child compiles and writes its error (or none) to a pipe; past max_cpu_s of
    CPU (or of wall time where /proc cannot say) it is killed.

    NOTE: a fork copies only the forking thread: a lock another thread held stays held in the
    child for good. The checker runs no thread besides its main one (xgrammar's compiler is
    made with one, the thread pools of OpenBLAS, OpenMP and the tokenizer are off: ONE_THREAD);
    each reply says how many threads there were at the fork, and the frontend logs any fork
    made with more (tests/cluster/test_grammar_check.py holds it to one)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the compile
        os.close(r)
        _die_with_parent()
        try:
            grammars.compile(tuple(grammar))
            error = None
        except GrammarError as e:
            error = str(e)
        except Exception as e:  # anything else a hostile grammar provokes is its fault too
            error = f"the grammar cannot be compiled: {type(e).__name__}"
        os.write(w, json.dumps({"error": error}).encode())
        os._exit(0)
    os.close(w)
    start = time.monotonic()
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            cpu_s = usage.ru_utime + usage.ru_stime
            with os.fdopen(r, "rb") as f:
                out = f.read()
            if not out:
                return {
                    "error": f"compiling the {grammar[0]} failed (exit status {status})",
                    "cpu_s": cpu_s,
                }
            reply = json.loads(out)
            if reply["error"] is None and cpu_s > max_cpu_s:
                reply["error"] = _too_long(grammar[0], cpu_s, max_cpu_s)
            return {**reply, "cpu_s": round(cpu_s, 3)}
        cpu_s = _cpu_s(pid)
        wall_s = time.monotonic() - start
        if (cpu_s if cpu_s is not None else wall_s) > max_cpu_s or wall_s > CHECK_TIMEOUT_S:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            if cpu_s is not None and cpu_s <= max_cpu_s:  # starved, not slow: not its fault
                return {
                    "error": "the grammar could not be checked in time (the host is busy): "
                    "try again",
                    "is_transient": True,
                }
            return {
                "error": _too_long(grammar[0], cpu_s or wall_s, max_cpu_s, is_killed=True),
                "is_killed": True,
            }
        time.sleep(POLL_S)


def _too_long(kind: str, cpu_s: float, max_cpu_s: float, is_killed: bool = False) -> str:
    if is_killed:
        return (
            f"the {kind} took more than {max_cpu_s:g}s of CPU to compile (stopped there), "
            f"the most a request's grammar may take: simplify it"
        )
    return (
        f"the {kind} took {cpu_s:.2f}s of CPU to compile, more than the {max_cpu_s:g}s "
        f"a request's grammar may take: simplify it"
    )


def main(argv: list[str]) -> int:
    model, vocab_size, max_cpu_s = argv[0], int(argv[1]), float(argv[2])
    out = sys.stdout.buffer

    def say(obj: dict) -> None:
        out.write(json.dumps(obj).encode() + b"\n")
        out.flush()

    try:
        from common.base import grammar

        # one thread: the limit bounds the CPU a grammar costs the host, all of it
        grammars = grammar.for_model(model, vocab_size, max_threads=1)
    except Exception as e:
        say(
            {
                "error": str(e)
                if isinstance(e, GrammarError)
                else f"structured outputs are not available here ({type(e).__name__}: {e})"
            }
        )
        return 0
    say({"ready": True})
    for line in sys.stdin.buffer:  # ends when the frontend does
        try:
            g = json.loads(line)
            if not (isinstance(g, list) and len(g) == 3 and all(isinstance(x, str) for x in g)):
                raise ValueError("a grammar is [kind, spec, whitespace]")
        except ValueError as e:
            say({"error": f"not a grammar: {e}"})
            continue
        num_threads = _num_threads()  # at the fork: nothing runs between
        say({**_compile_in_child(grammars, g, max_cpu_s), "num_threads": num_threads})
    return 0
