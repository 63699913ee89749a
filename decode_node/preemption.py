"""Preemption on the decode node, between steps only (no step in flight): when the next
step needs a block the pool lacks, the most recently admitted sequence leaves the batch,
its KV swapped to host memory (up to --swap-space) or dropped; it resumes, swapped back
in or recomputed from its tokens, before anything new is admitted (scheduler.py)."""

from __future__ import annotations

import time

from common.base.log import Throttle, get_logger
from common.kv.blocks import num_blocks_for
from common.kv.sequence import Sequence, num_blocks_short

log = get_logger("decode")
noisy = Throttle(log)


class Preemption:
    def __init__(self, worker, scheduler, swap_space: int, on_resume=None):
        """worker: the DeviceWorker; scheduler: the DecodeScheduler; swap_space: bytes of
        host memory for swapped KV; on_resume(seq): told of each sequence back in the batch."""
        self.worker, self.scheduler, self.swap_space = worker, scheduler, swap_space
        self.on_resume = on_resume
        self.num_preemptions = 0
        self.num_swapped = 0  # preemptions that kept the KV in host memory
        self.num_recomputed = 0  # resumptions that prefilled the KV again

    def make_room(self) -> None:
        """Preempt until the next step's new blocks fit in the pool."""
        s = self.scheduler
        while num_blocks_short(self.worker.decode.keys_needing_block, s.running, s.prefix_cache):
            self.preempt(s.victim())

    def preempt(self, seq: Sequence) -> None:
        w, rid = self.worker, seq.request_id
        w.decode.remove(rid)
        keep = seq.block_ids[: num_blocks_for(seq.num_cached, w.block_size)]
        seq.is_swapped = w.swap.swapped_bytes + len(keep) * w.block_bytes() <= self.swap_space
        if seq.is_swapped:
            try:
                w.swap.swap_out(rid, keep)
                self.num_swapped += 1
            except RuntimeError as e:  # host memory could not be had: recompute instead
                noisy.warning("swap-out of %s failed, it will be recomputed: %s", rid, e)
                seq.is_swapped = False
        self.scheduler.preempt(seq, time.monotonic())
        self.num_preemptions += 1
        log.debug(
            "preempted %s at %d tokens (%s): %d KV blocks free, %d running",
            rid,
            seq.num_cached,
            "swapped to host" if seq.is_swapped else "to be recomputed",
            self.scheduler.prefix_cache.num_free,
            len(self.scheduler.running),
        )

    def resume_all(self) -> None:
        """Every preempted sequence that fits now, oldest first."""
        while (seq := self.scheduler.next_resumable()) is not None:
            self.resume(seq)

    def resume(self, seq: Sequence) -> None:
        w, rid = self.worker, seq.request_id
        block_ids = self.scheduler.resume(seq, time.monotonic())
        if seq.is_swapped:
            w.swap.swap_in(rid, block_ids)
        else:
            w.recompute(seq.prompt_ids + seq.output_ids[:-1], block_ids)
            self.num_recomputed += 1
        w.decode.add(
            rid,
            seq.output_ids[-1],
            seq.num_cached,
            block_ids,
            seq.params,
            seq.history(),
            seq.prompt_ids + seq.output_ids,
        )
        seq.is_preemption_untold = True
        if self.on_resume is not None:
            self.on_resume(seq)
        log.debug(
            "resumed %s after %.0f ms (%s)",
            rid,
            seq.preempted_s * 1e3,
            "swapped in" if seq.is_swapped else "recomputed",
        )
        seq.is_swapped = False

    def stats(self) -> dict:
        return {
            "num_preemptions": self.num_preemptions,
            "num_swapped": self.num_swapped,
            "num_recomputed": self.num_recomputed,
            "num_preempted": len(self.scheduler.preempted),
        }
