"""Drafts for speculative decoding: a drafter proposes up to k tokens per decode row, from
the row's own tokens (prompt lookup, on the device) or from every token the node has seen
(suffix decoding, on the host), and is told the tokens each step made.

One interface (Drafter); the decode batch never names an implementation: make_drafter
picks it from the SpeculativeConfig. A drafter's state is per row, and rows move as the
batch's do (a leaving row is filled by the last live one)."""

from __future__ import annotations

from typing import Protocol

import torch

from common.base.speculative import SpeculativeConfig
from common.engine.h2d import HostToDevice


class Drafter(Protocol):
    # Each row's tokens on the device [max_rows, W] int32, which a plain step writes its
    # token into as it advances (kernels.advance_step: no op of the drafter's own in a
    # plain step); None where the drafter keeps none there.
    history: torch.Tensor | None

    def set_row(self, row: int, token_ids: list[int]) -> None:
        """A sequence joins at row: every token it has (prompt, then output; the last is
        its next input), through the counted host-to-device copy."""

    def remove_row(self, row: int, last: int) -> None:
        """The sequence at row leaves; the last live row's state moves into it (unless row
        is the last)."""

    def propose(self, n: int, seq_lens: torch.Tensor, k: int, width: int) -> torch.Tensor:
        """Drafts [n, k] int64 for rows [0, n), -1 where none: the tokens proposed to follow
        each row's seq_lens[i] tokens. width: an upper bound of seq_lens (host-known)."""

    def append(self, n: int, seq_lens: torch.Tensor, tokens: torch.Tensor) -> None:
        """On the device, in every verify step: it made tokens [n, k + 1] at
        positions seq_lens[i] + j of each row (seq_lens: the lengths before it). Those past
        what was accepted are overwritten before they are read: a drafter reads a row only
        below its length."""

    def took(self, tokens: list[list[int]], num_drafted_rows: int | None = None) -> None:
        """On the host, once a verify step is collected: each row's new tokens, in row
        order; num_drafted_rows: how many rows had a draft to take (those whose request
        opted out had none; None: every row)."""

    def took_one(self, tokens: list[int]) -> None:
        """On the host, once a plain step is collected: each row's one new token, in row
        order (NOTE: every plain step of a running batch: a drafter keeps it cheap)."""

    def proposed_none(self) -> None:
        """What propose just gave had no draft in any row, and no verify step takes it (the
        step runs plain): as telling, as a verify step whose rows took none."""


def make_drafter(
    config: SpeculativeConfig,
    max_rows: int,
    max_len: int,
    h2d: HostToDevice,
    is_pinned: bool = False,
) -> Drafter | None:
    """The config's drafter for max_rows rows of up to max_len tokens (is_pinned: host
    buffers it copies from are pinned); None when off."""
    if not config.is_on:
        return None
    if config.method == "ngram":
        from common.engine.drafting.ngram import NgramDrafter

        return NgramDrafter(
            max_rows,
            max_len,
            config.num_speculative_tokens,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            h2d,
        )
    if config.method == "suffix":
        from common.engine.drafting.suffix import SuffixDrafter

        return SuffixDrafter(
            max_rows,
            config.num_speculative_tokens,
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests,
            h2d,
            is_pinned,
        )
    raise ValueError(f"no drafter for method {config.method!r}")
