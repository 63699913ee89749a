"""Sampling on the device.

Random draws are counter-based: the noise for (seed, position, token id) is a
hash of the three, so a request's tokens depend only on its own seed and
logits, never on which other requests share its batch or which node samples.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
ROW_AT_A_TIME = 1 << 15  # on the CPU, vocabularies this large draw their noise a row at a time


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
    # NOTE: 2**24 - 0.5 rounds to 2**24 in float32: u would be 1 and its token's Gumbel
    # noise +inf (NaN where masked), winning against every mask
    return (((h >> 8).float() + 0.5) * (1.0 / (1 << 24))).clamp_(max=1.0 - 2.0**-24)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    min_p: torch.Tensor | None = None,
    logp_out: torch.Tensor | None = None,
    is_filtered: bool | None = None,
) -> torch.Tensor:
    """logits [B, V] fp32; per-row params [B]; positions [B] = index of the token
    being sampled. -> [B] int64. Rows with temperature 0 take the argmax.
    min_p [B]: drop tokens less likely than min_p times the likeliest (after temperature).
    logp_out [B, V]: filled with the log-probabilities sampled from (greedy rows: of the
    logits as given). is_filtered: whether a row may have top-p < 1 or top-k (False skips
    the sort); None: read from the tensors where that costs nothing (on the CPU), else
    assumed (a captured graph cannot branch on them).
    NOTE: a row's token depends on its own logits, params, seed and position alone, on
    either path: the draw is the argmax over token ids of its kept logits plus noise
    keyed by token id, and what top-k and top-p keep is decided by value."""
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp_min(1e-5)[:, None]
    if min_p is not None:
        floor = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p.clamp_min(1e-30))[:, None]
        scaled = scaled.masked_fill((scaled < floor) & (min_p > 0)[:, None], float("-inf"))
    if is_filtered is None:
        is_filtered = logits.device.type != "cpu" or bool(((top_k > 0) | (top_p < 1)).any())
    if is_filtered:
        scaled = _keep_top(scaled, top_p, top_k)
    if logp_out is not None:
        logp_out.copy_(
            torch.where(
                (temperature > 0)[:, None],
                torch.log_softmax(scaled, dim=-1),
                torch.log_softmax(logits, dim=-1),
            )
        )
    sampled = _gumbel_argmax(scaled, seeds, positions)
    return torch.where(temperature > 0, sampled, greedy)


def _gumbel_argmax(scaled: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor):
    """Each row's argmax of scaled [B, V] plus Gumbel noise keyed by token id -> [B]: a draw
    from its softmax (no normalizing needed: a row's constant leaves its argmax as is).
    NOTE: on the CPU a row at a time where rows are large: a batch's [B, V] int64
    temporaries cost more in fresh pages than in hashing (8 rows of Qwen3's vocabulary: 14
    against 3 ms), while small rows pay a loop's per-op cost (64 rows of 512: 5.7 against
    0.3 ms)."""
    vocab = scaled.shape[-1]
    if scaled.device.type != "cpu" or vocab < ROW_AT_A_TIME:
        u = uniform_noise(seeds, positions, vocab)
        return (scaled - torch.log(-torch.log(u))).argmax(dim=-1)
    out = torch.empty(scaled.shape[0], dtype=torch.int64)
    for i in range(scaled.shape[0]):
        u = uniform_noise(seeds[i : i + 1], positions[i : i + 1], vocab)
        out[i] = (scaled[i : i + 1] - torch.log(-torch.log(u))).argmax()
    return out


def _keep_top(scaled: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """scaled [B, V] with -inf below each row's floor: the least value its top-k (k > 0)
    and then its top-p (p < 1: the smallest run of likeliest tokens whose mass reaches p,
    the first always kept) keep. NOTE: only the sorted values are read, never the order of
    ties, so ties at the floor are all kept and the floor is the same on any path."""
    values = scaled.sort(dim=-1, descending=True).values  # [B, V]
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    k = top_k.long()[:, None]
    drop = (k > 0) & (ranks >= k)
    probs = torch.softmax(values.masked_fill(drop, float("-inf")), dim=-1)
    drop |= ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1)[:, None]
    # [B, 1]: what is dropped is a tail; NOTE: the first always stays, also where a top_p
    # below float32's least (5e-324 is "in (0, 1]") reads as 0 here
    num_kept = (~drop).sum(dim=-1, keepdim=True).clamp_(min=1)
    floor = values.gather(1, num_kept - 1)
    return scaled.masked_fill(scaled < floor, float("-inf"))
