"""tcp: anywhere. The blocks travel as raw frames on the KV link, a group of
layers per frame. On CUDA the prefill side gathers each group into pinned
memory on a side stream, so the forward pass that follows is not held up; the
decode side lands each frame in the reserved blocks from a thread of its own,
on its own side stream, and admits the request once every frame is in."""
from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Annotated

import torch

from common.base.log import get_logger
from common.engine.platform import platform_for
from common.transfer.backend import Backend, LocalCache, Send, parse
from common.transfer.copy import TransferError, copy_blocks
from common.wire.codec import Range
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
    request_id: str
    first_layer: int
    kv: torch.Tensor                     # [layers, 2, n, block_size, Hk, D] on the host
    ready: object | None                 # the device-to-host copy is done (a platform event)
    is_last: bool


class TcpWriter:
    name = "tcp"

    def __init__(self, cache: torch.Tensor, send: Send):
        self.src = cache
        self.send = send
        self._platform = platform_for(cache.device)
        self.stream = self._platform.side_stream()
        self._frames: deque[_Frame] = deque()

    @torch.inference_mode()
    def write(self, request_id: str, src_block_ids: list[int], dst_block_ids: list[int],
              within_s: float) -> None:
        # NOTE: within_s is not needed: the decode node lands a frame only in blocks its
        # sender still holds.
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_block_ids)} blocks for {len(dst_block_ids)} reserved")
        n, num_layers = len(src_block_ids), self.src.shape[0]
        step = layers_per_frame(self.src, n)
        idx = torch.tensor(src_block_ids, dtype=torch.int64)
        if self.stream is not None:
            self._platform.wait_for_current(self.stream)
            # NOTE: made on the side stream that reads it; made on the default stream,
            # its memory could go to the next forward pass before the gathers read it.
            with self._platform.on_stream(self.stream):
                idx = idx.to(self.src.device, non_blocking=True)
        for first in range(0, num_layers, step):
            group = self.src[first: first + step]
            if self.stream is None:
                self._frames.append(_Frame(request_id, first, group.index_select(2, idx), None,
                                           first + step >= num_layers))
                continue
            with self._platform.on_stream(self.stream):
                host = torch.empty((group.shape[0], 2, n, *group.shape[3:]), dtype=group.dtype,
                                   pin_memory=True)
                host.copy_(group.index_select(2, idx), non_blocking=True)
                ready = self._platform.event()
            self._frames.append(_Frame(request_id, first, host, ready, first + step >= num_layers))

    def poll(self) -> list[tuple[str, str | None]]:
        """Send every frame whose copy is done, in order; a request is written once
        its last frame is queued on the socket."""
        done = []
        while self._frames:
            f = self._frames[0]
            if f.ready is not None and not f.ready.query():
                break
            if not self.send(KVTransfer(f.request_id, "tcp", {"first_layer": f.first_layer}, f.kv)):
                break  # the link is not connected or full: try again next turn
            self._frames.popleft()
            if f.is_last:
                done.append((f.request_id, None))
        return done

    def cancel(self, request_id: str) -> None:
        pass   # NOTE: its frames go as the link takes them, landed only in blocks still reserved

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._frames.clear()


class TcpReceiver:
    """Lands frames in the reserved blocks. On CUDA a thread of its own does the host
    copy into pinned memory and queues the device copy on a side stream, so the
    decode loop only checks a frame's shape and hands it over."""

    def __init__(self, cache: LocalCache):
        self.cache = cache = cache.tensor
        self._landing: dict[str, list] = {}     # request -> events, or None while queued
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


BACKEND = Backend("tcp", lambda device: None, TcpReceiver, _open_writer)
