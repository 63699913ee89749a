"""The decode batch's step state, on the device.

Buffers are sized for max_batch_size rows. Rows [0, num_seqs) are live and
dense: a leaving row is filled by the last live one (a device-side copy). A step
computes slot_mapping from seq_lens and the block table, runs the model, samples,
writes the samples into the next step's input_ids and advances seq_lens, all on
the device. The host writes into these buffers only when a sequence joins or
crosses into a new block, through the counted HostToDevice.

Each row's sampling state is a part of its own (sampling_rows.py, `self.sampling`):
a request that asks for log-probabilities, penalties or masks (not is_plain) puts
the batch on the full path there, and the reported log-probabilities come back
with the tokens. A batch of plain rows never touches it (and on CUDA replays a
captured graph).
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch

import kernels
from common.base.request import SamplingParams
from common.base.speculative import SpeculativeConfig
from common.engine import qwen3
from common.engine.block_table import BlockTable
from common.engine.drafting import make_drafter
from common.engine.graphs import GraphRunner
from common.engine.h2d import HostToDevice
from common.engine.sampling_rows import SamplingRows
from common.engine.step_runner import StepRunner
from common.engine.ticket import DecodeTicket
from common.engine.verify import Verifier
from common.kv.blocks import num_blocks_for
from common.kv.sequence import grow_blocks


class DecodeBatch:
    def __init__(
        self,
        model: "qwen3.Model",
        block_size: int,
        max_batch_size: int,
        max_blocks_per_seq: int,
        platform,
        h2d: HostToDevice,
        eos_ids: tuple[int, ...] = (),
        speculative: SpeculativeConfig = SpeculativeConfig("off"),
    ):
        self.model = model
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.platform = platform
        self._h2d = h2d
        self.graphs = GraphRunner(platform)
        self.num_steps = 0
        self.num_rows = 0  # summed over steps: / num_steps is the mean batch
        self.max_batch = 0
        # where a step runs on the host, and the device's time (busy, idle) it keeps
        self.runner = StepRunner(platform)
        n, dev, pinned = max_batch_size, h2d.device, platform.is_pinned
        self._input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self._seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self._step_inc = torch.zeros(n, dtype=torch.int32, device=dev)
        # NOTE: a verify step's drafts may cross blocks: a row may take several a launch
        per_row = num_blocks_for(speculative.num_speculative_tokens + 1, block_size) + 1
        self.table = BlockTable(n, max_blocks_per_seq, block_size, h2d, pinned, per_row)
        self._slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self._positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.sampling = SamplingRows(n, model.spec.vocab_size, h2d, pinned, eos_ids)
        self._sampled = torch.zeros(n, dtype=torch.int64, device=dev)
        # Two host slots: a step may be collected while the next one is in flight.
        self._sampled_host = torch.zeros(2, n, dtype=torch.int64, pin_memory=pinned)
        # Host mirrors, advanced without reading the device back.
        self.host_seq_lens = np.ones(n, dtype=np.int32)
        self._host_seq_lens_t = torch.from_numpy(self.host_seq_lens)  # the same memory
        self._slots: dict[str, int] = {}
        self._keys: list[str] = []
        # Verify steps (verify.py) over these same buffers, where a drafter is given.
        max_len = max_blocks_per_seq * block_size
        drafter = make_drafter(speculative, n, max_len, h2d, pinned)
        self.verifier = drafter and Verifier(
            drafter,
            speculative.num_speculative_tokens,
            model,
            (self._input_ids, self._seq_lens, self._step_inc),
            self.host_seq_lens,
            self.table,
            self.sampling,
            h2d,
            pinned,
        )

    def capture_graphs(self) -> None:
        width = self.table.max_blocks
        self.graphs.capture(lambda n, greedy: self._run(n, width, greedy), self.max_batch_size)
        self._input_ids.zero_()  # the warm-up steps sampled into the padding rows

    def stats(self) -> dict:
        return {
            "num_block_writes": self.table.num_block_writes,
            "num_block_copies": self.table.num_block_copies,
            "num_decode_steps": self.num_steps,
            "num_decode_rows": self.num_rows,
            "device_busy_s": round(self.runner.device_busy_s, 6),
            "device_idle_s": round(self.runner.device_idle_s, 6),
            "is_graphed": self.graphs.is_graphed,
            "max_decode_batch": self.max_batch,
        } | (self.verifier.stats() if self.verifier else {})

    # ---- rows ------------------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        return len(self._keys)

    def keys(self) -> list[str]:
        """Live sequences in row order: a step's output order."""
        return list(self._keys)

    @torch.inference_mode()
    def add(
        self,
        key: str,
        token_id: int,
        num_cached: int,
        block_ids: list[int],
        params: SamplingParams,
        history: tuple[list[int], list[int]] = ((), ()),
        token_ids: list[int] | None = None,
    ) -> None:
        """A sequence joins: num_cached tokens are in the cache at block_ids, and
        token_id (at position num_cached) is its next input. history: its prompt's
        tokens and those it generated so far (token_id the last), read only where
        penalties need them. token_ids: all num_cached + 1 of its tokens, token_id the
        last; the drafter's, where there is one."""
        if key in self._slots:
            raise ValueError(f"sequence {key!r} is already decoding")
        row = self.num_seqs
        if row >= self.max_batch_size:
            raise RuntimeError(f"decode batch is full ({self.max_batch_size} rows)")
        if len(block_ids) < num_blocks_for(num_cached + 1, self.block_size):
            raise ValueError(f"{num_cached + 1} tokens need more than {len(block_ids)} blocks")
        if len(block_ids) > self.table.max_blocks:
            raise ValueError(
                f"{len(block_ids)} blocks exceed the model's maximum length "
                f"({self.table.max_blocks} blocks)"
            )
        if self.verifier and (token_ids is None or len(token_ids) != num_cached + 1):
            raise ValueError(f"a drafter needs the sequence's {num_cached + 1} tokens")
        w = self._h2d.write
        w(self._input_ids[row], token_id)
        w(self._seq_lens[row], num_cached + 1)
        w(self._step_inc[row], 1)
        self.table.set_row(row, block_ids)
        self.sampling.set_row(row, params, history)
        if self.verifier:
            self.verifier.set_row(row, token_ids, params.no_drafts)
        self.host_seq_lens[row] = num_cached + 1
        self._slots[key] = row
        self._keys.append(key)

    @torch.inference_mode()
    def remove(self, key: str) -> None:
        self.table.flush(None)  # pending entries name rows that are about to move
        row = self._slots.pop(key)
        last = self.num_seqs - 1
        if self.verifier:
            self.verifier.remove_row(row, last)
        if row != last:
            moved = self._keys[last]
            for buf in (self._input_ids, self._seq_lens, self._step_inc):
                buf[row].copy_(buf[last])
            self.table.move_row(row, last)
            self.sampling.move_row(row, last)
            self.host_seq_lens[row] = self.host_seq_lens[last]
            self._keys[row] = moved
            self._slots[moved] = row
        self._keys.pop()
        self._reset_row(last)

    def _reset_row(self, row: int) -> None:
        """Padding values: input 0, one token at the null block, never advancing."""
        self._input_ids[row].fill_(0)
        self._seq_lens[row].fill_(1)
        self._step_inc[row].fill_(0)
        self.table.reset_row(row)
        self.sampling.reset_row(row)
        self.host_seq_lens[row] = 1

    def set_mask(self, key: str, bits: torch.Tensor) -> None:
        """The step mask (grammar, bad words) for the sequence's next token ([W] int32
        words), before the step that makes it."""
        self.sampling.set_mask(self._slots[key], bits)

    @torch.inference_mode()
    def propose(self, k: int) -> dict[str, list[int]]:
        """Each sequence's k drafts (-1: none) for a verify step of k, ahead of its launch
        (a row's mask may depend on them: set_mask, [k + 1, W]); {} where no row has one."""
        return dict(zip(self._keys, self.verifier.propose_ahead(k, self.num_seqs)))

    def keys_needing_block(self, lookahead: int = 0) -> list[str]:
        """Live sequences whose next token, or the lookahead tokens after it (a verify
        step's drafts), falls past their last block (from the host mirrors)."""
        lens = self.host_seq_lens + lookahead if lookahead else self.host_seq_lens
        rows = self.table.rows_needing_block(lens, self.num_seqs)
        return [self._keys[r] for r in rows]

    def next_position(self, key: str) -> int:
        """The position the sequence's next step writes."""
        return int(self.host_seq_lens[self._slots[key]]) - 1

    def num_blocks(self, key: str) -> int:
        return int(self.table.host_num_blocks[self._slots[key]])

    def append_block(self, key: str, block_id: int) -> None:
        """The sequence crosses into a new block: one block-table entry, written
        with the next launch."""
        self.table.append(self._slots[key], block_id)

    def grow_blocks(self, seqs: dict, allocator, lookahead: int = 0) -> None:
        """Before a step: every sequence whose next token (and lookahead more) starts a new
        block gets one (kv.sequence.grow_blocks picks it) in its block table."""
        while keys := self.keys_needing_block(lookahead):
            for key, block in grow_blocks(keys, seqs, allocator):
                self.append_block(key, block)

    # ---- steps -------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, num_drafts: int = 0) -> DecodeTicket | None:
        """Queue one step on the device and the copy of its samples to the host;
        return without waiting. The next step may be launched before this one is
        collected: its inputs are already on the device. The batch must not change
        while a step is in flight. num_drafts: k > 0 makes it a verify step (verify.py;
        a row whose mask depends on its tokens has its positions' masks set after
        propose), collected (collect_many) before the next launch."""
        n, k = self.num_seqs, num_drafts
        if n == 0:
            return None
        if k and not (self.verifier and 0 < k <= self.verifier.max_k):
            raise ValueError(f"no verify step of {k} drafts here")
        short = self.keys_needing_block(k)
        if short:
            raise RuntimeError(
                f"sequences {short} need a block for their next position; call append_block first"
            )
        # Queued behind the running step, from the pinned slot a step two launches back used.
        self.table.flush(self.num_steps % 2)
        plan = self.sampling.plan(n)
        run = partial(self.verifier.run, k) if k else self._run
        p = self.platform
        t0 = time.perf_counter()
        ticket = DecodeTicket(self._keys[:n], self.num_steps % 2, start=p.event(timing=True))
        ticket.num_drafts = k
        if plan.is_plain and self.graphs.is_graphed and not k:
            self.graphs.replay(n, plan.is_greedy)
        else:
            self.sampling.upload_masks(n, k)
            width = num_blocks_for(int(self.host_seq_lens[:n].max()) + k, self.block_size)
            args = (n, width, plan.is_greedy, plan.num_logprobs)
            t0 = self.runner.run(run, args, num_seqs=n, num_rows=n * (k + 1), t0=t0)
        ticket.end = p.event(timing=True)
        if ticket.end is None:  # no events (CPU): the step ran here, in this call
            self.runner.count_host_time(ticket, t0)
        if k:
            self.verifier.queue_copy(ticket.slot, n, k, plan.row_num_logprobs is not None)
        else:
            self._sampled_host[ticket.slot, :n].copy_(self._sampled[:n], non_blocking=True)
            self.host_seq_lens[:n] += 1  # a verify step's growth is known when collected
        if plan.row_num_logprobs is not None:
            ticket.num_logprobs = plan.row_num_logprobs
            if not k:  # a verify step's: queue_copy
                self.sampling.queue_logprobs(ticket.slot, n)
        ticket.copied = p.event()
        self.num_steps += 1
        self.num_rows += n
        self.max_batch = max(self.max_batch, n)
        return ticket

    def is_done(self, ticket: DecodeTicket) -> bool:
        """Whether collect() would return at once (always, where work is not queued)."""
        return ticket.copied is None or ticket.copied.query()

    def collect(self, ticket: DecodeTicket) -> list[int]:
        """Wait for a launched plain step; its tokens, in the ticket's key order."""
        if ticket.num_drafts:
            raise ValueError("a verify step makes several tokens a row: collect_many")
        self.runner.wait(ticket)
        t0, n = time.perf_counter(), len(ticket.keys)
        if ticket.num_logprobs is not None:
            ticket.logprobs = self.sampling.read_logprobs(ticket.slot, ticket.num_logprobs)
        tokens = self._sampled_host[ticket.slot, :n].tolist()
        if self.verifier:
            self.verifier.drafter.took_one(tokens)
        ticket.taken_s = time.perf_counter() - t0
        return tokens

    def collect_many(self, ticket: DecodeTicket) -> list[list[int]]:
        """Wait for a launched step; each row's tokens in the ticket's key order: one for a
        plain step, a verify step's accepted drafts and the token after them. Where rows
        asked, ticket.logprobs holds each row's tokens' (a list a row)."""
        if not ticket.num_drafts:
            tokens = self.collect(ticket)
            if ticket.logprobs is not None:
                ticket.logprobs = [[lp] for lp in ticket.logprobs]
            return [[t] for t in tokens]
        self.runner.wait(ticket)
        t0, n = time.perf_counter(), len(ticket.keys)
        tokens, made = self.verifier.collect(ticket, n)
        self.host_seq_lens[:n] += made.astype(np.int32)
        ticket.taken_s = time.perf_counter() - t0
        return tokens

    def step(self) -> list[int]:
        """One token for every live sequence, in keys() order: a launch, collected at once."""
        ticket = self.launch()
        return self.collect(ticket) if ticket else []

    def _run(
        self,
        n: int,
        width: int,
        is_greedy: bool,
        num_logprobs: int | None = None,
        between_layers=None,
    ) -> None:
        """The device part of a step over rows [0, n) with block tables [n, width].
        num_logprobs: None for a plain batch, else the most alternatives any row asked
        for (-1: none; the full path all the same)."""
        seq_lens = self._seq_lens[:n]
        slot_mapping = self._slot_mapping[:n]
        block_tables = self.table.tensor[:n, :width]
        kernels.compute_slot_mapping(seq_lens, block_tables, self.block_size, slot_mapping)
        # The host mirror rides along for kernels that take lengths on the host (Ascend);
        # a captured graph never reads it.
        host_lens = None if self.graphs.is_graphed else self._host_seq_lens_t[:n]
        attn = qwen3.AttentionInputs(
            is_prefill=False,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            host_seq_lens=host_lens,
        )
        m = self.model
        hidden = qwen3.forward(
            m.spec,
            m.weights,
            m.kv_cache,
            m.cos_sin,
            self._input_ids[:n],
            torch.sub(seq_lens, 1, out=self._positions[:n]),
            attn,
            between_layers,
        )
        logits = qwen3.compute_logits(m.weights, hidden)
        sampled = self.sampling.choose(logits, seq_lens, is_greedy, num_logprobs)
        self._sampled[:n].copy_(sampled)
        # the drafter's rows hold every token, a plain step's too (written as it advances)
        history = self.verifier.drafter.history if self.verifier else None
        kernels.advance_step(self._input_ids[:n], sampled, seq_lens, self._step_inc[:n], history)
