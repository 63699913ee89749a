"""Structured outputs: a grammar as a mask over the vocabulary, token by token.

A request's grammar (SamplingParams.grammar = (kind, spec, whitespace)) is one of
    json_schema  a JSON schema (a string)          json_object  any JSON object
    regex        a regular expression              choice       one of a JSON list of strings
    grammar      an EBNF grammar (xgrammar's GBNF dialect)
compiled by xgrammar (pinned; vLLM and SGLang use it) against the model's
tokenizer. JSON is compact unless whitespace is "any": a weak model that wanders
into free whitespace never closes its object. NOTE: xgrammar's JSON lets raw
control characters into strings, which strict JSON parsers refuse: for the JSON
kinds, tokens holding a byte below 0x20 are masked too, so the output always
parses. A matcher (grammar_matcher.py) follows one request: it accepts the tokens
generated so far (so a request resumed elsewhere, or after a preemption, is masked as if it
had never stopped), and fills the next token's mask as one bit per token: [ceil(V / 32)]
int32 words.
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
WHITESPACE = ("compact", "any")
MAX_COMPILED = 256  # grammars kept compiled, the most recently used
# The frontend refuses a grammar that takes more CPU than this to compile (in a process of
# its own, killed at the limit: frontend/grammar_check.py; a schema nested 300 deep takes
# 2-3 s); a node compiles what passed beside its loop (Compiles), never on it.
MAX_COMPILE_CPU_S = 0.5


class GrammarError(ValueError):
    """A grammar that cannot be compiled, said so a client can act on it."""


@functools.lru_cache(maxsize=1)
def _module():
    try:
        import xgrammar

        return xgrammar, None
    except Exception as e:  # ImportError, or a native library that does not load here
        return (
            None,
            "structured outputs need xgrammar, which does not import here "
            f"({type(e).__name__}: {e})",
        )


def why_unusable() -> str | None:
    return _module()[1]


def bits_to_mask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 words -> [B, V] bool, True where the token is allowed."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab_size]


def mask_to_bits(allowed: np.ndarray) -> torch.Tensor:
    """[32 W] bool -> [W] int32 words, bits_to_mask's inverse: bit i of word w is token
    32 w + i (little-endian words of little-endian bit order)."""
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view("<i4").copy())


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def for_model(model_dir: str | None, vocab_size: int, max_threads: int = 8) -> "Grammars":
    """The grammars of a model directory's tokenizer; GrammarError says why there are none."""
    if model_dir is None:
        raise GrammarError(
            "structured outputs need the model's tokenizer: this node was started with "
            "--shape, not --model"
        )
    from transformers import AutoTokenizer

    return Grammars(AutoTokenizer.from_pretrained(model_dir), vocab_size, max_threads)


def _finite(text: str) -> float:
    """A JSON number as a float; past a double's range (xgrammar fails on it without a
    word) an OverflowError naming it."""
    value = float(text)
    if math.isinf(value):
        raise OverflowError(f"the number {text[:32]} is out of range")
    return value


def _int64(text: str) -> int:
    """A JSON integer; past 64 bits (xgrammar fails on it without a word) an OverflowError
    naming it."""
    value = int(text)
    if not -(2**63) <= value < 2**63:
        raise OverflowError(f"the number {text[:32]} is out of range")
    return value


