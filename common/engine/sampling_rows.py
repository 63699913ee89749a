"""The decode batch's per-row sampling state: each row's temperature, top-p, top-k and seed
on the device, what it asks to be reported (log-probabilities, raw or processed), its step
mask, and, for rows with penalties or masks, the logits.RowState made on first use.

Host mirrors say what a step over rows [0, n) needs without reading the device back: a
batch of plain rows takes the plain path (on CUDA a captured graph, which replays these
same fixed buffers); any other puts it on the full path (logits.choose), whose
log-probabilities are copied to one of two pinned host slots with the step's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.base.grammar import bits_to_mask, num_words
from common.base.request import MAX_LOGPROBS, SamplingParams, TokenLogprobs
from common.engine import logits as logit_rules
from common.engine.h2d import HostToDevice
from common.engine.sampling import sample


@dataclass
class SamplingPlan:
    """What a step over rows [0, n) asks of the sampler, read from the host mirrors."""

    is_greedy: bool  # every row takes the argmax
    is_plain: bool  # no row asks for log-probabilities, penalties or masks
    num_logprobs: int | None  # None when plain, else the most any row asked for (-1: none)
    row_num_logprobs: list[int] | None  # per row (-1: none), when any row asked


class SamplingRows:
    def __init__(
        self,
        max_batch_size: int,
        vocab_size: int,
        h2d: HostToDevice,
        is_pinned: bool,
        eos_ids: tuple[int, ...] = (),
    ):
        n, dev = max_batch_size, h2d.device
        self.max_batch_size = max_batch_size
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._h2d = h2d
        self._temperature = torch.zeros(n, dtype=torch.float32, device=dev)  # [n]
        self._top_p = torch.ones(n, dtype=torch.float32, device=dev)  # [n]
        self._top_k = torch.full((n,), -1, dtype=torch.int32, device=dev)  # [n]
        self._seeds = torch.zeros(n, dtype=torch.int64, device=dev)  # [n]
        # Host mirrors, read at launch without reading the device back.
        self._host_is_greedy = np.ones(n, dtype=bool)
        self._host_num_logprobs = np.full(n, -1, dtype=np.int32)
        self._host_is_processed = np.zeros(n, dtype=bool)  # processed (not raw) log-probabilities
        self._host_is_processing = np.zeros(n, dtype=bool)  # penalties or masks
        self._rows: logit_rules.RowState | None = None  # made when a row first needs it
        self._is_processed = torch.zeros(n, dtype=torch.bool, device=dev)  # [n]
        # The chosen token's log-probability [n], the likeliest [n, MAX_LOGPROBS] and their
        # ids [n, MAX_LOGPROBS].
        self._logprobs = (
            torch.zeros(n, dtype=torch.float32, device=dev),
            torch.zeros(n, MAX_LOGPROBS, dtype=torch.float32, device=dev),
            torch.zeros(n, MAX_LOGPROBS, dtype=torch.int64, device=dev),
        )
        # Two host slots each: a step may be collected while the next one is in flight.
        self._logprobs_host = tuple(
            torch.zeros(2, *t.shape, dtype=t.dtype, pin_memory=is_pinned) for t in self._logprobs
        )
        self._is_pinned = is_pinned
        self._spread: tuple[torch.Tensor, ...] = ()  # the same for a verify step's positions
        self._spread_host: tuple[torch.Tensor, ...] = ()
        # Grammar masks [n, W] int32 words: set on the host before each step (the one per-step
        # copy in, and only for a batch that has a grammar row); -1 (every token) in the rows
        # without one.
        words = num_words(vocab_size)
        self._host_has_step_mask = np.zeros(n, dtype=bool)
        self._mask_staging = torch.full((n, words), -1, dtype=torch.int32, pin_memory=is_pinned)
        self._masks = torch.full((n, words), -1, dtype=torch.int32, device=dev)
        # The same for a verify step's positions (made on a grammar's first), each masked
        # row's set ahead of the step: row -> [k + 1, W] (Matcher.fill_ahead).
        self._spread_masks: tuple[torch.Tensor, torch.Tensor] | None = None  # staging, device
        self._ahead: dict[int, torch.Tensor] = {}

    # ---- rows ------------------------------------------------------------------

    def set_row(
        self,
        row: int,
        params: SamplingParams,
        history: tuple[list[int], list[int]] = ((), ()),
    ) -> None:
        """A sequence joins at row: its params, written through the counted HostToDevice.
        history: its prompt's tokens and those it generated so far, read only where
        penalties need them."""
        w = self._h2d.write
        w(self._temperature[row], params.temperature)
        w(self._top_p[row], params.top_p)
        w(self._top_k[row], params.top_k)
        w(self._seeds[row], params.seed)
        self._host_is_greedy[row] = params.is_greedy
        self._host_num_logprobs[row] = params.num_logprobs
        self._host_is_processed[row] = params.is_processed_logprobs
        self._host_is_processing[row] = params.is_processing
        self._host_has_step_mask[row] = params.is_masked_per_step
        self._mask_staging[row].fill_(-1)
        if not params.is_plain:
            w(self._is_processed[row], params.is_processed_logprobs)
        if params.is_processing or self._rows is not None:
            if self._rows is None:
                self._rows = logit_rules.RowState.empty(
                    self.max_batch_size, self.vocab_size, self._h2d.device
                )
            self._rows.set_row(
                row, params, list(history[0]), list(history[1]), self.eos_ids, self._h2d.tensor
            )

    def move_row(self, row: int, src: int) -> None:
        """Row src into row (a leaving row is filled by the last live one): device-side
        copies, and the host mirrors."""
        for buf in (
            self._temperature,
            self._top_p,
            self._top_k,
            self._seeds,
            self._is_processed,
        ):
            buf[row].copy_(buf[src])
        if self._rows is not None:
            self._rows.copy_row(row, src)
        for mirror in (
            self._host_is_greedy,
            self._host_num_logprobs,
            self._host_is_processed,
            self._host_is_processing,
            self._host_has_step_mask,
            self._mask_staging,
        ):
            mirror[row] = mirror[src]

    def reset_row(self, row: int) -> None:
        """Padding values: greedy, nothing reported, no mask."""
        self._temperature[row].fill_(0.0)
        self._host_is_greedy[row] = True
        self._host_num_logprobs[row] = -1
        self._host_is_processing[row] = False
        self._host_has_step_mask[row] = False
        self._mask_staging[row].fill_(-1)

    def set_mask(self, row: int, bits: torch.Tensor) -> None:
        """The row's step mask ([W] int32 words), sent with the next step's masks; before a
        verify step of k drafts, its positions' ([k + 1, W])."""
        if bits.dim() == 2:
            self._ahead[row] = bits
        else:
            self._mask_staging[row].copy_(bits)

    # ---- steps -------------------------------------------------------------------

    def plan(self, n: int) -> SamplingPlan:
        """What a step over rows [0, n) needs, from the host mirrors."""
        ks = self._host_num_logprobs[:n]
        is_reported = bool((ks >= 0).any())
        is_plain = not is_reported and not self._host_is_processing[:n].any()
        return SamplingPlan(
            is_greedy=bool(self._host_is_greedy[:n].all()),
            is_plain=is_plain,
            num_logprobs=None if is_plain else int(ks.max()),
            row_num_logprobs=ks.tolist() if is_reported else None,
        )

    def upload_masks(self, n: int, k: int = 0) -> None:
        """Before a step on the full path: rows [0, n)'s step masks, where any row has one
        (a verify step of k drafts: each position's, set ahead, -1 in rows without)."""
        masked = np.flatnonzero(self._host_has_step_mask[:n])
        if not k:
            if len(masked):
                self._h2d.write(self._masks[:n], self._mask_staging[:n])
            return
        ahead, self._ahead = self._ahead, {}
        if not len(masked):
            return
        if any(row not in ahead or ahead[row].shape[0] != k + 1 for row in masked.tolist()):
            raise ValueError(f"a verify step of {k} drafts needs its masked rows' masks ahead")
        k1, words = k + 1, self._masks.shape[1]
        if self._spread_masks is None:
            num_rows = self._spread[0].shape[0]
            self._spread_masks = (
                torch.empty(num_rows, words, dtype=torch.int32, pin_memory=self._is_pinned),
                torch.empty(num_rows, words, dtype=torch.int32, device=self._h2d.device),
            )
        staging = self._spread_masks[0][: n * k1]
        staging.fill_(-1)
        for row in masked.tolist():
            staging[row * k1 : (row + 1) * k1] = ahead[row]
        self._h2d.write(self._spread_masks[1][: n * k1], staging)

    def choose(
        self,
        logits: torch.Tensor,
        seq_lens: torch.Tensor,
        is_greedy: bool,
        num_logprobs: int | None,
    ) -> torch.Tensor:
        """The next tokens [n] from logits [n, V] for rows [0, n) (seq_lens [n]: the
        positions seeding each row's draw). num_logprobs: as SamplingPlan's; None takes the
        plain path, which alone a captured graph holds."""
        n = logits.shape[0]
        if num_logprobs is not None:
            rows = self._rows.rows(n) if self._rows is not None else None
            allowed = (
                bits_to_mask(self._masks[:n], logits.shape[-1])
                if self._host_has_step_mask[:n].any()
                else None
            )
            return logit_rules.choose(
                logits,
                rows,
                self._temperature[:n],
                self._top_p[:n],
                self._top_k[:n],
                self._seeds[:n],
                seq_lens.long(),
                num_logprobs,
                self._is_processed[:n],
                [t[:n] for t in self._logprobs],
                is_greedy,
                allowed,
            )
        if is_greedy:
            return logits.argmax(dim=-1)
        return sample(
            logits,
            self._temperature[:n],
            self._top_p[:n],
            self._top_k[:n],
            self._seeds[:n],
            seq_lens.long(),
        )

    def add_spread_rows(self, num_rows: int) -> None:
        """Room for the log-probabilities of a verify step's num_rows positions (rows times
        their k + 1), on the device and in two host slots."""
        dev = self._h2d.device
        self._spread = tuple(
            torch.zeros(num_rows, *t.shape[1:], dtype=t.dtype, device=dev) for t in self._logprobs
        )
        self._spread_host = tuple(
            torch.zeros(2, *t.shape, dtype=t.dtype, pin_memory=self._is_pinned)
            for t in self._spread
        )

    def choose_spread(
        self,
        logits: torch.Tensor,
        positions: torch.Tensor,
        drafts: torch.Tensor,
        is_greedy: bool,
        num_logprobs: int | None = None,
    ) -> torch.Tensor:
        """The tokens of a verify step over rows [0, n) (drafts [n, k], -1 none), row i's
        logits at rows [i * (k + 1), (i + 1) * (k + 1)) of logits [n * (k + 1), V]
        (positions [n * (k + 1)] seed each draw as seq_lens do a step's). Each is the token
        a step there would choose: the same draw (it depends on a row's seed and position
        only), and a row's penalties as if its drafts before that position had been made.
        num_logprobs >= 0 (the most any row asked for): each position's log-probabilities
        too, as a step reports them (queue_spread_logprobs)."""
        n, k1 = drafts.shape[0], drafts.shape[1] + 1
        is_processing = bool(self._host_is_processing[:n].any())
        num_rows = logits.shape[0]
        allowed = (
            bits_to_mask(self._spread_masks[1][:num_rows], logits.shape[-1])
            if self._host_has_step_mask[:n].any()
            else None
        )

        def spread(t: torch.Tensor) -> torch.Tensor:
            return t[:n].repeat_interleave(k1)

        params = [spread(t) for t in (self._temperature, self._top_p, self._top_k, self._seeds)]
        if num_logprobs is None and not is_processing:
            return logits.argmax(dim=-1) if is_greedy else sample(logits, *params, positions)
        return logit_rules.choose(
            logits,
            self._rows.rows(n).spread(drafts) if is_processing else None,
            *params,
            positions,
            -1 if num_logprobs is None else num_logprobs,
            spread(self._is_processed),
            [t[:num_rows] for t in self._spread],
            is_greedy,
            allowed,
        )

    def observe_verified(self, tokens: torch.Tensor, num_made: torch.Tensor) -> None:
        """A verify step's tokens [n, k + 1], row i's first num_made[i] made: what the
        rows' penalties count, where a row of the batch has them."""
        if self._host_is_processing[: tokens.shape[0]].any():
            self._rows.observe_runs(tokens, num_made)

    def queue_spread_logprobs(self, slot: int, num_rows: int) -> None:
        """As queue_logprobs, for a verify step's num_rows positions."""
        for dev, host in zip(self._spread, self._spread_host):
            host[slot, :num_rows].copy_(dev[:num_rows], non_blocking=True)

    def read_spread_logprobs(
        self, slot: int, row_num_logprobs: list[int], repeats: int, made: list[int]
    ) -> list[list[TokenLogprobs | None]]:
        """Once a verify step's copies are done: per row, what its made[i] tokens report."""
        num_rows = len(row_num_logprobs) * repeats
        chosen, top, ids = (h[slot, :num_rows].tolist() for h in self._spread_host)
        ks = np.repeat(row_num_logprobs, repeats).tolist()
        flat = logit_rules.to_host(chosen, top, ids, ks)
        return [flat[i * repeats : i * repeats + m] for i, m in enumerate(made)]

    def queue_logprobs(self, slot: int, n: int) -> None:
        """Queue the copy of rows [0, n)'s log-probabilities to host slot `slot`, behind
        the step that makes them."""
        for dev, host in zip(self._logprobs, self._logprobs_host):
            host[slot, :n].copy_(dev[:n], non_blocking=True)

    def read_logprobs(self, slot: int, row_num_logprobs: list[int]) -> list[TokenLogprobs | None]:
        """Once the step's copies are done: what each row reports (None: nothing asked)."""
        n = len(row_num_logprobs)
        chosen, top, ids = (h[slot, :n].tolist() for h in self._logprobs_host)
        return logit_rules.to_host(chosen, top, ids, row_num_logprobs)
