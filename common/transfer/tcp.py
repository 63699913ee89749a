"""tcp: anywhere. The blocks travel as raw frames on the KV link's data
connection, a group of layers per frame, the write with the fewest bytes left
first (the connection takes only a few frames at a time, so a short prompt's KV
is not queued behind a long one's). On CUDA the prefill side gathers each group into pinned
memory on a side stream, so the forward pass that follows is not held up; the
decode side lands each frame in the reserved blocks from a thread of its own,
on its own side stream, and admits the request once every frame is in. A unit
of a write is a layer: a commit must say every layer, and every layer must
have arrived (a frame lost with a reset connection fails the handoff).

A write may cross as int8 (common/base/kv_wire.py): the writer quantizes each gathered
frame's rows (kernels/kv_quant.py: D values and their scale, [.., D + 4] int8) and the
receiver dequantizes them into its pages; both caches are then in the model's dtype."""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Annotated

import torch

from common.base.log import get_logger
from common.engine.platform import platform_for
from common.transfer.backend import Backend, KVWriter, LocalCache, Send, parse
from common.transfer.copy import TransferError, copy_blocks
from common.wire.limits import Range
from common.wire.protocol import KVTransfer, KVWelcome
from kernels import kv_quant

log = get_logger("transfer")

FRAME_BYTES = 2**20  # aim per frame: large enough to stream, small enough to interleave


