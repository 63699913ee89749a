"""Sampling parameters, their validation, and sampling on the device.

Random draws are counter-based: the noise for (seed, position, token id) is a
hash of the three, so a request's tokens depend only on its own seed and
logits, never on which other requests share its batch or which node samples.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# top_k <= 0 disables top-k; -1 is the documented spelling.
TOP_K_DISABLED = -1
_M32 = 0xFFFFFFFF
MAX_STOP_TOKEN_IDS = 64
FINISH_STOP = "stop"
FINISH_LENGTH = "length"


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
    bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) + max_tokens > max_model_len:
        raise ValueError(f"prompt length {len(token_ids)} + max_tokens {max_tokens} exceeds the "
                         f"model's maximum length {max_model_len}")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2**32).
    NOTE: the second multiply can exceed int64; it wraps and the low 32 bits stay right."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds, positions [B] int -> [B, V] fp32 in (0, 1), a pure function of its inputs."""
    s = seeds.long()
    row = _mix32((s & _M32) ^ _mix32(((s >> 32) & _M32) ^ _mix32(positions.long() & _M32)))
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _mix32(row[:, None] ^ ids[None, :])
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           top_k: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32; per-row params [B]; positions [B] = index of the token
    being sampled. -> [B] int64. Rows with temperature 0 take the argmax."""
    greedy = logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    scaled = logits / temperature.clamp_min(1e-5)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = top_k.long()[:, None]
    drop = (k > 0) & (ranks >= k)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    logp = torch.log_softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Gumbel-max with noise indexed by token id, so it does not depend on the sort.
    u = uniform_noise(seeds, positions, vocab).gather(1, order)
    choice = (logp - torch.log(-torch.log(u))).argmax(dim=-1, keepdim=True)
    sampled = order.gather(1, choice)[:, 0]
    return torch.where(temperature > 0, sampled, greedy)
