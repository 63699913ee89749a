"""The decode batch's blocks, admission and preemption.

A handoff's reservation (common/handoff/receiver.py) takes its blocks from
here and asks here whether a request fits; a committed reservation joins the
batch with the same blocks, so admission copies nothing.

A request's n sequences (n > 1) start together, each joining the batch as soon as it has
a row: those that do not fit now wait at the head (joining), holding their blocks, and
take the next rows that free, before anything admitted after them.
Preemptive (the default): a reservation takes what the request needs to join
the batch, and only while a watermark of the pool stays free for running
sequences to grow into. When a step needs a block the pool does not have, the
most recently admitted sequence is preempted (the node swaps its KV to host
memory or drops it to be recomputed) and waits; preempted sequences are resumed,
oldest first, before anything new is admitted or reserved.
Full reservation (is_preemptive=False): every block a request could need is
promised at reservation, so nothing is ever preempted and the batch is smaller.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass

from common.handoff.states import Reservation
from common.kv.blocks import BlockAllocator, num_blocks_for
from common.kv.prefix import PrefixCache, block_hashes
from common.kv.sequence import Sequence

WATERMARK = 0.01  # of the pool, kept free by admission for running sequences to grow into


@dataclass
class Joining:
    """A sequence started on its blocks, with what its first update needs (its first token,
    sampled where it was prefilled), until it has a batch row."""

    seq: Sequence
    token: int
    logprobs: object
    timings: dict
    compiled: object = None  # its grammar, compiled (grammar.Compiles)


class DecodeScheduler:
    def __init__(
        self,
        prefix_cache: BlockAllocator,
        block_size: int,
        max_batch_size: int,
        is_preemptive: bool = True,
    ):
        # The node's PrefixCache (a plain BlockAllocator, as tests give, caches nothing).
        self.prefix_cache = prefix_cache
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.is_preemptive = is_preemptive
        self.watermark = math.ceil(prefix_cache.capacity * WATERMARK) if is_preemptive else 0
        self.running: dict[str, Sequence] = {}
        self.preempted: list[Sequence] = []  # oldest admission first
        # Started, waiting for a row (a request's forks that did not all fit), oldest first:
        # they hold their blocks, and join before anything new is admitted.
        self.joining: deque[Joining] = deque()
        # Committed, out of the handoff, their grammar compiling (decode_node/grammar_wait.py):
        # they hold blocks of this pool, and their ids and forks' are taken.
        self.aside: dict[str, Reservation] = {}
        self.num_admitted = 0

    def held_ids(self) -> list[str]:
        """Every sequence here that the handoff no longer holds: running, preempted, joining."""
        return [
            *self.running,
            *(seq.request_id for seq in self.preempted),
            *(j.seq.request_id for j in self.joining),
        ]

    def holds_any(self) -> bool:
        return bool(self.running or self.preempted or self.joining)

    def stats(self) -> dict:
        cache = self.prefix_cache
        return {
            "num_joining": len(self.joining),
            "num_free_blocks": cache.num_free,
            "num_reserved_blocks": cache.num_reserved,
            "num_available_blocks": cache.num_available,
            "num_usable_blocks": cache.capacity,
        }

    def num_aside(self) -> int:
        """Committed requests held aside (they count in the handoff's --max-queue)."""
        return len(self.aside)

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        """Every token written to the cache: the prompt and all outputs but the last."""
        return num_blocks_for(prompt_len + max_tokens - 1, self.block_size)

    def blocks_at_reserve(self, prompt_len: int, max_tokens: int, num_seqs: int = 1) -> int:
        """Blocks a reservation takes: enough to join the batch (the prompt and the
        first output's position), or with full reservation, everything; for n sequences
        sharing the prompt, each further one adds what it does not share (fork_share)."""
        need = self.blocks_needed(prompt_len, max_tokens)
        own = (
            min(num_blocks_for(prompt_len + 1, self.block_size), need)
            if self.is_preemptive
            else need
        )
        return own + (num_seqs - 1) * (own - prompt_len // self.block_size)

    def fork_share(self, prompt_len: int, max_tokens: int) -> int:
        """What one forked sequence takes of its reservation: all but the prompt's full
        blocks, which it shares (its copy of a partial last block included)."""
        return self.blocks_at_reserve(prompt_len, max_tokens) - prompt_len // self.block_size

    def refusal_for_good(
        self, request_ids: list[str], prompt_len: int, max_tokens: int
    ) -> str | None:
        """Why this request (request_ids: its own, then its forks') can never be reserved
        here, if it cannot."""
        num_seqs = len(request_ids)
        if num_seqs > self.max_batch_size:
            return (
                f"its {num_seqs} sequences (n) need {num_seqs} batch rows, this decode node has "
                f"{self.max_batch_size} (--max-batch-size)"
            )
        aside = {i for r in self.aside.values() for i in (r.request_id, *r.fork_ids)}
        for rid in request_ids:
            if (
                rid in self.running
                or any(s.request_id == rid for s in self.preempted)
                or any(j.seq.request_id == rid for j in self.joining)
                or rid in aside
            ):
                return f"request {rid!r} is already on this decode node"
        need = self.blocks_needed(prompt_len, max_tokens)
        capacity = self.prefix_cache.capacity
        if need > capacity:
            # NOTE: this also guarantees that a preempted sequence, alone, always fits.
            return f"needs {need} KV blocks, this decode node has {capacity}"
        group = self.blocks_at_reserve(prompt_len, max_tokens, num_seqs)
        if group > capacity:
            return (
                f"its {num_seqs} sequences need {group} KV blocks, this decode node has {capacity}"
            )
        return None

    def refusal_for_now(self, prompt_len: int, max_tokens: int, num_seqs: int = 1) -> str | None:
        """Why this request cannot be reserved yet, if it cannot."""
        if self.preempted:
            return f"{len(self.preempted)} preempted requests resume first"
        now = self.blocks_at_reserve(prompt_len, max_tokens, num_seqs)
        if not self.prefix_cache.can_allocate(now + self.watermark):
            return f"needs {now} KV blocks, {self.prefix_cache.num_available} are free now"
        return None

    def take_blocks(
        self, prompt_len: int, max_tokens: int, num_seqs: int = 1, cached: list[int] = ()
    ) -> tuple[list[int], int]:
        """A reservation's blocks: the prompt's (ids; cached: its first ones, from the prefix
        cache), and how many more are promised."""
        need = self.blocks_at_reserve(prompt_len, max_tokens, num_seqs)
        num_prompt = num_blocks_for(prompt_len, self.block_size)
        block_ids = list(cached) + self.prefix_cache.allocate(num_prompt - len(cached))
        self.prefix_cache.reserve(need - num_prompt)
        return block_ids, need - num_prompt

    def give_back(self, block_ids: list[int], num_reserved: int) -> None:
        self.prefix_cache.free(block_ids)
        self.prefix_cache.unreserve(num_reserved)

    def has_row(self) -> bool:
        return len(self.running) < self.max_batch_size

    def can_admit(self) -> bool:
        """Something new may join: a batch row is free and no sequence started already waits
        for one; preempted sequences go first, unless nothing runs that could free blocks
        for them."""
        return self.has_row() and not self.joining and (not self.preempted or not self.running)

    def start(self, r: Reservation) -> tuple[list[Joining], list[tuple[int, int]]]:
        """A committed reservation becomes sequences, none running yet: its own, with the
        same blocks, then one per fork, sharing the prompt's full blocks. -> (each with its
        first token, in order, the (source, copy) blocks for the caller to copy: each fork's
        own copy of the prompt's partial last block)."""
        c = r.commit
        share = self.fork_share(r.prompt_len, r.max_tokens)
        own = Sequence(
            r.request_id,
            r.prompt_len,
            c.params,
            r.block_ids,
            r.num_reserved - len(c.forks) * share,
            prompt_ids=c.prompt_ids,
            is_cacheable=not (r.error or r.is_lossy),
        )
        out = [Joining(own, c.first_token, c.first_logprobs, c.timings)]
        # NOTE: a fork is no more cacheable than its request: KV that did not land whole (or
        # failed --kv-verify) must never reach the prefix cache through the last fork to end.
        num_full, copies = r.prompt_len // self.block_size, []
        for f in c.forks:
            seq = Sequence(
                f.request_id,
                r.prompt_len,
                dataclasses.replace(c.params, seed=f.seed),
                r.block_ids[:num_full],
                share,
                prompt_ids=c.prompt_ids,
                is_cacheable=not (r.error or r.is_lossy),
            )
            self.prefix_cache.share(seq.block_ids)
            if num_full < len(r.block_ids):
                copies.append((r.block_ids[num_full], seq.take_block(self.prefix_cache)))
            out.append(Joining(seq, f.first_token, f.first_logprobs, c.timings))
        return out, copies

    def next_joining(self) -> Joining | None:
        """The oldest started sequence waiting for a row, once one is free (taken off the line).
        NOTE: not behind preempted sequences: it holds its blocks already, and they may be
        waiting for blocks, which it gives back only once it has run."""
        if self.joining and self.has_row():
            return self.joining.popleft()
        return None

    def drop_joining(self, request_id: str) -> Sequence | None:
        """An aborted sequence that never ran: its blocks go back."""
        for j in self.joining:
            if j.seq.request_id == request_id:
                self.joining.remove(j)
                self.release(j.seq)
                return j.seq
        return None

    def release(self, seq: Sequence) -> None:
        """A started sequence that never ran (failed or aborted before its row)."""
        seq.release(self.prefix_cache)

    def admit(self, seq: Sequence) -> Sequence:
        """A started sequence, or one prefilled here (its blocks taken by take_blocks), joins
        the running."""
        return self._run(seq)

    def _run(self, seq: Sequence) -> Sequence:
        seq.admit_order = self.num_admitted
        self.num_admitted += 1
        self.running[seq.request_id] = seq
        return seq

    # ---- preemption ----------------------------------------------------------

    def victim(self) -> Sequence:
        """The running sequence to preempt: the most recently admitted."""
        return max(self.running.values(), key=lambda s: s.admit_order)

    def preempt(self, seq: Sequence, now: float) -> None:
        """seq leaves the batch and gives its blocks back (its KV saved or not by the caller)."""
        del self.running[seq.request_id]
        seq.release(self.prefix_cache)
        seq.num_preemptions += 1
        seq.preempted_at = now
        self.preempted.append(seq)
        self.preempted.sort(key=lambda s: s.admit_order)

    def blocks_to_resume(self, seq: Sequence) -> int:
        """Blocks for its cached tokens and its next position."""
        return num_blocks_for(seq.num_cached + 1, self.block_size)

    def next_resumable(self) -> Sequence | None:
        """The oldest preempted sequence, if a row and its blocks are free; while others
        run, the watermark stays free too, so it is not preempted again at once."""
        if not self.preempted or len(self.running) >= self.max_batch_size:
            return None
        seq = self.preempted[0]
        margin = self.watermark if self.running else 0
        return seq if self.prefix_cache.can_allocate(self.blocks_to_resume(seq) + margin) else None

    def resume(self, seq: Sequence, now: float) -> list[int]:
        """seq runs again; its new blocks (for the caller to fill)."""
        self.preempted.remove(seq)
        seq.block_ids = self.prefix_cache.allocate(self.blocks_to_resume(seq))
        seq.preempted_s += now - seq.preempted_at
        self.running[seq.request_id] = seq
        return seq.block_ids

    def drop_preempted(self, request_id: str) -> Sequence | None:
        """An aborted preempted sequence: it holds no blocks."""
        for seq in self.preempted:
            if seq.request_id == request_id:
                self.preempted.remove(seq)
                return seq
        return None

    def finish(self, request_id: str) -> Sequence:
        seq = self.running.pop(request_id)
        self._keep_prefix(seq)
        seq.release(self.prefix_cache)
        return seq

    def _keep_prefix(self, seq: Sequence) -> None:
        """Its full blocks (prompt and outputs) stay in the prefix cache: a chat's next turn
        starts with this one's history. Not a fork's (shared blocks), nor a KV that did not land."""
        cache, bs = self.prefix_cache, self.block_size
        if not isinstance(cache, PrefixCache) or not cache.is_enabled or not seq.is_cacheable:
            return
        tokens = seq.prompt_ids + seq.output_ids[:-1]  # written: all but the last output
        num_full = min(len(tokens) // bs, len(seq.block_ids))
        if any(cache.num_holders(b) != 1 for b in seq.block_ids[:num_full]):
            return
        for b, h in zip(seq.block_ids[:num_full], block_hashes(tokens[: num_full * bs], bs)):
            cache.publish(b, h)