def frame_shape(cache: torch.Tensor, num_blocks: int) -> tuple[int, int]:
    """(layers, blocks) a frame of a num_blocks write holds: whole layers, as many as fit
    FRAME_BYTES, or, where one layer is larger, part of one layer's blocks."""
    per_block = cache[0, :, :1].numel() * cache.element_size()
    per_layer = per_block * num_blocks
    if per_layer > FRAME_BYTES:
        return 1, max(1, FRAME_BYTES // per_block)
    return max(1, min(cache.shape[0], FRAME_BYTES // max(per_layer, 1))), num_blocks


@dataclass
class TcpHeader:
    """A frame holds layers [first_layer, first_layer + data.shape[0]) of the reservation's
    blocks [first_block, first_block + data.shape[2]): data [layers, 2, blocks, block_size,
    kv_heads, head_dim]."""

    first_layer: Annotated[int, Range(0, 4096)]
    first_block: Annotated[int, Range(0, 2**31 - 1)] = 0
    is_int8: bool = False  # data is [.., D + 4] int8: quantized rows and their scales


@dataclass
class _Frame:
    first_layer: int
    first_block: int  # of the write's blocks
    kv: torch.Tensor  # [layers, 2, blocks, block_size, Hk, D] on the host
    ready: object | None  # the device-to-host copy is done (a platform event)


@dataclass
class _Write:
    reservation: str
    deadline: float  # monotonic: not all sent by then, it is stopped
    frames: deque[_Frame] = field(default_factory=deque)
    idx: torch.Tensor | None = None  # the source block ids (on the device that gathers)
    num_bytes_left: int = 0  # of the whole write, not yet on the socket
    is_int8: bool = False  # it crosses as int8 rows and scales
    is_open: bool = True  # more layers may come (until end())
    is_cancelled: bool = False


class TcpWriter(KVWriter):
    name = "tcp"
    is_layerwise = True

    def __init__(self, cache: torch.Tensor, send: Send):
        self.src = cache
        self.send = send
        self._platform = platform_for(cache.device)
        self.stream = self._platform.side_stream()
        self._writes: OrderedDict[str, _Write] = OrderedDict()  # sent in this order
        self.is_stalled = False  # the last poll found the link refusing: only the peer can move
        # NOTE: an 8-bit cache's blocks already cross in 8 bits, as they are
        self.wire_dtypes = () if kv_quant.is_quantized(cache) else ("int8",)

    def begin(
        self,
        request_id: str,
        reservation: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        within_s: float,
        wire: str = "same",
    ) -> None:
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_block_ids)} blocks for {len(dst_block_ids)} reserved")
        if request_id in self._writes:
            raise TransferError(f"a second write of {request_id} under way")
        if wire not in ("same", *self.wire_dtypes):
            raise TransferError(f"cannot send this cache's KV as {wire}")
        w = _Write(reservation, time.monotonic() + max(within_s, 0.0), is_int8=wire == "int8")
        w.num_bytes_left = (
            self.wire_bytes(len(src_block_ids))
            if w.is_int8
            else len(src_block_ids) * self.src[:, :, :1].numel() * self.src.element_size()
        )
        w.idx = torch.tensor(src_block_ids, dtype=torch.int64)
        if self.stream is not None:
            self._platform.wait_for_current(self.stream)
            # NOTE: made on the side stream that reads it; made on the default stream,
            # its memory could go to the next forward pass before the gathers read it.
            with self._platform.on_stream(self.stream):
                w.idx = w.idx.to(self.src.device, non_blocking=True)
        self._writes[request_id] = w

    @torch.inference_mode()
    def write_layers(
        self, request_id: str, first_layer: int, end_layer: int, blocks: range | None = None
    ) -> None:
        """Frames of layers [first_layer, end_layer) of the write's blocks `blocks` (all if
        None), gathered now (CPU) or on the side stream behind what the device has queued
        (CUDA), quantized if it crosses as int8."""
        w = self._writes[request_id]
        blocks = range(w.idx.shape[0]) if blocks is None else blocks
        num_layers, num_blocks = frame_shape(self.src, len(blocks))
        if self.stream is not None:
            self._platform.wait_for_current(self.stream)
        for first in range(first_layer, end_layer, num_layers):
            group = self.src[first : min(first + num_layers, end_layer)]
            for b in range(blocks.start, blocks.stop, num_blocks):
                idx = w.idx[b : min(b + num_blocks, blocks.stop)]
                if self.stream is None:
                    w.frames.append(_Frame(first, b, self._gather(group, idx, w), None))
                    continue
                with self._platform.on_stream(self.stream):
                    kv = self._gather(group, idx, w)
                    host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
                    host.copy_(kv, non_blocking=True)
                    ready = self._platform.event()
                w.frames.append(_Frame(first, b, host, ready))

    @staticmethod
    def _gather(group: torch.Tensor, idx: torch.Tensor, w: _Write) -> torch.Tensor:
        """Blocks idx of a group of layers: [layers, 2, len(idx), block_size, Hk, D] as the
        cache holds them, or int8 rows [.., D + 4] where the write crosses as int8."""
        kv = group.index_select(2, idx)
        return kv_quant.quantize(kv, torch.int8) if w.is_int8 else kv

    def end(self, request_id: str) -> int:
        self._writes[request_id].is_open = False
        return self.src.shape[0]

    def renew(self, request_id: str, within_s: float) -> None:
        w = self._writes.get(request_id)
        if w is not None:
            w.deadline = time.monotonic() + max(within_s, 0.0)

    def flush(self) -> None:
        """Frames that are ready go on the socket; nothing ends here."""
        self._send(time.monotonic())

    def _send(self, now: float) -> dict[str, str]:
        """Send the frames whose copy is done, the write with the fewest bytes left first,
        until the link takes no more -> why each write that must stop stops (cancelled, or
        past its deadline)."""
        stopped = {}
        self.is_stalled = False
        for rid, w in self._writes.items():
            why = (
                "cancelled"
                if w.is_cancelled
                else "not all of it could be sent before its reservation could end"
                if now > w.deadline
                else None
            )
            if why is not None:
                stopped[rid] = why
        # NOTE: stable: writes of equal size go in the order they began
        for rid, w in sorted(self._writes.items(), key=lambda item: item[1].num_bytes_left):
            while (
                rid not in stopped
                and w.frames
                and (w.frames[0].ready is None or w.frames[0].ready.query())
            ):
                f = w.frames[0]
                header = {"first_layer": f.first_layer, "first_block": f.first_block}
                if w.is_int8:
                    header["is_int8"] = True
                if not self.send(KVTransfer(rid, w.reservation, "tcp", header, f.kv)):
                    self.is_stalled = True  # not connected, or full: when it takes more
                    return stopped
                w.frames.popleft()
                w.num_bytes_left -= f.kv.nbytes
        return stopped

    def poll(self) -> list[tuple[str, str | None]]:
        """A write is done once it has ended and its last frame is queued on the socket, and
        stopped if cancelled or past its deadline (a link that refuses frames, to a peer gone
        or cut off, holds nothing for ever)."""
        ended = []
        stopped = self._send(time.monotonic())
        for rid, w in list(self._writes.items()):
            why = stopped.get(rid)
            if why is not None:
                for f in w.frames:  # its source blocks are freed once it ends: gathers done first
                    if f.ready is not None:
                        f.ready.synchronize()
            elif w.frames or w.is_open:
                continue
            del self._writes[rid]
            ended.append((rid, why))
        return ended

    def cancel(self, request_id: str) -> None:
        """Its frames not yet on the socket are dropped (the decode node refuses a commit
        that lacks them); those sent land only in blocks of the grant they name."""
        w = self._writes.get(request_id)
        if w is not None:
            w.is_cancelled = True

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._writes.clear()


class TcpReceiver:
    """Lands frames in the reserved blocks. On CUDA a thread of its own does the host
    copy into pinned memory and queues the device copy on a side stream, so the
    decode loop only checks a frame's shape and hands it over."""

    def __init__(self, cache: LocalCache):
        self.cache = cache = cache.tensor
        self._landing: dict[str, list] = {}  # request -> events, or None while queued
        self._got: dict[
            str, torch.Tensor
        ] = {}  # request -> [layers, its blocks]: which arrived (bool)
        self.failed: dict[str, str] = {}  # request -> why its KV did not land
        self.lossy: set[str] = set()  # requests some of whose frames were int8 rows
        self._lock = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._platform = platform_for(cache.device)
        self.stream = self._platform.side_stream()
        if self.stream is not None:
            self._thread = threading.Thread(target=self._run, name="kv-tcp-receiver", daemon=True)
            self._thread.start()

    def describe(self) -> dict:
        return {}

    def progress(self) -> bool:
        return False

    def num_units(self, num_blocks: int) -> int:
        return self.cache.shape[0]

    def num_received(self, request_id: str) -> int:  # whole layers
        got = self._got.get(request_id)
        return 0 if got is None else int(got.all(dim=1).sum())

    def landing_error(self, request_id: str) -> str | None:
        return self.failed.get(request_id)

    def is_lossy(self, request_id: str) -> bool:
        return request_id in self.lossy

    def receive(self, sender: bytes, msg: KVTransfer, dst_block_ids: list[int]) -> None:
        h = parse(TcpHeader, msg.header, "tcp header")
        first_layer, first_block = h.first_layer, h.first_block
        kv, c = msg.data, self.cache
        layers, blocks = (kv.shape[0], kv.shape[2]) if kv.dim() == 6 else (0, 0)
        # NOTE: int8 rows land in a cache of the model's dtype only (an 8-bit one's pages
        # cross as they are: the handshake refuses caches that differ)
        row, dtype = (c.shape[-1], c.dtype)
        if h.is_int8:
            row, dtype = kv_quant.row_size(c.shape[-1], "int8"), torch.int8
        per_block = c[0, :, :1].numel() * c.element_size()  # a layer's block in the cache
        if (
            kv.dim() != 6
            or (h.is_int8 and kv_quant.is_quantized(c))
            or tuple(kv.shape) != (layers, 2, blocks, *c.shape[3:-1], row)
            or kv.dtype != dtype
            or layers == 0
            or blocks == 0
            or not 0 <= first_layer <= c.shape[0] - layers
            or first_block + blocks > len(dst_block_ids)
            # NOTE: an int8 frame lands through temporaries several times its size: no
            # larger than a writer makes one (frame_shape), whatever the link allows
            or (h.is_int8 and layers * blocks * per_block > max(FRAME_BYTES, per_block))
        ):
            raise TransferError(
                f"KV frame {tuple(kv.shape)} {kv.dtype} at layer {first_layer}, block "
                f"{first_block}{' (int8 rows)' if h.is_int8 else ''} does not fit "
                f"{len(dst_block_ids)} reserved blocks of this cache {tuple(c.shape)} {c.dtype}"
            )
        got = self._got.setdefault(
            msg.request_id, torch.zeros(c.shape[0], len(dst_block_ids), dtype=torch.bool)
        )
        part = got[first_layer : first_layer + layers, first_block : first_block + blocks]
        if bool(part.any()):
            raise TransferError(
                f"part of layers {first_layer}-{first_layer + layers - 1} of "
                f"{msg.request_id} arrived twice"
            )
        part.fill_(True)
        if h.is_int8:
            self.lossy.add(msg.request_id)
        dst = list(dst_block_ids[first_block : first_block + blocks])
        if self.stream is None:
            with torch.inference_mode():
                if h.is_int8:
                    kv = kv_quant.dequantize(kv, c.dtype)
                copy_blocks(kv, list(range(blocks)), c[first_layer : first_layer + layers], dst)
            return
        with self._lock:
            self._landing.setdefault(msg.request_id, []).append(None)
        # NOTE: kv aliases zmq's receive buffer, which the tensor keeps alive.
        self._queue.put((msg.request_id, first_layer, kv, h.is_int8, dst))

    @torch.inference_mode()
    def _run(self) -> None:
        p = self._platform
        p.activate()
        while (item := self._queue.get()) is not None:
            rid, first, kv, is_int8, dst_ids = item
            try:
                pinned = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
                pinned.copy_(kv)  # the host copy, off the decode loop
                with p.on_stream(self.stream):
                    staged = pinned.to(self.cache.device, non_blocking=True)
                    if is_int8:
                        staged = kv_quant.dequantize(staged, self.cache.dtype)
                    copy_blocks(
                        staged,
                        list(range(len(dst_ids))),
                        self.cache[first : first + kv.shape[0]],
                        dst_ids,
                    )
                    landed = p.event()
            except Exception as e:  # the request fails; the thread goes on with the others
                log.exception("landing a KV frame for %s failed", rid)
                self.failed[rid] = f"landing its KV failed: {e}"
                with p.on_stream(self.stream):
                    landed = p.event()
            with self._lock:
                events = self._landing.get(rid)
                if events is not None:
                    events[events.index(None)] = landed
                self._lock.notify_all()

    def is_landed(self, request_id: str) -> bool:
        with self._lock:
            events = self._landing.get(request_id)
            if events and all(e is not None and e.query() for e in events):
                del self._landing[request_id]
            return request_id not in self._landing

    def forget(self, request_id: str) -> None:
        """Wait until no copy can still write the request's blocks (they go back to the pool)."""
        with self._lock:
            self._lock.wait_for(lambda: None not in self._landing.get(request_id, []))
            events = self._landing.pop(request_id, [])
            self.failed.pop(request_id, None)
            self._got.pop(request_id, None)
            self.lossy.discard(request_id)
        for e in events:
            e.synchronize()

    def close(self) -> None:
        for rid in list(self._landing):
            self.forget(rid)
        if self.stream is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)


def _open_writer(
    descriptor: dict, welcome: KVWelcome, cache: torch.Tensor, send: Send
) -> TcpWriter:
    return TcpWriter(cache, send)


BACKEND = Backend(
    "tcp", lambda device: None, TcpReceiver, _open_writer, is_layerwise=True, is_kv_apart=True
)
