"""A prefill pass's first tokens: each sampled chunk's own, and its forks' (n > 1), each
with its own parameters over the same logits."""

from __future__ import annotations

from typing import Callable

import torch

from common.engine import logits as logit_rules
from common.engine.prefill_job import PrefillChunk
from common.engine.sampling import sample


def choose(
    logits: torch.Tensor,
    chunks: list[PrefillChunk],
    sampled_idx: list[int],
    out: list[int | None],
    eos_ids: tuple[int, ...],
    to_device: Callable,
) -> None:
    """logits [len(sampled_idx), V]: those of the chunks sampled_idx names, at their last
    token. Each such chunk's first token into out[i] (its log-probabilities, where asked,
    into the chunk), and its forks' into chunk.fork_tokens and fork_logprobs."""
    # Rows to sample: (chunk, 0) its own first token, (chunk, j) its fork j's (n > 1),
    # which samples the same logits again with its own params (seed).
    rows = [
        (k, i, j) for k, i in enumerate(sampled_idx) for j in range(1 + len(chunks[i].fork_params))
    ]
    row_logits = (
        logits
        if len(rows) == len(sampled_idx)
        else logits[to_device([k for k, _, _ in rows], torch.int64)]
    )
    ps = [chunks[i].fork_params[j - 1] if j else chunks[i].params for _, i, j in rows]
    positions = [chunks[i].context_len + len(chunks[i].token_ids) for _, i, _ in rows]
    reported = [None] * len(rows)
    if all(p.is_plain for p in ps):
        tokens = sample(
            row_logits,
            to_device([p.temperature for p in ps], torch.float32),
            to_device([p.top_p for p in ps], torch.float32),
            to_device([p.top_k for p in ps], torch.int32),
            to_device([p.seed for p in ps], torch.int64),
            to_device(positions, torch.int64),
        ).tolist()
    else:
        tokens, reported = logit_rules.choose_first(
            row_logits,
            ps,
            [chunks[i].history for _, i, _ in rows],
            positions,
            eos_ids,
            to_device,
            [chunks[i].mask for _, i, _ in rows],
        )
    for (_, i, j), t, lp in zip(rows, tokens, reported):
        if j:
            chunks[i].fork_tokens.append(t)
            chunks[i].fork_logprobs.append(lp)
        else:
            out[i], chunks[i].logprobs = t, lp
