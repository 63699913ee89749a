"""A verify step: each decode row's next input and k drafts scored in one forward, the
longest run of drafts the model agrees with accepted, all on the device.

The forward spreads row i over k + 1 query rows: its next input at position L - 1 (L =
its seq_len) and draft j at L - 1 + j, each seeing the row's first L + j tokens (the
cache and the drafts before it, nothing after: kernels.verify_attention, which on CPU
reads the row's KV once for all k + 1). All k + 1 write their KV first (the blocks for
L + k tokens are the caller's to reserve). NOTE: on CUDA the spread changes how many rows
the decode attention splits its sums over: tokens equal plain decoding's up to the
order of those sums (near-ties; not yet run on a GPU).
Token j of the row is what a plain step at length L + j would choose (the same argmax,
or the same seeded draw); draft j + 1 is accepted while it equals token j. With a
accepted, tokens 0..a are the row's, token a is its next input and its length grows by
a + 1. A rejected draft's KV lies past that length: never read, overwritten when the
row gets there. Drafts of -1 (none) are never accepted, so such a row makes one token,
the one a plain step would.
"""

from __future__ import annotations

import numpy as np
import torch

import kernels
from common.engine import qwen3
from common.engine.block_table import BlockTable
from common.engine.drafting import Drafter
from common.engine.h2d import HostToDevice
from common.engine.sampling_rows import SamplingRows
from common.engine.ticket import DecodeTicket


