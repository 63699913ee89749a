"""Decode steps captured as device graphs, one per (batch bucket, greedy or not),
replayed over the decode state's persistent buffers."""

from __future__ import annotations

from typing import Callable

import torch

import kernels
from common.base.env import read_env

# Batch sizes with a captured graph; a batch runs in the smallest bucket that holds it.
GRAPH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def wants_graphs(platform, use_graphs: bool, kv_cache: torch.Tensor) -> bool:
    """Whether decode steps are captured: the platform can, nothing turned them off, the
    attention kernel pays for it, and the cache is read where it lies."""
    from kernels import kv_quant, portable

    ops = kernels.backend_for(kv_cache)
    return (
        platform.can_capture_graphs
        and use_graphs
        and not read_env().disable_graphs
        # Portable attention reads the full table width: graphs would not pay.
        and ops.decode_attention is not portable.decode_attention
        # NOTE: an 8-bit cache a backend does not read in place is read through the blocks
        # a step names (torch.unique: a read back, which a capture cannot hold)
        and (not kv_quant.is_quantized(kv_cache) or getattr(ops, "reads_8bit_kv", False))
    )


class GraphRunner:
    def __init__(self, platform):
        self._platform = platform
        self._graphs: dict[tuple[int, bool], object] = {}
        self._buckets: list[int] = []

    @property
    def is_graphed(self) -> bool:
        return bool(self._graphs)

    def capture(self, run: Callable[[int, bool], None], max_batch_size: int) -> None:
        """run(n, is_greedy) queues one step over rows [0, n); rows past the live
        ones are padding rows writing to the null block."""
        p = self._platform
        self._buckets = sorted({b for b in GRAPH_BUCKETS if b < max_batch_size} | {max_batch_size})
        side = p.side_stream()
        p.wait_for_current(side)
        with p.on_stream(side), torch.inference_mode():  # compile kernels, size workspaces
            for b in self._buckets:
                for is_greedy in (True, False):
                    run(b, is_greedy)
        p.synchronize()
        pool = None
        with torch.inference_mode():
            for b in reversed(self._buckets):  # largest first: the smaller ones fit its pool
                for is_greedy in (True, False):
                    graph = p.new_graph()
                    with p.capture(graph, pool):
                        run(b, is_greedy)
                    pool = graph.pool()
                    self._graphs[(b, is_greedy)] = graph
        p.synchronize()

    def replay(self, n: int, is_greedy: bool) -> None:
        bucket = next(b for b in self._buckets if b >= n)
        self._graphs[(bucket, is_greedy)].replay()

    def clear(self) -> None:
        self._graphs.clear()
