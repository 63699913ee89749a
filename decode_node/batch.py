"""The decode node's running batch, step by step: a sequence joins with its first token
(sampled where it was prefilled), each step is launched with the blocks and grammar masks
it needs and its tokens are collected, and a sequence that ends leaves the batch.

With speculative decoding on, a step may verify drafts (DraftChooser picks how many)
and make several tokens a row; the first that ends its request ends it, and the rest
are dropped. A verify step is never run ahead: the next one's rows depend on its counts.

A row leaves between steps only: where the next step was launched before this one's
tokens were seen (the pipelined turn, node.py), a sequence that ended with this step
keeps its row for that one more step, whose token for it is dropped (counted in
num_discarded_tokens).
"""

from __future__ import annotations

import time

import numpy as np

from common.base import grammar, grammar_matcher
from common.base.log import get_logger
from common.base.recent import Recent
from common.base.request import FINISH_ERROR
from common.engine.ticket import DecodeTicket
from common.kv.sequence import Sequence, blocks_to_join, finish_reason, num_blocks_short
from common.wire.protocol import TokenUpdate, ttft_parts
from decode_node.drafts import DraftChooser

log = get_logger("decode")


class GrammarEnded(ValueError):
    """A joining sequence's grammar cannot go on from its tokens: the request fails, alone.
    NOTE: any other error in a join is the node's own fault and is not caught as this."""


MIN_VERIFY_ROWS = 64  # a verify step may spread to this many rows whatever the batch's size


