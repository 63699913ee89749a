"""CPU prefill lanes: a pass's prompt chunks split over threads, each running whole
forwards on one torch thread. No barrier per op waits for a core another process
holds, and a busy host just time-slices the lanes, which run at a lower priority:
prefill throughput takes the cores the latency-bound work (decode steps, the
frontend) leaves, not a share fixed in advance."""
from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from common.base.threads import lower_this_thread

LANE_NICE = 10
# A lone chunk shorter than this per thread runs on one lane: an op split over threads
# waits at its end for every one of them, and on a shared host one may have no core.
MIN_TOKENS_PER_THREAD = 1024
FEED_S = 0.005   # on_layers is called at least this often during a pass


def _start_lane() -> None:
    torch.set_num_threads(1)
    lower_this_thread(LANE_NICE)


class Lanes:
    """forward(chunks) -> the hidden state of each chunk's last token [len(chunks), H].

    on_layers(chunk_indices, num_done), where given, is called on the caller's thread (the
    node's loop, which owns the sockets) while the lanes run: those chunks' first num_done
    layers are computed; and every FEED_S with no chunk indices, so KV held back for a link
    that was full goes out as it drains. The caller waits in that loop: nothing else runs there."""

    def __init__(self, num_lanes: int, forward: Callable[..., torch.Tensor]):
        self.num_lanes = num_lanes
        self._forward = forward   # forward(chunks, between_layers=None)
        self._pool = ThreadPoolExecutor(num_lanes, thread_name_prefix="prefill-lane", initializer=_start_lane)

    def close(self) -> None:
        self._pool.shutdown()

    @torch.inference_mode()   # NOTE: thread-local: a lane thread must enter it itself
    def _on_lane(self, chunks: list, num_threads: int = 1, between_layers=None) -> torch.Tensor:
        torch.set_num_threads(num_threads)   # NOTE: per thread: this lane's ops, and the pool it starts
        try:
            return self._forward(chunks, between_layers)
        finally:
            torch.set_num_threads(1)

    def _run(self, parts: list[list[int]], chunks: list, num_threads: int, between_layers, on_layers) -> list:
        """Each part of the chunks on a lane; their last hidden states, part by part."""
        inbox: queue.SimpleQueue = queue.SimpleQueue()

        def hook(idx: list[int]):
            def after(num_done: int) -> None:
                if between_layers is not None:
                    between_layers(num_done)
                if on_layers is not None:
                    inbox.put((idx, num_done))
            return after
        is_hooked = between_layers is not None or on_layers is not None
        futures = [self._pool.submit(self._on_lane, [chunks[i] for i in idx], num_threads,
                                     hook(idx) if is_hooked else None) for idx in parts]
        for f in futures:
            f.add_done_callback(lambda _: inbox.put(None))
        num_running, error = len(futures), None
        while num_running:   # NOTE: to the end even if on_layers fails: the lanes write the cache
            try:
                item = inbox.get(timeout=FEED_S) if on_layers is not None else inbox.get()
            except queue.Empty:
                item = ([], 0)   # no layer done: what waits to be sent may move (a link that takes more)
            if item is None:
                num_running -= 1
            elif error is None:
                try:
                    on_layers(*item)
                except Exception as e:
                    error = e
        if error is not None:
            raise error
        return [f.result() for f in futures]

    def forward_whole(self, chunks: list, num_threads: int, between_layers=None, on_layers=None) -> torch.Tensor:
        """The chunks as one pass on num_threads threads, started from a lane: they keep its
        lower priority, so the latency-bound work on this host still comes first.
        between_layers(n), called on the lane, may resize the pool (torch.set_num_threads)."""
        return self._run([list(range(len(chunks)))], chunks, num_threads, between_layers, on_layers)[0]

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

    def forward_shared(self, chunks: list, cores, want: int, is_chunk_heavy: bool, on_layers=None) -> torch.Tensor:
        """The pass on a host's shared cores (cores.CorePool), worth `want` of them. One prompt,
        or prompts each worth several cores (is_chunk_heavy: big matmuls), run every granted
        thread, resized between layers. Small ones go to the lanes, one thread each with no
        barrier between them, so lanes past the grant cost the others nothing: they only take
        the cycles left idle, as with a fixed split.
        NOTE: on lanes either way: their lower priority lets the frontend and decode steps
        sharing these cores run first (at the same priority those lost 25-40% of TPOT)."""
        is_split = len(self.split(chunks)) > 1
        if want > 1 and (is_chunk_heavy or not is_split):
            return self.forward_whole(chunks, cores.begin(want), cores.between_layers, on_layers)
        cores.begin(min(want, len(chunks)))
        torch.set_num_threads(1)
        return self.forward(chunks, self.num_lanes if is_split else 1, on_layers)

    def forward(self, chunks: list, num_lanes: int | None = None, on_layers=None) -> torch.Tensor:
        num_lanes = num_lanes or self.num_lanes
        lanes = self.split(chunks, num_lanes)
        num_tokens = sum(len(c.token_ids) for c in chunks)
        if len(lanes) == 1 and num_lanes > 1 and num_tokens >= MIN_TOKENS_PER_THREAD * num_lanes:
            return self.forward_whole(chunks, num_lanes, None, on_layers)   # every thread on one long chunk
        parts = self._run(lanes, chunks, 1, None, on_layers)
        if len(lanes) == 1:
            return parts[0]
        # NOTE: lanes write disjoint blocks of the one cache; the caller's sampling waits for all.
        order = torch.tensor([i for lane in lanes for i in lane])
        packed = torch.cat(parts)            # lane order -> chunk order
        last_hidden = torch.empty_like(packed)
        last_hidden[order] = packed
        return last_hidden
