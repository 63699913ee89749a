"""Prompt lookup on the device: a row's last n tokens are looked for earlier in its own
tokens (prompt and output), longest n first, and the tokens that followed the latest
match are its drafts (repeated where they reach the row's end). Each row's tokens live in
a device buffer written once when the sequence joins and appended on the device by every
step (a plain step's advance writes it: history), so proposing copies nothing from the host."""

from __future__ import annotations

import torch

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
        rows = self.tokens[:n, :width]  # [n, W]
        lens = seq_lens[:n, None].long()  # [n, 1]
        start = torch.full_like(lens, -1)  # where each row's drafts begin
        for size in range(self.max_n, self.min_n - 1, -1):
            if width <= size:
                continue
            at = self._steps[:size]
            suffix = rows.gather(1, (lens - size + at).clamp_(min=0))  # [n, size]
            windows = rows.unfold(1, size, 1)  # [n, W - size + 1, size]
            is_hit = (windows == suffix[:, None, :]).all(-1)  # [n, P]
            # A match must end before the last token: at least one token follows it.
            p = torch.arange(is_hit.shape[1], device=rows.device)
            is_hit &= p[None, :] <= lens - size - 1
            latest = torch.where(is_hit, p[None, :], -1).amax(1, keepdim=True)  # [n, 1]
            start = torch.where((start < 0) & (latest >= 0), latest + size, start)
        # What followed the match runs up to the row's end; past it the drafts repeat it
        # (the suffix recurs every lens - start tokens: loops and repeated lines).
        period = (lens - start).clamp_(min=1)
        pos = start + self._steps[:k] % period  # [n, k]
        drafts = rows.gather(1, pos.clamp_(0, width - 1)).long()
        return drafts.masked_fill_(start < 0, -1)

    def append(self, n: int, seq_lens: torch.Tensor, tokens: torch.Tensor) -> None:
        pos = seq_lens[:n, None].long() + self._steps[: tokens.shape[1]]  # [n, k + 1]
        self.tokens[:n].scatter_(1, pos, tokens.to(self.tokens.dtype))

    def took(self, tokens: list[list[int]]) -> None:
        pass  # every step appends its tokens on the device (history, append)
