"""ipc: one host. The decode node's whole cache is mapped into the prefill process
once, at connection time, and the prefill node copies its blocks straight into
the reserved ones: device to device on CUDA (a peer copy across devices), a
memory copy through a shared-memory segment on CPU."""
from __future__ import annotations

import math
import mmap
import os
import secrets
from multiprocessing import shared_memory

import torch

from common.protocol import CudaIpcHandle, KVWelcome
from common.transfer.copy import TransferError, copy_blocks

SHM_PREFIX = "pdserve-kv"


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def is_supported(device: torch.device) -> bool:
    return device.type == "cpu" and os.path.isdir("/dev/shm") or device.type == "cuda"


def can_write(ours: torch.device, theirs: torch.device) -> bool:
    return ours.type == theirs.type and is_supported(ours)


# ---- decode side: a cache others can map ------------------------------------

def allocate_shared_cpu_cache(shape: tuple[int, ...], dtype: torch.dtype
                              ) -> tuple[torch.Tensor, shared_memory.SharedMemory]:
    """A zeroed CPU tensor in a fresh shared-memory segment. Python's resource tracker
    unlinks the segment if this process dies without closing it."""
    _remove_stale_segments()
    nbytes = _nbytes(shape, dtype)
    shm = shared_memory.SharedMemory(f"{SHM_PREFIX}-{os.getpid()}-{secrets.token_hex(4)}",
                                     create=True, size=max(nbytes, 1))
    cache = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    return cache, shm  # a fresh segment reads as zeros


def release_shared_cpu_cache(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # a tensor view is still alive somewhere: the mapping goes at exit
        pass
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


def _remove_stale_segments() -> None:
    """Segments of decode processes that died before their tracker could unlink them."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if name.startswith(SHM_PREFIX + "-") and len(parts) == 4 and parts[2].isdigit():
            try:
                os.kill(int(parts[2]), 0)
            except ProcessLookupError:
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass
            except PermissionError:
                pass


def share_cuda(cache: torch.Tensor) -> CudaIpcHandle:
    """The IPC handle of the cache's allocation (plain bytes and ints)."""
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     is_sync) = cache.untyped_storage()._share_cuda_()
    if cache.storage_offset() != 0:
        raise TransferError("the KV cache must start its allocation to be shared")
    return CudaIpcHandle(int(device), bytes(handle), int(size), int(offset), bytes(ref_handle),
                         int(ref_offset), bytes(event_handle) if event_handle else None, bool(is_sync))


# ---- prefill side -------------------------------------------------------------

def _open_cpu(welcome: KVWelcome, dtype: torch.dtype, shape: list[int]) -> tuple[torch.Tensor, mmap.mmap]:
    name = welcome.shm_name or ""
    if not name.startswith(SHM_PREFIX + "-") or "/" in name:
        raise TransferError(f"the decode node named no usable shared-memory segment ({name!r})")
    nbytes = _nbytes(shape, dtype)
    # NOTE: opened with os/mmap rather than SharedMemory, whose resource tracker
    # would unlink the decode node's segment when this process exits.
    try:
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    except OSError as e:
        raise TransferError(f"cannot open the decode node's KV segment {name}: {e}") from None
    try:
        if os.fstat(fd).st_size < nbytes:
            raise TransferError(f"KV segment {name} holds {os.fstat(fd).st_size} bytes, "
                                f"the cache {shape} needs {nbytes}")
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(dtype).view(shape), mapping


def _open_cuda(h: CudaIpcHandle, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            h.device, h.handle, h.storage_size, h.storage_offset, h.ref_counter_handle,
            h.ref_counter_offset, h.event_handle or b"", h.is_event_sync_required)
    except Exception as e:  # a bad or foreign handle: CUDA's error, whatever its type
        raise TransferError(f"cannot open the decode node's CUDA IPC handle: {e}") from None
    if _nbytes(shape, dtype) > storage.nbytes():
        raise TransferError(f"the shared allocation holds {storage.nbytes()} bytes, "
                            f"the cache {shape} needs {_nbytes(shape, dtype)}")
    return torch.empty(0, dtype=dtype, device=f"cuda:{h.device}").set_(storage, 0, shape)


class IpcWriter:
    name = "ipc"

    def __init__(self, welcome: KVWelcome, cache: torch.Tensor):
        self.src = cache
        dtype, shape = cache.dtype, list(welcome.cache_shape)
        self._mapping = None
        if cache.is_cuda:
            if welcome.cuda_ipc is None:
                raise TransferError("the decode node sent no CUDA IPC handle")
            self.dst = _open_cuda(welcome.cuda_ipc, dtype, shape)
            self.stream = torch.cuda.Stream(cache.device)
        else:
            self.dst, self._mapping = _open_cpu(welcome, dtype, shape)
            self.stream = None
        self._num_dst_blocks = shape[2]
        self._inflight: list[tuple[str, torch.cuda.Event | None]] = []

    def write(self, request_id: str, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        if any(not 0 < b < self._num_dst_blocks for b in dst_block_ids):
            raise TransferError(f"destination blocks outside the decode cache of {self._num_dst_blocks}")
        if self.stream is None:
            copy_blocks(self.src, src_block_ids, self.dst, dst_block_ids)
            self._inflight.append((request_id, None))
            return
        # The copy waits for the forward pass that wrote the blocks, then runs beside
        # the next one; the event tells the loop when the commit may go out.
        self.stream.wait_stream(torch.cuda.current_stream(self.src.device))
        with torch.cuda.stream(self.stream):
            copy_blocks(self.src, src_block_ids, self.dst, dst_block_ids)
            done = torch.cuda.Event()
            done.record(self.stream)
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
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                pass
            self._mapping = None
