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
Process groups: gloo on CPU, nccl on CUDA, hccl on Ascend.

NOTE: the store and the group's connections are not authenticated (CURVE covers
only the ZeroMQ links), so dist is offered only when asked for by name, never
by `auto`; keep its ports on a trusted network.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Callable

import torch
import torch.distributed as dist

from common.base.log import get_logger
from common.engine.platform import platform_for, platform_type
from common.transfer.backend import NO_DATA, Backend, LocalCache, Send, parse
from common.transfer.copy import TransferError, copy_blocks
from common.wire.limits import Name, Range
from common.wire.protocol import KVTransfer, KVWelcome
from kernels import kv_quant

log = get_logger("transfer")
JOIN_TIMEOUT = timedelta(seconds=30)


@dataclass
class DistDescriptor:
    store: Name  # "host:port" of the TCPStore pairs meet at


@dataclass
class DistHeader:
    """The request's blocks follow as one send on the pair's process group `group` under `tag`."""

    group: Name
    tag: Annotated[int, Range(0, 2**31 - 1)]
    is_int8: bool = False  # the send is [.., D + 4] int8 rows: values and their scales


def _group(store: dist.Store, name: str, rank: int, device: torch.device):
    """The pair's group, of the kind the device's platform says (gloo, nccl, hccl)."""
    return platform_type(device).process_group(
        dist.PrefixStore(f"pdserve/{name}", store), rank, 2, JOIN_TIMEOUT
    )


class _Pipe:
    """A process group of two and a thread that joins it (joining blocks until the
    peer joins), then runs each queued operation to completion in order.

    NOTE: gloo marks a send or receive complete only in wait(), so waiting happens
    here, off the node loop; FIFO order on both sides pairs each send with its
    receive. An operation whose peer never comes blocks the thread until the
    group's timeout; the pipe is then broken (error) and is replaced, never reused."""

    def __init__(self, make: Callable[[], object], what: str):
        self.error: str | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(make, what), daemon=True, name="kv-dist"
        )
        self._thread.start()

    def put(self, op) -> None:
        """op.run(pg) -> Work; op.done(error) is called once it has completed or failed."""
        self._queue.put(op)

    def _run(self, make, what: str) -> None:
        try:
            pg = make()
        except Exception as e:  # what it was given fails below
            self.error = f"joining the KV process group {what} failed: {e}"
            log.error("%s", self.error)
            pg = None
        while (op := self._queue.get()) is not None:
            if self.error:
                op.done(self.error)
                continue
            try:
                op.run(pg).wait()
                op.done(None)
            except Exception as e:
                self.error = f"the KV process group {what} failed: {e}"
                log.error("%s", self.error)
                op.done(self.error)

    def close(self) -> None:
        self._queue.put(None)


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
        self._pipe: _Pipe | None = None
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
            return _group(store, group, 1, device)

        self._pipe = _Pipe(make, f"with the decode node at {self.store_addr}")

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
                buf = self.src.index_select(2, idx.to(self.src.device, non_blocking=True))
                buf = kv_quant.quantize(buf, torch.int8) if wire == "int8" else buf
                ready = self._platform.event()
        else:
            buf = self.src.index_select(2, idx)
            buf = kv_quant.quantize(buf, torch.int8) if wire == "int8" else buf
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


@dataclass
class _Recv:
    """One announced receive. Its buffer is made by the pipe's thread when it runs (so at
    most one per peer exists at a time, never one per announcement) and copied into the
    reserved blocks there, under the receiver's lock, unless its reservation ended."""

    receiver: "DistReceiver"
    request_id: str
    group: str
    tag: int
    dst_block_ids: list[int]
    is_int8: bool = False  # the buffer is int8 rows and scales, dequantized as it lands
    buf: torch.Tensor | None = None
    is_forgotten: bool = False
    is_done: bool = False
    error: str | None = None

    def run(self, pg):
        c = self.receiver.cache
        row, dtype = (c.shape[-1], c.dtype)
        if self.is_int8:
            row, dtype = kv_quant.row_size(c.shape[-1], "int8"), torch.int8
        self.buf = torch.empty(
            (c.shape[0], 2, len(self.dst_block_ids), *c.shape[3:-1], row),
            dtype=dtype,
            device=c.device,
        )
        return pg.recv([self.buf], 1, self.tag)

    def done(self, error: str | None) -> None:
        self.receiver.land(self, error)


