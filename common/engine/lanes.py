"""CPU prefill lanes: a pass's prompt chunks split over threads, each running whole
forwards on one torch thread. No barrier per op waits for a core another process
holds, and a busy host just time-slices the lanes, which run at a lower priority:
prefill throughput takes the cores the latency-bound work (decode steps, the
frontend) leaves, not a share fixed in advance."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from common.base.threads import lower_this_thread

LANE_NICE = 10
# A lone chunk shorter than this per thread runs on one lane: an op split over threads
# waits at its end for every one of them, and on a shared host one may have no core.
MIN_TOKENS_PER_THREAD = 1024


def _start_lane() -> None:
    torch.set_num_threads(1)
    lower_this_thread(LANE_NICE)


class Lanes:
    """forward(chunks) -> the hidden state of each chunk's last token [len(chunks), H]."""

    def __init__(self, num_lanes: int, forward: Callable[[list], torch.Tensor]):
        self.num_lanes = num_lanes
        self._forward = forward
        self._pool = ThreadPoolExecutor(num_lanes, thread_name_prefix="prefill-lane", initializer=_start_lane)

    def close(self) -> None:
        self._pool.shutdown()

    @torch.inference_mode()   # NOTE: thread-local: a lane thread must enter it itself
    def _on_lane(self, chunks: list) -> torch.Tensor:
        return self._forward(chunks)

    def split(self, chunks: list, num_lanes: int | None = None) -> list[list[int]]:
        """Chunk indices per lane (at most num_lanes, default all), balanced by tokens
        (largest first). NOTE: chunks that asked for prompt logprobs need all of their
        hidden states, which only a pass in one piece keeps."""
        num_lanes = min(num_lanes or self.num_lanes, len(chunks))
        if num_lanes < 2 or any(c.prompt_targets is not None for c in chunks):
            return [list(range(len(chunks)))]
        lanes: list[list[int]] = [[] for _ in range(num_lanes)]
        loads = [0] * num_lanes
        for i in sorted(range(len(chunks)), key=lambda i: -len(chunks[i].token_ids)):
            j = loads.index(min(loads))
            lanes[j].append(i)
            loads[j] += len(chunks[i].token_ids) + chunks[i].context_len // 4
        return [sorted(lane) for lane in lanes if lane]

    def forward(self, chunks: list, num_lanes: int | None = None) -> torch.Tensor:
        num_lanes = num_lanes or self.num_lanes
        lanes = self.split(chunks, num_lanes)
        if len(lanes) == 1 and num_lanes > 1 and sum(len(c.token_ids) for c in chunks) >= MIN_TOKENS_PER_THREAD * num_lanes:
            torch.set_num_threads(num_lanes)   # every thread on one long chunk
            try:
                return self._forward(chunks)
            finally:
                torch.set_num_threads(1)
        if len(lanes) == 1:
            return self._pool.submit(self._on_lane, chunks).result()
        # NOTE: lanes write disjoint blocks of the one cache; the caller's sampling waits for all.
        parts = list(self._pool.map(self._on_lane, [[chunks[i] for i in lane] for lane in lanes]))
        order = torch.tensor([i for lane in lanes for i in lane])
        packed = torch.cat(parts)            # lane order -> chunk order
        last_hidden = torch.empty_like(packed)
        last_hidden[order] = packed
        return last_hidden
