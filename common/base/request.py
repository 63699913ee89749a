"""A request's sampling parameters and the rules every role applies to a request:
its validation and why it stops. Pure Python: the frontend, the schedulers and the
engine share it."""
from __future__ import annotations

from dataclasses import dataclass

# top_k <= 0 disables top-k; -1 is the documented spelling.
TOP_K_DISABLED = -1
MAX_STOP_TOKEN_IDS = 64
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0       # 0 = greedy
    top_p: float = 1.0             # in (0, 1]
    top_k: int = TOP_K_DISABLED    # >= 1 keeps the k best; 0 or -1 disables
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0 \
                or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or \
                not -1 <= self.top_k <= vocab_size:
            raise ValueError(f"top_k must be an integer in [-1, {vocab_size}] (the vocabulary; "
                             f"-1 or 0 disables), got {self.top_k!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids entry {t!r} is outside the vocabulary [0, {vocab_size})")


def stop_reason(p: SamplingParams, token: int, num_output: int, prompt_len: int,
                eos_ids: tuple[int, ...], max_model_len: int) -> str | None:
    """Why a request ends once token is its num_output-th output token, or None."""
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids):
        return FINISH_STOP
    if num_output >= p.max_tokens or prompt_len + num_output >= max_model_len:
        return FINISH_LENGTH
    return None


def validate_prompt(token_ids: list[int], max_tokens: int, vocab_size: int, max_model_len: int) -> None:
    if len(token_ids) == 0:
        raise ValueError("the prompt is empty")
    # NOTE: the length first: a prompt of millions of ids is refused without reading them.
    if len(token_ids) + max_tokens > max_model_len:
        raise ValueError(f"prompt length {len(token_ids)} + max_tokens {max_tokens} exceeds the "
                         f"model's maximum length {max_model_len}")
    if not (all(type(t) is int for t in token_ids) and 0 <= min(token_ids) and max(token_ids) < vocab_size):
        bad = next(t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
                   or not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})")
