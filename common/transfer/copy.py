"""Block copies between two caches, and what every backend shares."""
from __future__ import annotations

import socket
from pathlib import Path

import torch


class TransferError(RuntimeError):
    """A KV transfer that cannot happen, with the reason."""


def host_id() -> str:
    """This machine: the host name and, on Linux, the boot id (so two containers that
    share a name but not memory are told apart)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for stretches where both id lists count up by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


MAX_SLICE_COPIES = 8   # past this many stretches one gather + scatter is cheaper


@torch.inference_mode()
def copy_blocks(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]) -> None:
    """dst[:, :, dst_ids] = src[:, :, src_ids] for caches [L, 2, blocks, block_size, Hk, D],
    possibly on different devices, on the current stream. Allocators hand out
    consecutive ids, so this is usually a few strided copies with no temporary."""
    if len(src_ids) != len(dst_ids):
        raise TransferError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    if not src_ids:
        return
    stretches = runs(src_ids, dst_ids)
    if len(stretches) <= MAX_SLICE_COPIES:
        for s, d, n in stretches:
            dst[:, :, d: d + n].copy_(src[:, :, s: s + n], non_blocking=True)
        return
    # NOTE: the temporaries below belong to the current stream; callers on a side
    # stream enter it first, so they are not reused while it still reads them.
    gathered = src.index_select(2, torch.tensor(src_ids, dtype=torch.int64).to(src.device, non_blocking=True))
    dst.index_copy_(2, torch.tensor(dst_ids, dtype=torch.int64).to(dst.device, non_blocking=True),
                    gathered.to(dst.device, non_blocking=True))
