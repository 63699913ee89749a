"""The grammar checker's process (frontend/grammar_check.py starts it and says why): it
loads the model's vocabulary once, then for each grammar on its stdin (a JSON line) forks
a compile, kills it past the CPU limit, and writes the verdict as a JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from common.base.grammar import GrammarError
from common.base.lifetime import set_death_signal

CHECK_TIMEOUT_S = 30.0  # a compile starved of CPU this long is answered "try again"
POLL_S = 0.01


def cpu_s_of(pid: int) -> float | None:
    """The CPU time (user + system) a live child has used; None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


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
        set_death_signal(signal.SIGKILL)
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
        cpu_s = cpu_s_of(pid)
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


def main(argv: list[str], out_fd: int = 1) -> int:
    model, vocab_size, max_cpu_s = argv[0], int(argv[1]), float(argv[2])
    out = os.fdopen(out_fd, "wb")

    def say(obj: dict) -> None:
        out.write(json.dumps(obj).encode() + b"\n")
        out.flush()

    try:
        from common.base import grammar

        # one thread: the limit bounds the CPU a grammar costs the host, all of it
        grammars = grammar.for_model(model, vocab_size, max_threads=1)
    except Exception as e:
        # NOTE: final (said to every grammar) only where a new start would meet it again: no
        # xgrammar, no tokenizer there (an OSError of no errno), a tokenizer it cannot read;
        # not the host's trouble of the moment (memory, I/O, the network)
        is_final = isinstance(e, (ImportError, GrammarError, ValueError)) or (
            isinstance(e, OSError)
            and e.errno is None
            and not isinstance(e, (ConnectionError, TimeoutError))
        )
        say(
            {
                "error": str(e)
                if isinstance(e, GrammarError)
                else f"structured outputs are not available here ({type(e).__name__}: {e})",
                "is_final": is_final,
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