class Batch:
    def __init__(self, worker, scheduler, compiles: grammar.Compiles, ended: Recent):
        """worker: the DeviceWorker (its decode batch runs the steps); scheduler: the
        DecodeScheduler (the running sequences and their blocks); compiles: the node's
        grammars; ended: the requests that ended here, shared with the node."""
        self.worker = worker
        self.scheduler = scheduler
        self.compiles = compiles
        self.ended = ended
        self.finished_in_flight: set[str] = set()  # finished, but their row is in the step
        self.num_finished = 0
        self.num_discarded_tokens = 0
        self.num_batched_steps = 0  # steps that ran more than one request
        self.failed: list[tuple[str, str]] = []  # (request id, why): ended here, told by the node
        verifier = worker.decode.verifier
        self.drafts = verifier and DraftChooser(verifier.max_k)
        self._next_k: int | None = None  # drafts for the next launch, once chosen (0 only)
        self._is_verifying = False  # a verify step is launched and not yet collected
        self._num_log_tokens = 0  # since the last periodic line
        self._num_log_steps = 0

    def join(
        self, seq: Sequence, token: int, logprobs, timings: dict, compiled=None
    ) -> TokenUpdate:
        """A newly admitted sequence takes its first token (sampled by the prefill node) and
        joins the batch, unless that token ends it; its first update. compiled: its grammar,
        compiled (Compiles.take). GrammarEnded: its grammar cannot go on from its tokens (the
        sequence has ended here)."""
        rid = seq.request_id
        seq.output_ids.append(token)
        # Its matcher takes every token so far: the mask goes on from there.
        if seq.params.is_masked_per_step:
            try:
                seq.matcher = grammar_matcher.matcher_for(
                    seq.params,
                    seq.history()[1],
                    self.worker.spec.vocab_size,
                    self.compiles.grammars,
                    compiled,
                )
            except ValueError as e:
                self.finish(rid, in_batch=False, count=False)
                raise GrammarEnded(str(e)) from e
        reason = finish_reason(
            seq, token, self.worker.spec.eos_token_ids, self.worker.max_model_len
        )
        update = TokenUpdate(
            rid,
            [token],
            reason,
            ttft_parts(timings),
            index=0,
            logprobs=[logprobs] if logprobs else None,
        )
        if reason:
            self.finish(rid, in_batch=False)
            return update
        blocks_to_join(seq, self.worker.block_size, self.scheduler.prefix_cache)
        self.resumed(seq)
        self.worker.decode.add(
            rid,
            token,
            seq.prompt_len,
            seq.block_ids,
            seq.params,
            seq.history(),
            seq.prompt_ids + seq.output_ids,
        )
        return update

    def resumed(self, seq: Sequence) -> None:
        """A sequence is in the batch, joined or resumed: the draft chooser learns its class."""
        if self.drafts:
            p = seq.params
            self.drafts.join(seq.request_id, not p.is_greedy, p.no_drafts, not p.is_plain)

    def launch(self) -> DecodeTicket | None:
        """The next step on the device, each sequence's new block and grammar mask first;
        None with no sequence running."""
        k = self._num_drafts()
        self._next_k = None
        s, d = self.scheduler, self.worker.decode
        d.grow_blocks(s.running, s.prefix_cache, k)
        t0 = time.perf_counter()
        masked = [(key, seq.matcher) for key, seq in s.running.items() if seq.matcher is not None]
        # NOTE: a verify step's drafts are proposed first where a row's mask depends on its
        # tokens (each of its positions is masked as if the drafts before it were made), and
        # on the host, where reading them waits on nothing: with no draft in any row, the step
        # runs plain (the same tokens, from one position a row, not k + 1)
        is_ahead = k > 0 and (bool(masked) or self.worker.platform.is_host)
        drafts = d.propose(k) if is_ahead else {}
        if is_ahead and not drafts:
            self.drafts.observe_none_proposed(d.keys(), k)
            k = 0
            t0 = time.perf_counter()  # NOTE: timed as a plain step (the chooser's plain time)
        for key, m in masked:
            d.set_mask(key, m.fill_ahead(drafts[key]) if k else m.fill())
        masks_s = time.perf_counter() - t0
        ticket = d.launch(k)
        if ticket is not None:
            ticket.masks_s = masks_s
        self._is_verifying = k > 0 and ticket is not None
        return ticket

    def _num_drafts(self) -> int:
        """Drafts the next step verifies: 0 with speculation off, or with a row with no room
        past its next token."""
        if self._next_k is not None:
            return self._next_k
        if not self.drafts:
            return 0
        keys = self.worker.decode.keys()
        return 0 if self.drafts.is_resting(keys) else self.drafts.choose(keys, self._room())

    def _room(self) -> int:
        """The most drafts every running row can take (none where every row opted out): its
        tokens to come (max_tokens), the model's length, at most a full batch's rows or
        MIN_VERIFY_ROWS in all (a verify step's logits stay a plain step's size), and
        blocks: a row's own and its reservation, then the free pool's beyond the watermark
        (kept for plain steps to grow into)."""
        d, rows = self.worker.decode, self.scheduler.running.values()
        if all(seq.params.no_drafts for seq in rows):
            return 0  # no rows, or none that takes drafts
        room = min(self.drafts.max_k, max(d.max_batch_size, MIN_VERIFY_ROWS) // len(rows) - 1)
        limit, bs = self.worker.max_model_len, self.worker.block_size
        num_tokens, num_blocks = [], []
        for seq in rows:
            n = seq.prompt_len + len(seq.output_ids)  # with the next input
            room = min(room, seq.params.max_tokens - len(seq.output_ids) - 1, limit - n)
            num_tokens.append(n)
            num_blocks.append(len(seq.block_ids) + seq.num_reserved)
        if room <= 0:
            return 0
        tokens, have = np.array(num_tokens), np.array(num_blocks)
        pool = self.scheduler.prefix_cache.num_available - self.scheduler.watermark

        def is_held(k: int) -> bool:  # the pool holds what L + k tokens need past each row's
            return int(np.maximum(-(-(tokens + k) // bs) - have, 0).sum()) <= pool

        lo, hi = 0, room  # NOTE: need grows with k: the largest held k by halving
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if is_held(mid) else (lo, mid - 1)
        return lo

    def can_run_ahead(self) -> bool:
        """Whether the running sequences allow the next step before this one's tokens are
        seen: no verify step or check (the chooser's) running, no leftover row to remove, no
        grammar (the next mask needs this step's token), no request that surely ends with
        the running step (its extra step would write past its reserved blocks), and no
        block the next step needs that only a preemption would free."""
        s = self.scheduler
        if self._is_verifying:
            return False  # the next step's rows, blocks and lengths wait for its counts
        if self.drafts and self.drafts.is_checking:
            return False  # NOTE: chosen before the check is timed, the next is a check too
        k = self._num_drafts()
        if k:
            return False  # a verify step waits for this step's tokens
        self._next_k = 0  # NOTE: only a 0 is kept for the launch: it is safe for any rows
        if self.finished_in_flight or num_blocks_short(
            self.worker.decode.keys_needing_block, s.running, s.prefix_cache
        ):
            return False
        if any(seq.matcher is not None for seq in s.running.values()):
            return False
        limit = self.worker.max_model_len
        return not any(
            len(seq.output_ids) + 1 >= seq.params.max_tokens
            or seq.prompt_len + len(seq.output_ids) + 1 >= limit
            for seq in s.running.values()
        )

    def collect(self, ticket: DecodeTicket, is_next_launched: bool) -> list[TokenUpdate]:
        """The launched step's tokens, one update per running sequence; a sequence they end
        leaves the batch now, or after the next step where that one is launched already."""
        tokens = self.worker.decode.collect_many(ticket)
        self._is_verifying = False
        if self.drafts:
            # NOTE: a step's cost: its own time (drafts included; not a CPU step's wait for
            # the cores it shares) and the host's in making its masks and taking its tokens
            step_s = ticket.masks_s + ticket.busy_s + ticket.taken_s
            self.drafts.observe(ticket.keys, ticket.num_drafts, step_s, ticket.num_accepted or [])
        logprobs = ticket.logprobs or [None] * len(tokens)
        drafted = ticket.num_drafted or [0] * len(tokens)
        accepted = ticket.num_accepted or [0] * len(tokens)
        self._num_log_steps += 1
        if len(tokens) > 1:
            self.num_batched_steps += 1
        updates = []
        for key, row, lp, num_drafted, num_accepted in zip(
            ticket.keys, tokens, logprobs, drafted, accepted
        ):
            if key in self.finished_in_flight or key not in self.scheduler.running:
                self.num_discarded_tokens += len(row)  # ended in the previous step: past its end
                continue
            seq = self.scheduler.running[key]
            seq.num_draft_tokens += num_drafted
            seq.num_accepted_tokens += num_accepted
            made, reason = self._take(seq, row)
            self._num_log_tokens += len(made)
            if reason == FINISH_ERROR:  # NOTE: its grammar: ends here, failed, its tokens unsent
                self.failed.append((key, seq.matcher.error))
            # NOTE: its preemptions are told after each resume too: a request that moves on
            # elsewhere keeps them in its timings.
            parts = seq.decode_parts() if reason or seq.is_preemption_untold else None
            seq.is_preemption_untold = False
            update = TokenUpdate(
                key,
                made,
                reason,
                parts,
                index=len(seq.output_ids) - len(made),
                logprobs=lp[: len(made)] if lp and lp[0] else None,
            )
            if reason != FINISH_ERROR:
                updates.append(update)
            if reason:
                self.num_finished += 1
                if is_next_launched:
                    self.finished_in_flight.add(key)  # its row runs once more; removed after that
                else:
                    self.finish(key, in_batch=True, count=False)
        if not is_next_launched:
            for key in self.finished_in_flight:
                self.finish(key, in_batch=True, count=False)
            self.finished_in_flight.clear()
        return updates

    def _take(self, seq: Sequence, row: list[int]) -> tuple[list[int], str | None]:
        """A step's tokens for the sequence, in order, up to the first that ends it; -> those
        taken and its finish reason (None: it goes on)."""
        for i, token in enumerate(row):
            seq.output_ids.append(token)
            m = seq.matcher
            if m is not None and m.error is None:
                # NOTE: a token its grammar refuses was made under a mask that allowed none
                # (its grammar has no way on): it fails the request (m.error), not sent
                m.accept(token)
            if m is not None and m.error is not None:
                self.num_discarded_tokens += len(row) - i - 1
                return row[: i + 1], FINISH_ERROR
            reason = finish_reason(
                seq, token, self.worker.spec.eos_token_ids, self.worker.max_model_len
            )
            if reason:
                self.num_discarded_tokens += len(row) - i - 1
                return row[: i + 1], reason
        return row, None

    def finish(self, request_id: str, in_batch: bool, count: bool = True) -> None:
        """The sequence ends here: its row (in_batch) and its blocks go back."""
        if in_batch:
            self.worker.decode.remove(request_id)
        self.scheduler.finish(request_id)
        if self.drafts:
            self.drafts.forget(request_id)
        self.num_finished += count
        self.ended.add(request_id)

    def take_log_counts(self) -> tuple[int, int]:
        """(tokens, steps) collected since the last call: the periodic line's."""
        counts = (self._num_log_tokens, self._num_log_steps)
        self._num_log_tokens = 0
        self._num_log_steps = 0
        return counts

    def stats(self) -> dict:
        return {
            "num_running": len(self.scheduler.running),
            "num_finished": self.num_finished,
            "num_batched_steps": self.num_batched_steps,
            "num_discarded_tokens": self.num_discarded_tokens,
        } | ({"num_draft_probes": self.drafts.num_probes} if self.drafts else {})
