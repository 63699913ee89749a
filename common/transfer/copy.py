"""Block copies between two caches, and what every backend shares."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from kernels import kv_quant


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


MAX_SLICE_COPIES = 8  # past this many stretches one gather + scatter is cheaper


@torch.inference_mode()
def copy_blocks(
    src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]
) -> None:
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
            dst[:, :, d : d + n].copy_(src[:, :, s : s + n], non_blocking=True)
        return
    # NOTE: the temporaries below belong to the current stream; callers on a side
    # stream enter it first, so they are not reused while it still reads them.
    gathered = src.index_select(
        2, torch.tensor(src_ids, dtype=torch.int64).to(src.device, non_blocking=True)
    )
    dst.index_copy_(
        2,
        torch.tensor(dst_ids, dtype=torch.int64).to(dst.device, non_blocking=True),
        gathered.to(dst.device, non_blocking=True),
    )


@torch.inference_mode()
def block_checksums(cache: torch.Tensor, block_ids: list[int], wire: str = "same") -> torch.Tensor:
    """[n] int32 on the cache's device, queued on the current stream: for each block, the
    sum of its KV (every layer, K and V) read as 32-bit words, wrapping around. What
    --kv-verify compares on both sides of a handoff: a block that holds another block's
    KV, or nothing, differs. Integer sums do not depend on the order they are taken in,
    so processes with different thread counts agree. No copy of the blocks: per stretch
    of consecutive ids, one pass over memory in its own order (~10 GB/s on one core).
    wire "int8": of the blocks as the decode node lands them from int8 rows (quantized and
    dequantized here as the KV link does, a layer and WIRE_PIECE_BYTES of blocks at a time:
    the copies stay small whatever the prompt's length)."""
    if wire == "int8":
        return _landed_int8_checksums(cache, block_ids)
    word = torch.int32 if cache.shape[-1] * cache.element_size() % 4 == 0 else torch.uint8
    planes = cache.shape[0] * cache.shape[1]
    sums = []
    for start, _, n in runs(block_ids, block_ids):
        words = (
            cache[:, :, start : start + n].view(word).reshape(planes, n, -1)
        )  # a view: blocks contiguous
        sums.append(words.sum(dim=2, dtype=torch.int32).sum(dim=0, dtype=torch.int32))
    if not sums:
        return torch.zeros(0, dtype=torch.int32, device=cache.device)
    return torch.cat(sums)


WIRE_PIECE_BYTES = 8 * 2**20  # of the cache's, quantized and dequantized at once for a sum


def _landed_int8_checksums(cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """block_checksums of the blocks as int8 rows land them, a piece of blocks (every
    layer) at a time, or a layer of a block where one is more than a piece. NOTE: a sum
    wraps, so adding a layer's sums at a time gives what summing the whole would."""
    ids = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
    per_block = cache[:, :, :1].numel() * cache.element_size()  # every layer's
    num_layers = cache.shape[0] if per_block <= WIRE_PIECE_BYTES else 1
    step = max(1, WIRE_PIECE_BYTES // (per_block // cache.shape[0] * num_layers))
    sums = torch.zeros(len(block_ids), dtype=torch.int32, device=cache.device)
    for first in range(0, cache.shape[0], num_layers):
        for b in range(0, len(block_ids), step):
            piece = cache[first : first + num_layers].index_select(2, ids[b : b + step])
            landed = kv_quant.dequantize(kv_quant.quantize(piece, torch.int8), cache.dtype)
            sums[b : b + step] += block_checksums(landed, list(range(landed.shape[2])))
    return sums
