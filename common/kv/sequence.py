"""A request's host-side state on a node, and the rules every loop applies to it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from common.base.request import SamplingParams, stop_reason
from common.kv.blocks import BlockAllocator, num_blocks_for


@dataclass
class Sequence:
    request_id: str
    prompt_len: int
    params: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    num_reserved: int = 0  # blocks promised by the allocator, not yet taken
    output_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)  # decode: to recompute a dropped KV
    admit_order: int = 0  # decode: the most recently admitted is preempted first
    num_preemptions: int = 0
    preempted_s: float = 0.0  # time spent preempted, all preemptions
    preempted_at: float = 0.0  # monotonic, while preempted
    is_swapped: bool = False  # preempted with its KV in host memory (else: recomputed)
    is_preemption_untold: bool = False  # resumed since its preemptions were last reported
    num_draft_tokens: int = 0  # decode: drafts verified for it (speculative decoding)
    num_accepted_tokens: int = 0  # decode: of those, accepted
    matcher: object = None  # decode, a request with a grammar: its matcher (base/grammar.py)
    is_cacheable: bool = (
        True  # decode: its KV may be kept for a follow-up (not: it did not land whole)
    )

    @property
    def num_cached(self) -> int:
        """Tokens whose KV is in the cache between decode steps: all but the last output,
        which is the next step's input."""
        return self.prompt_len + len(self.output_ids) - 1

    def num_blocks_needed(self, block_size: int) -> int:
        """Blocks for every token that will be written to the cache: the prompt and
        all outputs but the last."""
        return num_blocks_for(self.prompt_len + self.params.max_tokens - 1, block_size)

    def take_block(self, allocator: BlockAllocator) -> int:
        """One more block: a promised one if any is left, else one from the free pool."""
        if self.num_reserved > 0:
            self.num_reserved -= 1
            block = allocator.allocate_reserved()
        else:
            block = allocator.allocate(1)[0]
        self.block_ids.append(block)
        return block

    def history(self) -> tuple[list[int], list[int]]:
        """(its client's prompt, every token generated for it): what penalties count."""
        if not self.params.is_processing:
            return [], []
        prompt, prior = self.params.split(self.prompt_ids)
        return prompt, prior + self.output_ids

    def decode_parts(self) -> dict | None:
        """On a request's last update (and a resumed one's next): how often and how long it
        was preempted, and how many drafts were verified for it and accepted; None: none."""
        parts = {}
        if self.num_preemptions:
            parts["num_preemptions"] = self.num_preemptions
            parts["preempted_ms"] = round(self.preempted_s * 1e3, 3)
        if self.num_draft_tokens:
            parts["num_draft_tokens"] = self.num_draft_tokens
            parts["num_accepted_tokens"] = self.num_accepted_tokens
        return parts or None

    def release(self, allocator: BlockAllocator) -> None:
        """Give every block and reservation back; safe to call once per sequence."""
        allocator.free(self.block_ids)
        allocator.unreserve(self.num_reserved)
        self.block_ids, self.num_reserved = [], 0


def finish_reason(
    seq: Sequence, token: int, eos_ids: tuple[int, ...], max_model_len: int
) -> str | None:
    """Why seq ends after emitting token (already appended to output_ids), or None."""
    return stop_reason(
        seq.params, token, len(seq.output_ids), seq.prompt_len, eos_ids, max_model_len
    )


def blocks_to_join(seq: Sequence, block_size: int, allocator: BlockAllocator) -> None:
    """Before joining the decode batch the cache must hold room for the prompt and
    the first output token (position prompt_len)."""
    while len(seq.block_ids) < num_blocks_for(seq.prompt_len + 1, block_size):
        seq.take_block(allocator)


def grow_blocks(
    keys_needing_block: list[str], seqs: dict[str, Sequence], allocator: BlockAllocator
) -> list[tuple[str, int]]:
    """Before a decode step: each sequence whose next token starts a new block gets
    one, from its reservation or the free pool; -> (key, block) for the block table.
    The caller has made sure the pool has them (num_blocks_short)."""
    return [(key, seqs[key].take_block(allocator)) for key in keys_needing_block]


def num_blocks_short(
    keys_needing_block: Callable[[], list[str]],
    seqs: dict[str, Sequence],
    allocator: BlockAllocator,
) -> int:
    """Blocks the next decode step needs beyond what reservations and the free pool hold."""
    if allocator.num_available >= len(seqs):
        return 0  # a step takes at most one block per sequence: no need to look (every step)
    need = sum(1 for key in keys_needing_block() if seqs[key].num_reserved == 0)
    return max(need - allocator.num_available, 0)
