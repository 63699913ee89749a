"""ipc: one host. The decode node's whole cache is mapped into the prefill process
once, at connection time, and the prefill node copies its blocks straight into
the reserved ones: device to device on CUDA (a peer copy across devices), a
memory copy through a shared-memory segment on CPU."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from common.engine.platform import PlatformError, platform_for, platform_type
from common.kv.blocks import is_cache_shape, num_cache_blocks
from common.transfer.backend import Backend, LocalCache, Send, parse, why_not_same_kind
from common.transfer.copy import TransferError, copy_blocks
from common.wire.limits import Name
from common.wire.protocol import KVTransfer, KVWelcome


@dataclass
class CudaIpcHandle:
    """A CUDA allocation shared across processes (what torch's storage sharing returns)."""
    device: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    is_event_sync_required: bool


@dataclass
class IpcDescriptor:
    shm_name: Name | None = None       # CPU: the cache's shared-memory segment
    cuda: CudaIpcHandle | None = None  # CUDA: the cache's allocation


def why_unusable(device: torch.device) -> str | None:
    why = platform_type(device).why_not_shared()
    return None if why is None else f"no shared {device.type} memory between processes here ({why})"


def why_not_with(device: torch.device, welcome: KVWelcome, is_local: bool) -> str | None:
    return "it is on another host" if not is_local else why_not_same_kind(device, welcome)


def _open(desc: IpcDescriptor, dtype: torch.dtype, shape: list[int], device: torch.device):
    """The decode node's cache mapped here, and how to unmap it."""
    if device.type == "cuda":
        if desc.cuda is None:
            raise TransferError("the decode node sent no CUDA IPC handle")
        handle = tuple(getattr(desc.cuda, f.name) for f in dataclasses.fields(CudaIpcHandle))
    else:
        handle = desc.shm_name or ""
    try:
        return platform_for(device).open_shared(handle, dtype, shape)
    except PlatformError as e:
        raise TransferError(f"cannot open the decode node's KV cache: {e}") from None


class IpcWriter:
    name = "ipc"
    is_layerwise = True

    def __init__(self, descriptor: dict, welcome: KVWelcome, cache: torch.Tensor):
        self.src = cache
        shape = list(welcome.cache_shape)
        if not is_cache_shape(shape):
            raise TransferError(f"the decode node's cache shape {shape} is not a KV cache's")
        self._platform = platform_for(cache.device)
        desc = parse(IpcDescriptor, descriptor, "ipc")
        self.dst, self._unmap = _open(desc, cache.dtype, shape, cache.device)
        self.stream = self._platform.side_stream()
        self._num_dst_blocks = num_cache_blocks(shape)
        self._inflight: list[tuple[str, object | None]] = []   # (request id, its copy's event)
        self._open: dict[str, tuple[list[int], list[int]]] = {}   # begun, not ended: (src, dst) blocks

    is_stalled = False

    def write(self, request_id: str, reservation: str, src_block_ids: list[int], dst_block_ids: list[int],
              within_s: float) -> int:
        """Nothing crosses the KV link (no units): the commit's reservation and epoch, and
        --kv-verify, are what tie the copy to its grant."""
        self.begin(request_id, reservation, src_block_ids, dst_block_ids, within_s)
        self.write_layers(request_id, 0, self.src.shape[0])
        return self.end(request_id)

    def begin(self, request_id: str, reservation: str, src_block_ids: list[int], dst_block_ids: list[int],
              within_s: float) -> None:
        if any(not 0 < b < self._num_dst_blocks for b in dst_block_ids):
            raise TransferError(f"destination blocks outside the decode cache of {self._num_dst_blocks}")
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_block_ids)} blocks for {len(dst_block_ids)} reserved")
        self._open[request_id] = (src_block_ids, dst_block_ids)

    def write_layers(self, request_id: str, first_layer: int, end_layer: int, blocks: range | None = None) -> None:
        src, dst = self._open[request_id]
        if blocks is not None:
            src, dst = src[blocks.start: blocks.stop], dst[blocks.start: blocks.stop]
        layers = slice(first_layer, end_layer)
        if self.stream is None:
            copy_blocks(self.src[layers], src, self.dst[layers], dst)
            return
        # The copy waits for the forward pass that wrote the blocks, then runs beside
        # the next one (or the next layers).
        self._platform.wait_for_current(self.stream)
        with self._platform.on_stream(self.stream):
            copy_blocks(self.src[layers], src, self.dst[layers], dst)

    def end(self, request_id: str) -> int:
        del self._open[request_id]
        done = None
        if self.stream is not None:
            with self._platform.on_stream(self.stream):
                done = self._platform.event()   # the event tells the loop when the commit may go out
        self._inflight.append((request_id, done))
        return 0

    def renew(self, request_id: str, within_s: float) -> None:
        pass   # a local copy, ended soon after its last layers: no deadline of its own

    def flush(self) -> None:
        pass

    def poll(self) -> list[tuple[str, str | None]]:
        done = [rid for rid, ev in self._inflight if ev is None or ev.query()]
        if done:
            self._inflight = [(rid, ev) for rid, ev in self._inflight if rid not in done]
        return [(rid, None) for rid in done]

    def cancel(self, request_id: str) -> None:
        # a local copy ends by itself, and soon; one begun and never ended ends here
        if self._open.pop(request_id, None) is not None:
            self._inflight.append((request_id, None))

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._inflight.clear()
        self.dst = None
        self._unmap()


class IpcReceiver:
    """Nothing crosses the KV link: the prefill node writes the mapped cache itself."""

    def __init__(self, cache: LocalCache):
        c = cache.tensor
        if c.is_cuda:
            try:
                self.desc = IpcDescriptor(cuda=CudaIpcHandle(*platform_for(c.device).share(c)))
            except PlatformError as e:
                raise TransferError(str(e)) from None
        elif cache.shm_name is None:
            raise TransferError("ipc needs the cache in shared memory, and it is not")
        else:
            self.desc = IpcDescriptor(shm_name=cache.shm_name)

    def describe(self) -> dict:
        return dataclasses.asdict(self.desc)

    def receive(self, sender: bytes, msg: KVTransfer, dst_block_ids: list[int]) -> None:
        raise TransferError("ipc sends nothing on the KV link")

    def num_units(self, num_blocks: int) -> int:
        return 0

    def num_received(self, request_id: str) -> int:
        return 0

    def progress(self) -> bool:
        return False

    def is_landed(self, request_id: str) -> bool:
        return True

    def landing_error(self, request_id: str) -> str | None:
        return None

    def forget(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def _open_writer(descriptor: dict, welcome: KVWelcome, cache: torch.Tensor, send: Send) -> IpcWriter:
    return IpcWriter(descriptor, welcome, cache)


BACKEND = Backend("ipc", why_unusable, IpcReceiver, _open_writer, why_not_with=why_not_with, is_one_sided=True,
                  is_layerwise=True,
                  needs_shared_cache=lambda device: platform_type(device).is_host)
