"""Sampling on the device.

Random draws are counter-based: the noise for (seed, position, token id) is a
hash of the three, so a request's tokens depend only on its own seed and
logits, never on which other requests share its batch or which node samples.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


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


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    min_p: torch.Tensor | None = None,
    logp_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] fp32; per-row params [B]; positions [B] = index of the token
    being sampled. -> [B] int64. Rows with temperature 0 take the argmax.
    min_p [B]: drop tokens less likely than min_p times the likeliest (after temperature).
    logp_out [B, V]: filled with the log-probabilities sampled from (greedy rows: of the
    logits as given)."""
    greedy = logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    scaled = logits / temperature.clamp_min(1e-5)[:, None]
    if min_p is not None:
        floor = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p.clamp_min(1e-30))[:, None]
        scaled = scaled.masked_fill((scaled < floor) & (min_p > 0)[:, None], float("-inf"))
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = top_k.long()[:, None]
    drop = (k > 0) & (ranks >= k)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    logp = torch.log_softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    if logp_out is not None:
        sampled_logp = torch.empty_like(logp).scatter_(1, order, logp)
        logp_out.copy_(
            torch.where((temperature > 0)[:, None], sampled_logp, torch.log_softmax(logits, dim=-1))
        )
    # Gumbel-max with noise indexed by token id, so it does not depend on the sort.
    u = uniform_noise(seeds, positions, vocab).gather(1, order)
    choice = (logp - torch.log(-torch.log(u))).argmax(dim=-1, keepdim=True)
    sampled = order.gather(1, choice)[:, 0]
    return torch.where(temperature > 0, sampled, greedy)
