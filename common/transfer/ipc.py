"""ipc: one host. The decode node's whole cache is mapped into the prefill process
once, at connection time, and the prefill node copies its blocks straight into
the reserved ones: device to device on CUDA (a peer copy across devices), a
memory copy through a shared-memory segment on CPU."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch

from common.engine.platform import PlatformError, platform_for, platform_type
from common.kv.blocks import is_cache_shape, num_cache_blocks
from common.transfer.backend import Backend, KVWriter, LocalCache, Send, parse, why_not_same_kind
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
    shm_name: Name | None = None  # CPU: the cache's shared-memory segment
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


class IpcWriter(KVWriter):
    """NOTE: a copy into the decode node's memory cannot be refused there: this writer
    stops itself at its deadline, checked before each layer it queues (the decode node
    holds an expired grant's blocks a while longer, receiver.py). On a device, a layer
    queued before the deadline runs behind the pass that computes it."""

    name = "ipc"
    is_layerwise = True

    def __init__(
        self,
        descriptor: dict,
        welcome: KVWelcome,
        cache: torch.Tensor,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.src = cache
        shape = list(welcome.cache_shape)
        if not is_cache_shape(shape):
            raise TransferError(f"the decode node's cache shape {shape} is not a KV cache's")
        self._platform = platform_for(cache.device)
        desc = parse(IpcDescriptor, descriptor, "ipc")
        self.dst, self._unmap = _open(desc, cache.dtype, shape, cache.device)
        self.stream = self._platform.side_stream()
        self.clock = clock
        self._num_dst_blocks = num_cache_blocks(shape)
        # (request id, its copies' event, why it failed or None): ended, its copies may run
        self._inflight: list[tuple[str, object | None, str | None]] = []
        self._open: dict[str, _OpenWrite] = {}  # begun, not ended

    is_stalled = False

    def begin(
        self,
        request_id: str,
        reservation: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        within_s: float,
        wire: str = "same",
    ) -> None:
        if any(not 0 < b < self._num_dst_blocks for b in dst_block_ids):
            raise TransferError(
                f"destination blocks outside the decode cache of {self._num_dst_blocks}"
            )
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_block_ids)} blocks for {len(dst_block_ids)} reserved")
        self._open[request_id] = _OpenWrite(src_block_ids, dst_block_ids, self.clock() + within_s)

    def write_layers(
        self, request_id: str, first_layer: int, end_layer: int, blocks: range | None = None
    ) -> None:
        """TransferError: past its deadline (nothing more is queued: cancel it)."""
        w = self._open[request_id]
        src, dst = w.src, w.dst
        if blocks is not None:
            src, dst = src[blocks.start : blocks.stop], dst[blocks.start : blocks.stop]
        if self.stream is None:  # a memory copy, made here and now: checked layer by layer
            for layer in range(first_layer, end_layer):
                self._check(w)
                copy_blocks(self.src[layer : layer + 1], src, self.dst[layer : layer + 1], dst)
            return
        # Queued on the side stream: it waits for the forward pass that wrote the blocks,
        # then runs beside the next one (or the next layers).
        self._check(w)
        self._platform.wait_for_current(self.stream)
        with self._platform.on_stream(self.stream):
            copy_blocks(self.src[first_layer:end_layer], src, self.dst[first_layer:end_layer], dst)

    def _check(self, w: _OpenWrite) -> None:
        if self.clock() >= w.deadline:
            raise TransferError(
                "its reservation could end before the copy: stopped at its deadline"
            )

    def drop_begun(self, request_id: str) -> None:
        self._open.pop(request_id, None)  # stopped part-way at its deadline

    def end(self, request_id: str) -> int:
        """Nothing crosses the KV link (no units): the commit's reservation and epoch, and
        --kv-verify, are what tie the copy to its grant."""
        del self._open[request_id]
        self._inflight.append((request_id, self._event(), None))
        return 0

    def _event(self):
        """What tells when the copies queued so far have run (None: they have)."""
        if self.stream is None:
            return None
        with self._platform.on_stream(self.stream):
            return self._platform.event()

    def renew(self, request_id: str, within_s: float) -> None:
        w = self._open.get(request_id)
        if w is not None:
            w.deadline = self.clock() + within_s

    def flush(self) -> None:
        pass

    def poll(self) -> list[tuple[str, str | None]]:
        done = [(rid, error) for rid, ev, error in self._inflight if ev is None or ev.query()]
        if done:
            ended = {rid for rid, _ in done}
            self._inflight = [w for w in self._inflight if w[0] not in ended]
        return done

    def cancel(self, request_id: str) -> None:
        """One begun and not ended stops here; it is named ended (failed) once the copies
        already queued for it have run: its source blocks are read until then."""
        if self._open.pop(request_id, None) is not None:
            self._inflight.append((request_id, self._event(), "cancelled"))

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._inflight.clear()
        self.dst = None
        self._unmap()


@dataclass
class _OpenWrite:
    src: list[int]
    dst: list[int]
    deadline: float  # monotonic: nothing is queued from then on


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

    def is_lossy(self, request_id: str) -> bool:
        return False  # the prefill node copies its own pages

    def forget(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def _open_writer(
    descriptor: dict, welcome: KVWelcome, cache: torch.Tensor, send: Send
) -> IpcWriter:
    return IpcWriter(descriptor, welcome, cache)


BACKEND = Backend(
    "ipc",
    why_unusable,
    IpcReceiver,
    _open_writer,
    why_not_with=why_not_with,
    is_one_sided=True,
    is_layerwise=True,
    needs_shared_cache=lambda device: platform_type(device).is_host,
)
