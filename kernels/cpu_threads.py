"""Slices of one C kernel call on the torch threads, for a library built without OpenMP
(or a kernel that splits its own work): a pool of Python threads, made on first use."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

_POOL: list[ThreadPoolExecutor] = []  # made on first use by a process given several threads


def _pool(num_threads: int) -> ThreadPoolExecutor:
    if not _POOL or _POOL[0]._max_workers != num_threads:
        _POOL[:] = [ThreadPoolExecutor(num_threads, thread_name_prefix="cpu-kernels")]
    return _POOL[0]


def run_split(run, num_items: int, max_parts: int) -> None:
    """run(i0, i1) over [0, num_items), in up to max_parts slices on the torch threads.
    NOTE: ctypes drops the GIL for the call, so the slices run in parallel."""
    num_parts = min(torch.get_num_threads(), max_parts)
    if num_parts > 1:
        bounds = [num_items * i // num_parts for i in range(num_parts + 1)]
        rest = [
            _pool(num_parts - 1).submit(run, i0, i1) for i0, i1 in zip(bounds[1:-1], bounds[2:])
        ]
        codes = [run(bounds[0], bounds[1])]  # the calling thread takes the first slice
        codes += [f.result() for f in rest]
    else:
        codes = [run(0, num_items)]
    if any(codes):
        raise MemoryError("a CPU kernel could not allocate its scratch memory")
