"""ipc: one host. The decode node's whole cache is mapped into the prefill process
once, at connection time, and the prefill node copies its blocks straight into
the reserved ones: device to device on CUDA (a peer copy across devices), a
memory copy through a shared-memory segment on CPU."""
from __future__ import annotations

import os

import torch

from common.engine.platform import PlatformError, platform_for
from common.kv.blocks import is_cache_shape, num_cache_blocks
from common.transfer.copy import TransferError, copy_blocks
from common.wire.protocol import CudaIpcHandle, KVWelcome


def is_supported(device: torch.device) -> bool:
    return device.type == "cpu" and os.path.isdir("/dev/shm") or device.type == "cuda"


def can_write(ours: torch.device, theirs: torch.device) -> bool:
    return ours.type == theirs.type and is_supported(ours)


def share(cache: torch.Tensor) -> CudaIpcHandle:
    """The IPC handle of a CUDA cache's allocation, as it travels in KVWelcome."""
    try:
        return CudaIpcHandle(*platform_for(cache.device).share(cache))
    except PlatformError as e:
        raise TransferError(str(e)) from None


def _open(welcome: KVWelcome, dtype: torch.dtype, shape: list[int], device: torch.device):
    """The decode node's cache mapped here, and how to unmap it."""
    if device.type == "cuda":
        if welcome.cuda_ipc is None:
            raise TransferError("the decode node sent no CUDA IPC handle")
        h = welcome.cuda_ipc
        handle = (h.device, h.handle, h.storage_size, h.storage_offset, h.ref_counter_handle,
                  h.ref_counter_offset, h.event_handle, h.is_event_sync_required)
    else:
        handle = welcome.shm_name or ""
    try:
        return platform_for(device).open_shared(handle, dtype, shape)
    except PlatformError as e:
        raise TransferError(f"cannot open the decode node's KV cache: {e}") from None


class IpcWriter:
    name = "ipc"

    def __init__(self, welcome: KVWelcome, cache: torch.Tensor):
        self.src = cache
        shape = list(welcome.cache_shape)
        if not is_cache_shape(shape):
            raise TransferError(f"the decode node's cache shape {shape} is not a KV cache's")
        self._platform = platform_for(cache.device)
        self.dst, self._unmap = _open(welcome, cache.dtype, shape, cache.device)
        self.stream = self._platform.side_stream()
        self._num_dst_blocks = num_cache_blocks(shape)
        self._inflight: list[tuple[str, object | None]] = []   # (request id, its copy's event)

    def write(self, request_id: str, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        if any(not 0 < b < self._num_dst_blocks for b in dst_block_ids):
            raise TransferError(f"destination blocks outside the decode cache of {self._num_dst_blocks}")
        if self.stream is None:
            copy_blocks(self.src, src_block_ids, self.dst, dst_block_ids)
            self._inflight.append((request_id, None))
            return
        # The copy waits for the forward pass that wrote the blocks, then runs beside
        # the next one; the event tells the loop when the commit may go out.
        self._platform.wait_for_current(self.stream)
        with self._platform.on_stream(self.stream):
            copy_blocks(self.src, src_block_ids, self.dst, dst_block_ids)
            done = self._platform.event()
        self._inflight.append((request_id, done))

    def poll(self) -> list[str]:
        done = [rid for rid, ev in self._inflight if ev is None or ev.query()]
        if done:
            self._inflight = [(rid, ev) for rid, ev in self._inflight if rid not in done]
        return done

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._inflight.clear()
        self.dst = None
        self._unmap()