class Verifier:
    def __init__(
        self,
        drafter: Drafter,
        max_k: int,
        model: "qwen3.Model",
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        host_seq_lens: np.ndarray,
        table: BlockTable,
        sampling: SamplingRows,
        h2d: HostToDevice,
        is_pinned: bool,
    ):
        """rows: the decode batch's input_ids, seq_lens and step_inc [max_batch_size] on
        the device, advanced here; host_seq_lens: its host copy of seq_lens (read only)."""
        self.drafter = drafter
        self.max_k = max_k
        self.model = model
        self._rows = rows
        self._host_seq_lens = host_seq_lens
        self._table = table
        self._sampling = sampling
        sampling.add_spread_rows(sampling.max_batch_size * (max_k + 1))
        self._h2d = h2d
        n, device = rows[0].shape[0], rows[0].device
        # Rows whose request opted out (SamplingParams.no_drafts): their drafts are none.
        self._no_drafts = torch.zeros(n, dtype=torch.bool, device=device)
        self._host_no_drafts = np.zeros(n, dtype=bool)
        self._steps = torch.arange(max_k + 1, dtype=torch.int32, device=device)
        self._ahead: torch.Tensor | None = None  # drafts proposed ahead of the step [n, k]
        # Per row: the step's tokens [n, max_k + 1]; accepted and proposed drafts [2, n].
        self._targets = torch.zeros(n, max_k + 1, dtype=torch.int64, device=device)
        self._counts = torch.zeros(2, n, dtype=torch.int64, device=device)
        # Two host slots, as the plain step's samples.
        self._targets_host = torch.zeros(2, n, max_k + 1, dtype=torch.int64, pin_memory=is_pinned)
        self._counts_host = torch.zeros(2, 2, n, dtype=torch.int64, pin_memory=is_pinned)
        self.num_steps = 0
        self.num_drafts = 0  # rows verified with one draft or more, over steps
        self.num_drafted = 0  # drafts proposed (not -1), summed over rows and steps
        self.num_accepted = 0
        self.num_accepted_per_pos = [0] * max_k  # [j]: rows whose draft j was accepted

    def stats(self) -> dict:
        return {
            "num_verify_steps": self.num_steps,
            "num_drafts": self.num_drafts,
            "num_drafted_tokens": self.num_drafted,
            "num_accepted_tokens": self.num_accepted,
            "num_accepted_per_pos": list(self.num_accepted_per_pos),
            # vLLM's mean acceptance length: tokens a row made per verify step with drafts
            "mean_accepted_len": round(1 + self.num_accepted / max(self.num_drafts, 1), 3),
        }

    def set_row(self, row: int, token_ids: list[int], no_drafts: bool) -> None:
        """A sequence joins at row: its tokens to the drafter; whether it opted out (written
        only where the row's flag changes)."""
        self.drafter.set_row(row, token_ids)
        if self._host_no_drafts[row] != no_drafts:
            self._h2d.write(self._no_drafts[row], no_drafts)
            self._host_no_drafts[row] = no_drafts

    def remove_row(self, row: int, last: int) -> None:
        """The sequence at row leaves; the last live row moves into it (drafter and flag)."""
        self.drafter.remove_row(row, last)
        if row != last:
            self._no_drafts[row].copy_(self._no_drafts[last])
            self._host_no_drafts[row] = self._host_no_drafts[last]

    def propose_ahead(self, k: int, n: int) -> list[list[int]]:
        """The drafts [n][k] (-1: none) the next verify step of k over rows [0, n) will
        verify, proposed now and read to the host (a row whose mask depends on its tokens
        needs them for its positions' masks: Matcher.fill_ahead); [] where no row has one,
        and nothing is kept (the step should run plain: a verify step would compute k + 1
        positions a row for the one token a plain step makes)."""
        seq_lens = self._rows[1][:n]
        drafts = self.drafter.propose(n, seq_lens, k, int(self._host_seq_lens[:n].max()))
        drafts = drafts.masked_fill(self._no_drafts[:n, None], -1)
        rows = drafts.tolist()
        if all(t < 0 for row in rows for t in row):
            self.drafter.proposed_none()
            return []
        self._ahead = drafts
        return rows

    def run(
        self,
        k: int,
        n: int,
        width: int,
        is_greedy: bool,
        num_logprobs: int | None = None,
        between_layers=None,
    ) -> None:
        """The device part of a verify step of k drafts over rows [0, n), their block tables
        [n, width] covering L + k tokens each (a plain step's arguments after k; where rows
        ask for log-probabilities, every position's are made: the sampler keeps them)."""
        input_ids, seq_lens, step_inc = (t[:n] for t in self._rows)
        block_tables = self._table.tensor[:n, :width]
        host_seq_lens = self._host_seq_lens[:n]
        k1 = k + 1
        drafts, self._ahead = self._ahead, None
        if drafts is None or drafts.shape != (n, k):
            drafts = self.drafter.propose(n, seq_lens, k, int(host_seq_lens.max()))  # [n, k]
            drafts = drafts.masked_fill(self._no_drafts[:n, None], -1)
        ids = torch.cat([input_ids[:, None], drafts.clamp(min=0)], 1).view(-1)  # [n * k1]
        lens = (seq_lens[:, None] + self._steps[:k1]).view(-1)  # [n * k1] int32
        tables = block_tables.repeat_interleave(k1, 0)  # [n * k1, W]
        slots = torch.empty(n * k1, dtype=torch.int64, device=ids.device)
        kernels.compute_slot_mapping(lens, tables, self._table.block_size, slots)
        attn = qwen3.AttentionInputs(
            is_prefill=False,
            slot_mapping=slots,
            block_tables=block_tables,
            seq_lens=seq_lens + k,
            # the host's lengths ride along for kernels that take them there (Ascend)
            host_seq_lens=torch.from_numpy(host_seq_lens + k),
            num_queries=k1,
        )
        m = self.model
        positions = lens.long() - 1
        hidden = qwen3.forward(
            m.spec, m.weights, m.kv_cache, m.cos_sin, ids, positions, attn, between_layers
        )
        logits = qwen3.compute_logits(m.weights, hidden, n)
        targets = self._sampling.choose_spread(logits, lens.long(), drafts, is_greedy, num_logprobs)
        targets = targets.view(n, k1)
        accepted = (drafts == targets[:, :k]).long().cumprod(1).sum(1)  # [n]
        self._sampling.observe_verified(targets, accepted + 1)
        self.drafter.append(n, seq_lens, targets)
        self._targets[:n, :k1].copy_(targets)
        self._counts[0, :n].copy_(accepted)
        torch.sum(drafts >= 0, 1, out=self._counts[1, :n])
        input_ids.copy_(targets.gather(1, accepted[:, None])[:, 0])
        seq_lens.add_((accepted.int() + 1) * step_inc)

    def queue_copy(self, slot: int, n: int, k: int, is_reported: bool) -> None:
        """Rows [0, n)'s tokens and counts to host slot `slot`, behind the step, and their
        log-probabilities where rows asked (is_reported)."""
        self._targets_host[slot, :n, : k + 1].copy_(self._targets[:n, : k + 1], non_blocking=True)
        self._counts_host[slot, :, :n].copy_(self._counts[:, :n], non_blocking=True)
        if is_reported:
            self._sampling.queue_spread_logprobs(slot, n * (k + 1))

    def collect(self, ticket: DecodeTicket, n: int) -> tuple[list[list[int]], np.ndarray]:
        """A verify step whose copies are done: each row's tokens (its accepted drafts and the
        token after) and how many it made [n]; each row's accepted and proposed drafts and
        its tokens' log-probabilities (where asked) into the ticket; the drafter told."""
        accepted, drafted = self._counts_host[ticket.slot, :, :n].numpy()
        k1 = ticket.num_drafts + 1
        targets = self._targets_host[ticket.slot, :n, :k1].tolist()
        self.num_steps += 1
        num_drafted_rows = int((drafted > 0).sum())  # after the opted-out rows' mask
        self.num_drafts += num_drafted_rows
        self.num_drafted += int(drafted.sum())
        self.num_accepted += int(accepted.sum())
        for j in range(int(accepted.max(initial=0))):
            self.num_accepted_per_pos[j] += int((accepted > j).sum())
        made = accepted + 1
        tokens = [row[:m] for row, m in zip(targets, made.tolist())]
        ticket.num_accepted, ticket.num_drafted = accepted.tolist(), drafted.tolist()
        if ticket.num_logprobs is not None:
            ticket.logprobs = self._sampling.read_spread_logprobs(
                ticket.slot, ticket.num_logprobs, k1, made.tolist()
            )
        self.drafter.took(tokens, num_drafted_rows)
        return tokens, made