class DistReceiver:
    """Decode side: the store prefill nodes meet at, the groups they made, and the
    receives into reserved blocks."""

    def __init__(self, cache: LocalCache):
        self.cache, host = cache.tensor, cache.host
        self.store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=JOIN_TIMEOUT
        )
        self.address = f"[{host}]:{self.store.port}" if ":" in host else f"{host}:{self.store.port}"
        self._groups: dict[
            str, tuple[bytes, _Pipe]
        ] = {}  # name -> (the peer that made it, its pipe)
        self._recvs: dict[str, _Recv] = {}  # NOTE: a _Recv says whether it is int8 rows
        self._lock = threading.Lock()  # the pipes' threads land while the loop may forget

    def describe(self) -> dict:
        return {"store": self.address}

    def progress(self) -> bool:
        return False

    def num_units(self, num_blocks: int) -> int:
        return 1

    def num_received(self, request_id: str) -> int:
        return int(request_id in self._recvs)

    def landing_error(self, request_id: str) -> str | None:
        r = self._recvs.get(request_id)
        return r.error if r is not None else None

    def is_lossy(self, request_id: str) -> bool:
        r = self._recvs.get(request_id)
        return r is not None and r.is_int8

    def receive(self, sender: bytes, msg: KVTransfer, dst_block_ids: list[int]) -> None:
        m = parse(DistHeader, msg.header, "dist header")
        if msg.request_id in self._recvs:
            raise TransferError(f"a second KV announcement for {msg.request_id}")
        if m.is_int8 and kv_quant.is_quantized(self.cache):
            raise TransferError(
                "int8 rows announced for an 8-bit cache (its pages cross as they are)"
            )
        owner, pipe = self._groups.get(m.group, (sender, None))
        if owner != sender:
            raise TransferError("that KV process group belongs to another prefill node")
        if pipe is None:
            # One group per prefill node: a new one from the same peer replaces the old
            # (joining threads stay bounded whatever a peer sends).
            for old in [g for g, (peer, _) in self._groups.items() if peer == sender]:
                self._groups.pop(old)[1].close()
            group, device = m.group, self.cache.device
            pipe = _Pipe(lambda: _group(self.store, group, 0, device), group[:8])
            self._groups[group] = (sender, pipe)
        r = self._recvs[msg.request_id] = _Recv(
            self, msg.request_id, m.group, m.tag, list(dst_block_ids), m.is_int8
        )
        pipe.put(r)  # NOTE: even if the request is dropped later, to keep the pairing in order

    def land(self, r: _Recv, error: str | None) -> None:
        """The pipe's thread: a receive ended."""
        with self._lock:
            if error is None and not r.is_forgotten:
                with torch.inference_mode():
                    buf = kv_quant.dequantize(r.buf, self.cache.dtype) if r.is_int8 else r.buf
                    copy_blocks(buf, list(range(len(r.dst_block_ids))), self.cache, r.dst_block_ids)
            r.buf, r.error, r.is_done = None, error, True

    def is_landed(self, request_id: str) -> bool:
        """False while its blocks are on the way; True once they are in the reserved
        blocks, or failed (landing_error), or it was never announced here."""
        r = self._recvs.get(request_id)
        if r is None or r.is_done:
            return True
        _, pipe = self._groups.get(r.group, (None, None))
        if pipe is None or pipe.error:  # replaced or broken: it never lands
            r.error = r.error or (pipe.error if pipe else "its KV process group was replaced")
            return True
        return False

    def forget(self, request_id: str) -> None:
        """Once this returns, nothing lands in its blocks."""
        with self._lock:
            r = self._recvs.pop(request_id, None)
            if r is not None:
                r.is_forgotten = True

    def close(self) -> None:
        for _, pipe in self._groups.values():
            pipe.close()
        self._recvs.clear()
        self._groups.clear()
        self.store = None


def _open_writer(
    descriptor: dict, welcome: KVWelcome, cache: torch.Tensor, send: Send
) -> DistWriter:
    return DistWriter(parse(DistDescriptor, descriptor, "dist").store, cache, send)


# NOTE: never offered by auto: its store and groups are not authenticated.
BACKEND = Backend("dist", lambda device: None, DistReceiver, _open_writer, is_auto=False)
