"""tcp: anywhere. The blocks travel as raw frames on the KV link, a group of
layers per frame. On CUDA the prefill side gathers each group into pinned
memory on a side stream, so the forward pass that follows is not held up; the
decode side lands each frame in the reserved blocks on its own side stream and
admits the request once every frame is in."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from common.protocol import KVBlocks
from common.transfer.copy import TransferError, copy_blocks

FRAME_BYTES = 16 * 2**20   # aim per frame: large enough to stream, small enough to pipeline


def layers_per_frame(cache: torch.Tensor, num_blocks: int) -> int:
    per_layer = cache[0, :, :num_blocks].numel() * cache.element_size()
    return max(1, min(cache.shape[0], FRAME_BYTES // max(per_layer, 1)))


@dataclass
class _Frame:
    request_id: str
    first_layer: int
    kv: torch.Tensor                     # [layers, 2, n, block_size, Hk, D] on the host
    ready: torch.cuda.Event | None       # the device-to-host copy is done
    is_last: bool


class TcpWriter:
    name = "tcp"

    def __init__(self, cache: torch.Tensor, send: Callable[[KVBlocks], bool]):
        self.src = cache
        self.send = send
        self.stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None
        self._frames: deque[_Frame] = deque()

    @torch.inference_mode()
    def write(self, request_id: str, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_block_ids)} blocks for {len(dst_block_ids)} reserved")
        n, num_layers = len(src_block_ids), self.src.shape[0]
        step = layers_per_frame(self.src, n)
        idx = torch.tensor(src_block_ids, dtype=torch.int64)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.src.device))
            # NOTE: made on the side stream that reads it; made on the default stream,
            # its memory could go to the next forward pass before the gathers read it.
            with torch.cuda.stream(self.stream):
                idx = idx.to(self.src.device, non_blocking=True)
        for first in range(0, num_layers, step):
            group = self.src[first: first + step]
            if self.stream is None:
                self._frames.append(_Frame(request_id, first, group.index_select(2, idx), None,
                                           first + step >= num_layers))
                continue
            with torch.cuda.stream(self.stream):
                host = torch.empty((group.shape[0], 2, n, *group.shape[3:]), dtype=group.dtype,
                                   pin_memory=True)
                host.copy_(group.index_select(2, idx), non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.stream)
            self._frames.append(_Frame(request_id, first, host, ready, first + step >= num_layers))

    def poll(self) -> list[str]:
        """Send every frame whose copy is done, in order; a request is written once
        its last frame is queued on the socket."""
        done = []
        while self._frames:
            f = self._frames[0]
            if f.ready is not None and not f.ready.query():
                break
            if not self.send(KVBlocks(f.request_id, f.first_layer, f.kv)):
                break  # the link is not connected or full: try again next turn
            self._frames.popleft()
            if f.is_last:
                done.append(f.request_id)
        return done

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._frames.clear()


class TcpReceiver:
    def __init__(self, cache: torch.Tensor):
        self.cache = cache
        self.stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None
        self._landing: dict[str, list[torch.cuda.Event]] = {}

    @torch.inference_mode()
    def receive(self, msg: KVBlocks, dst_block_ids: list[int]) -> None:
        kv, c = msg.kv, self.cache
        layers = kv.shape[0] if kv.dim() == 6 else 0
        expected = (layers, 2, len(dst_block_ids), *c.shape[3:])
        if kv.dim() != 6 or tuple(kv.shape) != expected or kv.dtype != c.dtype or layers == 0 \
                or not 0 <= msg.first_layer <= c.shape[0] - layers:
            raise TransferError(f"KV frame {tuple(kv.shape)} {kv.dtype} at layer {msg.first_layer} "
                                f"does not fit {len(dst_block_ids)} reserved blocks of this cache "
                                f"{tuple(c.shape)} {c.dtype}")
        dst = c[msg.first_layer: msg.first_layer + layers]
        src_ids = list(range(len(dst_block_ids)))
        if self.stream is None:
            copy_blocks(kv, src_ids, dst, dst_block_ids)
            return
        # NOTE: the frame is zmq's receive buffer (pageable): one host copy into pinned
        # memory, then the device copy runs on a side stream beside the decode steps.
        pinned = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
        pinned.copy_(kv)
        with torch.cuda.stream(self.stream):
            staged = pinned.to(c.device, non_blocking=True)
            copy_blocks(staged, src_ids, dst, dst_block_ids)
            landed = torch.cuda.Event()
            landed.record(self.stream)
        self._landing.setdefault(msg.request_id, []).append(landed)

    def is_landed(self, request_id: str) -> bool:
        events = self._landing.get(request_id)
        if events and all(e.query() for e in events):
            del self._landing[request_id]
        return request_id not in self._landing

    def forget(self, request_id: str) -> None:
        events = self._landing.pop(request_id, [])
        for e in events:
            e.synchronize()  # the blocks go back to the pool: no copy may still write them

    def forget_all(self) -> None:
        for rid in list(self._landing):
            self.forget(rid)