class Grammars:
    """The grammars of one tokenizer: compiled once each (the latest MAX_COMPILED kept)."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 8):
        xgr, why = _module()
        if xgr is None:
            raise GrammarError(why)
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        # [W] int32 words: the tokens with no control byte (special tokens, EOS among them, kept)
        safe = np.ones(num_words(vocab_size) * 32, dtype=bool)
        special = set(self.info.special_token_ids) | set(self.info.stop_token_ids)
        for i, piece in enumerate(self.info.decoded_vocab[:vocab_size]):
            if i not in special and any(b < 0x20 for b in piece):
                safe[i] = False
        self.json_safe = mask_to_bits(safe)
        stops = np.zeros(num_words(vocab_size) * 32, dtype=bool)
        stops[[t for t in self.info.stop_token_ids if t < vocab_size]] = True
        self.stop_only = mask_to_bits(stops)  # [W]: EOS alone
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()  # NOTE: callers on several threads may share one

    def compile(self, grammar: tuple[str, str, str]):
        """The compiled grammar; GrammarError says why it does not compile."""
        key = tuple(grammar)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
            compiled = self._compile(*grammar)
            try:
                self._check_matches_some(compiled)
            except GrammarError:
                raise
            except Exception as e:  # xgrammar's own, as a compile's: the grammar's fault
                raise GrammarError(f"the grammar cannot be followed: {type(e).__name__}") from None
            self._compiled[key] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
            return compiled

    def _compile(self, kind: str, spec: str, whitespace: str):
        if kind not in KINDS:
            raise GrammarError(f"a grammar is one of {', '.join(KINDS)}, got {kind[:32]!r}")
        if whitespace not in WHITESPACE:
            raise GrammarError(
                f"a grammar's whitespace is one of {', '.join(WHITESPACE)}, got {whitespace[:32]!r}"
            )
        c, is_any = self._compiler, whitespace == "any"
        try:
            if kind == "json_schema":
                # a plain error before xgrammar's own
                json.loads(spec, parse_float=_finite, parse_int=_int64)
                return c.compile_json_schema(spec, any_whitespace=is_any)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=is_any)
            if kind == "regex":
                re.compile(spec)
                return c.compile_regex(spec)
            if kind == "choice":
                choices = json.loads(spec)
                if (
                    not isinstance(choices, list)
                    or not choices
                    or not all(isinstance(x, str) for x in choices)
                ):
                    raise GrammarError("a choice is a non-empty list of strings")
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in choices))
            return c.compile_grammar(spec)
        except GrammarError:
            raise
        except json.JSONDecodeError as e:
            raise GrammarError(f"the {kind} is not valid JSON: {e}") from None
        except OverflowError as e:
            raise GrammarError(f"the {kind} cannot be compiled: {e}") from None
        except re.error as e:
            raise GrammarError(f"the regex does not compile: {e}") from None
        except Exception as e:  # xgrammar's own errors (RuntimeError, ValueError, ...)
            # NOTE: some have no text ("minimum": 1e400 is an IndexError of none)
            lines = str(e).strip().splitlines() or [type(e).__name__]
            raise GrammarError(f"the {kind} cannot be compiled: {lines[0][:300]}") from None

    def _check_matches_some(self, compiled) -> None:
        """GrammarError where the grammar allows no first token (`root ::= root`, a schema
        no value meets): it matches no text, and a request under it could only make tokens
        it forbids."""
        bits = torch.zeros(1, num_words(self.vocab_size), dtype=torch.int32)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bits)
        if not bool(bits.any()):
            raise GrammarError("the grammar matches no text: it allows no first token")

    def xgrammar_matcher(self, grammar: tuple[str, ...], compiled=None):
        return self._xgr.GrammarMatcher(
            self.compile(tuple(grammar)) if compiled is None else compiled
        )


class Compiles:
    """A node's grammars, compiled beside its loop, one at a time in the order asked
    (xgrammar releases the GIL: the loop and its steps go on meanwhile). make() gives the
    Grammars, on the first compile (loading the tokenizer's vocabulary takes a while too).
    A compiled grammar stays with its request's key until taken: however many others are
    compiled meanwhile, it is never compiled again on the loop."""

    def __init__(self, make: Callable[[], Grammars], clock: Callable[[], float] = time.monotonic):
        self._make, self.clock = make, clock
        self.grammars: Grammars | None = None  # once the first compile has run
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._futures: dict[str, Future] = {}
        # key -> [when its compile began (clock), or None before]: one holder a submission,
        # so a start written after its key was dropped reaches nobody's.
        self._starts: dict[str, list] = {}
        self._running: list | None = None  # the holder of the compile under way

    def submit(self, key: str, grammar: tuple[str, str, str]) -> None:
        if key not in self._futures:
            start = self._starts[key] = [None]
            self._futures[key] = self._pool.submit(self._compile, start, tuple(grammar))

    def _compile(self, start: list, grammar: tuple[str, str, str]):
        start[0] = self.clock()
        self._running = start
        try:
            if self.grammars is None:  # the first compile's time holds the vocabulary's load
                self.grammars = self._make()
            return self.grammars.compile(grammar)
        finally:
            self._running = None

    def is_stuck(self, deadline_s: float) -> bool:
        """The compile under way (anyone's, one dropped too) has run past deadline_s: those
        queued behind it wait on it, and it cannot be stopped."""
        running = self._running
        return running is not None and self.clock() - running[0] > deadline_s

    def keys(self) -> list[str]:
        """The keys compiled or being compiled, not taken yet."""
        return list(self._futures)

    def is_done(self, key: str) -> bool:
        f = self._futures.get(key)
        return f is not None and f.done()

    def running_s(self, key: str) -> float | None:
        """Seconds key's compile has run (done or not), or None before it starts: one
        queued behind others is not yet its own."""
        start = self._starts.get(key)
        return None if start is None or start[0] is None else self.clock() - start[0]

    def take(self, key: str):
        """The compiled grammar of a key whose compile is done; GrammarError says why it
        does not compile (any other failure too: a client's grammar must never end a loop)."""
        self._starts.pop(key, None)
        try:
            return self._futures.pop(key).result(0)
        except GrammarError:
            raise
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            fault = GrammarError(f"the grammar could not be compiled here: {why}")
            fault.is_retryable = True  # this node's fault (its vocabulary, say), not the grammar's
            raise fault from None

    def drop(self, key: str) -> None:
        """Its request ended: its compile is not wanted (a pending one is skipped).
        NOTE: one under way runs to its end: the thread is the next one's only then."""
        self._starts.pop(key, None)
        f = self._futures.pop(key, None)
        if f is not None:
            f.cancel()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._futures.clear()
