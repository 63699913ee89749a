"""dist: torch.distributed point-to-point, one process group per prefill/decode pair.

The decode node runs a TCPStore (its address goes out in KVWelcome). A prefill
node that picks dist makes a group of two (decode rank 0, prefill rank 1) under
a name of its own and sends each request's blocks, gathered into one buffer
[layers, 2, n, block_size, kv_heads, head_dim], as one send under a tag it
announces in a KVTransfer first (the announcement is the write's one unit). The
decode node joins the group on the first announcement (in a thread: joining
waits for the peer), runs the matching receives in order, one buffer at a time,
and lands each in the reserved blocks unless its reservation ended meanwhile.
A send past its deadline is given up and the writer moves to a new group: the
old one's thread waits out the group's timeout on its own. A write may cross as int8
rows and their scales (common/base/kv_wire.py): quantized as it is gathered, the
announcement says so, and the receive dequantizes the buffer as it lands.
Process groups: gloo on CPU, nccl on CUDA, hccl on Ascend. The decode side is
common/transfer/dist_receiver.py; the header and the group's thread, dist_pipe.py.

NOTE: the store and the group's connections are not authenticated (CURVE covers
only the ZeroMQ links), so dist is offered only when asked for by name, never
by `auto`; keep its ports on a trusted network. A peer there that sends a buffer of
another size than it announced aborts the decode process (gloo's own check).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.engine.platform import platform_for
from common.transfer.backend import NO_DATA, Backend, Send, parse
from common.transfer.copy import TransferError
from common.transfer.dist_pipe import JOIN_TIMEOUT, Pipe, pair_group
from common.transfer.dist_receiver import DistReceiver
from common.wire.limits import Name
from common.wire.protocol import KVTransfer, KVWelcome
from kernels import kv_quant


@dataclass
class DistDescriptor:
    store: Name  # "host:port" of the TCPStore pairs meet at


@dataclass
class _Send:
    request_id: str
    reservation: str
    tag: int
    buf: torch.Tensor  # the gathered blocks: its own memory, not the cache's
    ready: object | None  # the gather is done (a platform event)
    deadline: float  # monotonic
    is_int8: bool = False
    is_announced: bool = False
    is_cancelled: bool = False
    error: str | None = None
    is_done: bool = False  # set by the pipe's thread

    def run(self, pg):
        return pg.send([self.buf], 0, self.tag)

    def done(self, error: str | None) -> None:
        self.error, self.is_done = error, True


def _gather(cache: torch.Tensor, idx: torch.Tensor, wire: str) -> torch.Tensor:
    """Blocks idx of every layer, as the cache holds them or as int8 rows (a layer at a
    time: the quantize's temporaries stay a layer's size)."""
    if wire != "int8":
        return cache.index_select(2, idx)
    shape = (*cache.shape[:2], len(idx), *cache.shape[3:-1])
    out = torch.empty(*shape, kv_quant.row_size(cache.shape[-1], "int8"), dtype=torch.int8,
                      device=cache.device)  # fmt: skip
    for layer in range(cache.shape[0]):
        out[layer] = kv_quant.quantize(cache[layer].index_select(1, idx), torch.int8)
    return out


class DistWriter:
    name = "dist"
    is_stalled = True  # what is under way waits on the pipe's thread and the peer

    def __init__(self, store_addr: str, cache: torch.Tensor, send: Send):
        self.store_addr = store_addr
        self.src, self.send = cache, send
        self._platform = platform_for(cache.device)
        self.stream = self._platform.side_stream()
        # NOTE: an 8-bit cache's blocks already cross in 8 bits, as they are
        self.wire_dtypes = () if kv_quant.is_quantized(cache) else ("int8",)
        self._num_tags = 0
        self._sends: OrderedDict[str, _Send] = OrderedDict()
        self._pipe: Pipe | None = None
        self._new_pipe()

    def _new_pipe(self) -> None:
        """A new group under a new name (the decode node replaces our old one with it)."""
        if self._pipe is not None:
            self._pipe.close()
        host, _, port = self.store_addr.rpartition(":")
        self.group = uuid.uuid4().hex
        group, device = self.group, self.src.device

        def make():
            store = dist.TCPStore(
                host.strip("[]"), int(port), is_master=False, timeout=JOIN_TIMEOUT
            )
            return pair_group(store, group, 1, device)

        self._pipe = Pipe(make, f"with the decode node at {self.store_addr}")

    @torch.inference_mode()
    def write(
        self,
        request_id: str,
        reservation: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        within_s: float,
        wire: str = "same",
    ) -> int:
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_block_ids)} blocks for {len(dst_block_ids)} reserved")
        if wire not in ("same", *self.wire_dtypes):
            raise TransferError(f"cannot send this cache's KV as {wire}")
        if request_id in self._sends:
            raise TransferError(f"a second write of {request_id} under way")
        if self._pipe.error:
            error = self._pipe.error
            self._new_pipe()  # for the next write
            raise TransferError(error)
        idx = torch.tensor(src_block_ids, dtype=torch.int64)
        ready = None
        if self.stream is not None:
            self._platform.wait_for_current(self.stream)
            with self._platform.on_stream(self.stream):
                buf = _gather(self.src, idx.to(self.src.device, non_blocking=True), wire)
                ready = self._platform.event()
        else:
            buf = _gather(self.src, idx, wire)
        self._num_tags = (self._num_tags + 1) % 2**31
        self._sends[request_id] = _Send(
            request_id,
            reservation,
            self._num_tags,
            buf,
            ready,
            time.monotonic() + max(within_s, 0.0),
            wire == "int8",
        )
        return 1

    def poll(self) -> list[tuple[str, str | None]]:
        """Announce each gathered send, in order, and hand it to the group's thread; name
        the sends that completed, failed, were cancelled or ran past their deadline.
        NOTE: a send's buffer is its own, so its source blocks are free once it is gathered,
        even while the thread still waits on it."""
        ended, now = [], time.monotonic()
        is_blocked = False
        for rid, s in list(self._sends.items()):
            why = (
                "cancelled"
                if s.is_cancelled
                else s.error
                if s.is_done
                else "it did not complete before its reservation could end"
                if now > s.deadline
                else None
            )
            if why is None and not s.is_announced and not is_blocked:
                header = {"group": self.group, "tag": s.tag}
                if s.is_int8:
                    header["is_int8"] = True
                if (s.ready is not None and not s.ready.query()) or not self.send(
                    KVTransfer(rid, s.reservation, "dist", header, NO_DATA)
                ):
                    is_blocked = True  # in order: the later ones wait
                else:
                    s.is_announced = True
                    self._pipe.put(s)
            if why is None and not s.is_done:
                continue
            if s.ready is not None:
                s.ready.synchronize()
            if why is not None and s.is_announced and not s.is_done:
                # NOTE: the thread is stuck on it until the peer or the timeout comes: later
                # sends go on a new group.
                self._new_pipe()
            del self._sends[rid]
            ended.append((rid, why))
        return ended

    def cancel(self, request_id: str) -> None:
        s = self._sends.get(request_id)
        if s is not None:
            s.is_cancelled = True

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._pipe.close()
        self._sends.clear()


def _open_writer(
    descriptor: dict, welcome: KVWelcome, cache: torch.Tensor, send: Send
) -> DistWriter:
    return DistWriter(parse(DistDescriptor, descriptor, "dist").store, cache, send)


# NOTE: never offered by auto: its store and groups are not authenticated.
BACKEND = Backend("dist", lambda device: None, DistReceiver, _open_writer, is_auto=False)
