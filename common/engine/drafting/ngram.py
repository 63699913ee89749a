"""Prompt lookup on the device (kernels.prompt_lookup): a row's last n tokens are looked
for earlier in its own tokens (prompt and output), longest n first, and the tokens that
followed the latest match are its drafts (repeated where they reach the row's end). Each
row's tokens live in a device buffer written once when the sequence joins and appended on
the device by every step (a plain step's advance writes it: history), so proposing copies
nothing from the host."""

from __future__ import annotations

import torch

import kernels
from common.engine.h2d import HostToDevice


class NgramDrafter:
    def __init__(
        self,
        max_rows: int,
        max_len: int,
        max_k: int,
        min_n: int,
        max_n: int,
        h2d: HostToDevice,
    ):
        self.min_n, self.max_n = min_n, max_n
        self._h2d = h2d
        # NOTE: k + 1 columns past max_len: a verify step writes all its tokens, accepted
        # or not, and a row at the model's limit must not write out of bounds.
        width = max_len + max_k + 1
        self.tokens = torch.zeros(max_rows, width, dtype=torch.int32, device=h2d.device)
        self.history = self.tokens  # a plain step's token lands here (kernels.advance_step)
        self._steps = torch.arange(max_k + 1, device=h2d.device)

    def set_row(self, row: int, token_ids: list[int]) -> None:
        if len(token_ids) > self.tokens.shape[1]:
            raise ValueError(f"{len(token_ids)} tokens exceed the drafter's rows")
        self._h2d.write(self.tokens[row, : len(token_ids)], token_ids)

    def remove_row(self, row: int, last: int) -> None:
        if row != last:
            self.tokens[row].copy_(self.tokens[last])

    def propose(self, n: int, seq_lens: torch.Tensor, k: int, width: int) -> torch.Tensor:
        width = min(width, self.tokens.shape[1])
        return kernels.prompt_lookup(
            self.tokens[:n], seq_lens[:n], k, self.min_n, self.max_n, width
        )

    def append(self, n: int, seq_lens: torch.Tensor, tokens: torch.Tensor) -> None:
        pos = seq_lens[:n, None].long() + self._steps[: tokens.shape[1]]  # [n, k + 1]
        self.tokens[:n].scatter_(1, pos, tokens.to(self.tokens.dtype))

    def took(self, tokens: list[list[int]], num_drafted_rows: int | None = None) -> None:
        pass  # every step appends its tokens on the device (history, append)

    def took_one(self, tokens: list[int]) -> None:
        pass

    def proposed_none(self) -> None:
        pass
