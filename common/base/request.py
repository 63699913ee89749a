"""A request's sampling parameters and the rules every role applies to a request:
its validation and why it stops. Pure Python: the frontend, the schedulers and the
engine share it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# top_k <= 0 disables top-k; -1 is the documented spelling.
TOP_K_DISABLED = -1
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's limit)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_BAD_WORDS = 128  # token sequences of bad_words, each at most MAX_BAD_WORD_LEN
MAX_BAD_WORD_LEN = 32
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"

# Prefill on the decode node: the decode node (decode_node/local.py) runs and paces it, and
# the frontend's rule (frontend/paths.py) routes prompts there predicting with the same
# figures. A local prompt runs LOCAL_CHUNK_TOKENS at a time between decode steps; while
# sequences run, local passes take at most LOCAL_SHARE of the node's time (their time per
# output token grows by at most 1 / (1 - LOCAL_SHARE), 1.18x), LOCAL_SHARE * LOCAL_WINDOW_S
# of it at once.
LOCAL_CHUNK_TOKENS = 256
LOCAL_SHARE = 0.15
LOCAL_WINDOW_S = 2.0


@dataclass
class TokenLogprobs:
    """What is reported of one token: its log-probability, and the top_ids likeliest
    tokens at its place with theirs (-9999.0 stands for -inf)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are chosen and what is reported of them. Every field past
    ignore_eos is off at its default, and a request that sets none of them is sampled
    exactly as before they existed (common/engine/logits.py applies the rest)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = TOP_K_DISABLED  # >= 1 keeps the k best; 0 or -1 disables
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # What is reported: -1 none; 0 the chosen token's log-probability; k also the k likeliest.
    num_logprobs: int = -1
    num_prompt_logprobs: int = -1  # the same for every prompt token after the first (prefill node)
    # The logprobs reported are of the distribution sampled from, not the model's raw logits.
    is_processed_logprobs: bool = False
    # Penalties and masks, applied to the logits before temperature (OpenAI's and vLLM's meanings).
    presence_penalty: float = 0.0  # minus this for every token already generated
    frequency_penalty: float = 0.0  # minus this times how often it was generated
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output
    min_p: float = 0.0  # drop tokens below min_p times the likeliest's probability
    min_tokens: int = 0  # no stop token or EOS before this many tokens
    logit_bias_ids: tuple[int, ...] = ()
    logit_bias: tuple[float, ...] = ()  # added to the logit of logit_bias_ids[i]
    allowed_token_ids: tuple[int, ...] = ()  # when given, only these
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences never completed
    num_prior_outputs: int = 0  # a moved request: the prompt's last tokens are outputs it streamed
    # Structured output: (kind, spec, whitespace) (common/base/grammar.py).
    grammar: tuple[str, ...] = ()
    no_drafts: bool = False  # the request opts out of speculative decoding

    def split(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """A prompt as sent to a node -> (the client's prompt, the outputs already streamed)."""
        cut = len(token_ids) - self.num_prior_outputs
        return list(token_ids[:cut]), list(token_ids[cut:])

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_plain(self) -> bool:
        """Nothing but temperature, top-p, top-k and seed: the fast sampling path."""
        return self.num_logprobs < 0 and not self.is_processing

    @property
    def is_processing(self) -> bool:
        """Logits are changed before sampling (penalties, bias, masks, min_p, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_p
            or self.min_tokens
            or self.logit_bias_ids
            or self.allowed_token_ids
            or self.bad_words_ids
            or self.grammar
        )

    @property
    def is_masked_per_step(self) -> bool:
        """The next token's mask depends on the tokens before it: a grammar, or a bad word of
        several tokens."""
        return bool(self.grammar) or any(len(w) > 1 for w in self.bad_words_ids)

    def validate(self, vocab_size: int) -> None:
        if (
            isinstance(self.max_tokens, bool)
            or not isinstance(self.max_tokens, int)
            or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (
            not isinstance(self.temperature, (int, float))
            or not self.temperature >= 0
            or self.temperature == float("inf")
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or not -1 <= self.top_k <= vocab_size
        ):
            raise ValueError(
                f"top_k must be an integer in [-1, {vocab_size}] (the vocabulary; "
                f"-1 or 0 disables), got {self.top_k!r}"
            )
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**63
        ):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}"
            )
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(
                    f"stop_token_ids entry {t!r} is outside the vocabulary [0, {vocab_size})"
                )
        self._validate_extras(vocab_size)

    def _validate_extras(self, vocab_size: int) -> None:
        for name in ("num_logprobs", "num_prompt_logprobs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not -1 <= v <= MAX_LOGPROBS:
                raise ValueError(
                    f"{name} must be an integer in [-1, {MAX_LOGPROBS}] (-1: none), got {v!r}"
                )
        for name, lo, hi in (
            ("presence_penalty", -2.0, 2.0),
            ("frequency_penalty", -2.0, 2.0),
            ("repetition_penalty", 1e-3, 100.0),
            ("min_p", 0.0, 1.0),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}], got {v!r}")
        if (
            isinstance(self.num_prior_outputs, bool)
            or not isinstance(self.num_prior_outputs, int)
            or self.num_prior_outputs < 0
        ):
            raise ValueError(
                f"num_prior_outputs must be an integer >= 0, got {self.num_prior_outputs!r}"
            )
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or not 0 <= self.min_tokens <= self.max_tokens + self.num_prior_outputs
        ):
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}"
            )
        if (
            len(self.logit_bias_ids) != len(self.logit_bias)
            or len(self.logit_bias) > MAX_LOGIT_BIAS
        ):
            raise ValueError(
                f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids, each with one bias"
            )
        for b in self.logit_bias:
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise ValueError(f"a logit_bias value must be a number in [-100, 100], got {b!r}")
        if len(self.bad_words_ids) > MAX_BAD_WORDS or any(
            not 0 < len(w) <= MAX_BAD_WORD_LEN for w in self.bad_words_ids
        ):
            raise ValueError(
                f"bad_words: at most {MAX_BAD_WORDS}, each of 1 to {MAX_BAD_WORD_LEN} tokens"
            )
        if self.grammar and (
            len(self.grammar) != 3 or not all(isinstance(g, str) for g in self.grammar)
        ):
            raise ValueError("grammar is (kind, spec, whitespace)")
        if len(self.allowed_token_ids) > vocab_size:
            raise ValueError("allowed_token_ids holds more ids than the vocabulary")
        for name, ids in (
            ("logit_bias", self.logit_bias_ids),
            ("allowed_token_ids", self.allowed_token_ids),
            ("bad_words", [t for w in self.bad_words_ids for t in w]),
        ):
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                    raise ValueError(
                        f"{name}: token id {t!r} is outside the vocabulary [0, {vocab_size})"
                    )


def stop_reason(
    p: SamplingParams,
    token: int,
    num_output: int,
    prompt_len: int,
    eos_ids: tuple[int, ...],
    max_model_len: int,
) -> str | None:
    """Why a request ends once token is its num_output-th output token, or None."""
    if (
        token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids)
    ) and num_output + p.num_prior_outputs > p.min_tokens:
        return FINISH_STOP
    if num_output >= p.max_tokens or prompt_len + num_output >= max_model_len:
        return FINISH_LENGTH
    return None


def validate_prompt(
    token_ids: list[int], max_tokens: int, vocab_size: int, max_model_len: int
) -> None:
    if len(token_ids) == 0:
        raise ValueError("the prompt is empty")
    # NOTE: the length first: a prompt of millions of ids is refused without reading them.
    if len(token_ids) + max_tokens > max_model_len:
        raise ValueError(
            f"prompt length {len(token_ids)} + max_tokens {max_tokens} exceeds the "
            f"model's maximum length {max_model_len}"
        )
    if not (
        all(type(t) is int for t in token_ids)
        and 0 <= min(token_ids)
        and max(token_ids) < vocab_size
    ):
        bad = next(
            t
            for t in token_ids
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
        )
        raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})")


def check_request(
    request_ids: list[str],
    params: SamplingParams,
    token_ids: list[int],
    vocab_size: int,
    max_model_len: int,
    is_held: Callable[[str], bool],
) -> None:
    """What a node that prefills a request checks before taking it: its sampling
    parameters, its prompt, and its ids (its own and its forks'), each new here.
    ValueError: refused, said to the client."""
    params.validate(vocab_size)
    validate_prompt(token_ids, params.max_tokens, vocab_size, max_model_len)
    if len(set(request_ids)) != len(request_ids) or any(is_held(r) for r in request_ids):
        raise ValueError("a request of this id is already here")
