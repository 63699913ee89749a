"""tcp: anywhere. The blocks travel as raw frames on the KV link, a group of
layers per frame. On CUDA the prefill side gathers each group into pinned
memory on a side stream, so the forward pass that follows is not held up; the
decode side lands each frame in the reserved blocks from a thread of its own,
on its own side stream, and admits the request once every frame is in. A unit
of a write is a layer: a commit must say every layer, and every layer must
have arrived (a frame lost with a reset connection fails the handoff)."""
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
from common.transfer.backend import Backend, LocalCache, Send, parse
from common.transfer.copy import TransferError, copy_blocks
from common.wire.limits import Range
from common.wire.protocol import KVTransfer, KVWelcome

log = get_logger("transfer")

FRAME_BYTES = 16 * 2**20   # aim per frame: large enough to stream, small enough to pipeline


def layers_per_frame(cache: torch.Tensor, num_blocks: int) -> int:
    per_layer = cache[0, :, :num_blocks].numel() * cache.element_size()
    return max(1, min(cache.shape[0], FRAME_BYTES // max(per_layer, 1)))


@dataclass
class TcpHeader:
    """A frame holds layers [first_layer, first_layer + data.shape[0]) of a reservation's
    blocks: data [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
    first_layer: Annotated[int, Range(0, 4096)]


@dataclass
class _Frame:
    first_layer: int
    kv: torch.Tensor                     # [layers, 2, n, block_size, Hk, D] on the host
    ready: object | None                 # the device-to-host copy is done (a platform event)


@dataclass
class _Write:
    reservation: str
    deadline: float                      # monotonic: not all sent by then, it is stopped
    frames: deque[_Frame] = field(default_factory=deque)
    idx: torch.Tensor | None = None      # the source block ids (on the device that gathers)
    is_open: bool = True                 # more layers may come (until end())
    is_cancelled: bool = False


class TcpWriter:
    name = "tcp"
    is_layerwise = True

    def __init__(self, cache: torch.Tensor, send: Send):
        self.src = cache
        self.send = send
        self._platform = platform_for(cache.device)
        self.stream = self._platform.side_stream()
        self._writes: OrderedDict[str, _Write] = OrderedDict()   # sent in this order
        self.is_stalled = False      # the last poll found the link refusing: only the peer can move

    def write(self, request_id: str, reservation: str, src_block_ids: list[int], dst_block_ids: list[int],
              within_s: float) -> int:
        self.begin(request_id, reservation, src_block_ids, dst_block_ids, within_s)
        self.write_layers(request_id, 0, self.src.shape[0])
        return self.end(request_id)

    def begin(self, request_id: str, reservation: str, src_block_ids: list[int], dst_block_ids: list[int],
              within_s: float) -> None:
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_block_ids)} blocks for {len(dst_block_ids)} reserved")
        if request_id in self._writes:
            raise TransferError(f"a second write of {request_id} under way")
        w = _Write(reservation, time.monotonic() + max(within_s, 0.0))
        w.idx = torch.tensor(src_block_ids, dtype=torch.int64)
        if self.stream is not None:
            self._platform.wait_for_current(self.stream)
            # NOTE: made on the side stream that reads it; made on the default stream,
            # its memory could go to the next forward pass before the gathers read it.
            with self._platform.on_stream(self.stream):
                w.idx = w.idx.to(self.src.device, non_blocking=True)
        self._writes[request_id] = w

    @torch.inference_mode()
    def write_layers(self, request_id: str, first_layer: int, end_layer: int) -> None:
        """Frames of layers [first_layer, end_layer), gathered now (CPU) or on the side
        stream behind what the device has queued (CUDA)."""
        w = self._writes[request_id]
        n = w.idx.shape[0]
        step = layers_per_frame(self.src, n)
        if self.stream is not None:
            self._platform.wait_for_current(self.stream)
        for first in range(first_layer, end_layer, step):
            group = self.src[first: min(first + step, end_layer)]
            if self.stream is None:
                w.frames.append(_Frame(first, group.index_select(2, w.idx), None))
                continue
            with self._platform.on_stream(self.stream):
                host = torch.empty((group.shape[0], 2, n, *group.shape[3:]), dtype=group.dtype,
                                   pin_memory=True)
                host.copy_(group.index_select(2, w.idx), non_blocking=True)
                ready = self._platform.event()
            w.frames.append(_Frame(first, host, ready))

    def end(self, request_id: str) -> int:
        self._writes[request_id].is_open = False
        return self.src.shape[0]

    def flush(self) -> None:
        """Frames that are ready go on the socket; nothing ends here."""
        self._send(time.monotonic())

    def _send(self, now: float) -> dict[str, str]:
        """Send every frame whose copy is done, writes in order -> why each write that must
        stop stops (cancelled, or past its deadline)."""
        stopped, is_blocked = {}, False
        self.is_stalled = False
        for rid, w in self._writes.items():
            why = "cancelled" if w.is_cancelled else \
                "not all of it could be sent before its reservation could end" if now > w.deadline else None
            if why is not None:
                stopped[rid] = why
                continue
            while w.frames and not is_blocked:
                f = w.frames[0]
                if f.ready is not None and not f.ready.query():
                    is_blocked = True
                elif not self.send(KVTransfer(rid, w.reservation, "tcp", {"first_layer": f.first_layer}, f.kv)):
                    is_blocked = self.is_stalled = True   # not connected, or full: next turn
                else:
                    w.frames.popleft()
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
                for f in w.frames:   # its source blocks are freed once it ends: gathers done first
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
        self._landing: dict[str, list] = {}     # request -> events, or None while queued
        self._layers: dict[str, set[int]] = {}  # request -> the layers that arrived
        self.failed: dict[str, str] = {}        # request -> why its KV did not land
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

    def num_received(self, request_id: str) -> int:
        return len(self._layers.get(request_id, ()))

    def landing_error(self, request_id: str) -> str | None:
        return self.failed.get(request_id)

    def receive(self, sender: bytes, msg: KVTransfer, dst_block_ids: list[int]) -> None:
        first_layer = parse(TcpHeader, msg.header, "tcp header").first_layer
        kv, c = msg.data, self.cache
        layers = kv.shape[0] if kv.dim() == 6 else 0
        expected = (layers, 2, len(dst_block_ids), *c.shape[3:])
        if kv.dim() != 6 or tuple(kv.shape) != expected or kv.dtype != c.dtype or layers == 0 \
                or not 0 <= first_layer <= c.shape[0] - layers:
            raise TransferError(f"KV frame {tuple(kv.shape)} {kv.dtype} at layer {first_layer} "
                                f"does not fit {len(dst_block_ids)} reserved blocks of this cache "
                                f"{tuple(c.shape)} {c.dtype}")
        arrived = self._layers.setdefault(msg.request_id, set())
        new = set(range(first_layer, first_layer + layers))
        if arrived & new:
            raise TransferError(f"layers {sorted(arrived & new)[:4]} of {msg.request_id} arrived twice")
        arrived |= new
        if self.stream is None:
            with torch.inference_mode():
                copy_blocks(kv, list(range(len(dst_block_ids))),
                            c[first_layer: first_layer + layers], dst_block_ids)
            return
        with self._lock:
            self._landing.setdefault(msg.request_id, []).append(None)
        # NOTE: kv aliases zmq's receive buffer, which the tensor keeps alive.
        self._queue.put((msg.request_id, first_layer, kv, list(dst_block_ids)))

    @torch.inference_mode()
    def _run(self) -> None:
        p = self._platform
        p.activate()
        while (item := self._queue.get()) is not None:
            rid, first, kv, dst_ids = item
            try:
                pinned = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
                pinned.copy_(kv)   # the host copy, off the decode loop
                with p.on_stream(self.stream):
                    staged = pinned.to(self.cache.device, non_blocking=True)
                    copy_blocks(staged, list(range(len(dst_ids))),
                                self.cache[first: first + kv.shape[0]], dst_ids)
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
            self._layers.pop(request_id, None)
        for e in events:
            e.synchronize()

    def close(self) -> None:
        for rid in list(self._landing):
            self.forget(rid)
        if self.stream is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)


def _open_writer(descriptor: dict, welcome: KVWelcome, cache: torch.Tensor, send: Send) -> TcpWriter:
    return TcpWriter(cache, send)


BACKEND = Backend("tcp", lambda device: None, TcpReceiver, _open_writer, is_layerwise=True)
