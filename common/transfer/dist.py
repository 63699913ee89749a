"""dist: torch.distributed point-to-point, one process group per prefill/decode pair.

The decode node runs a TCPStore (its address goes out in KVWelcome). A prefill
node that picks dist makes a group of two (decode rank 0, prefill rank 1) under
a name of its own and sends each request's blocks, gathered into one buffer
[layers, 2, n, block_size, kv_heads, head_dim], as one send under a tag it
announces in a KVDist message first. The decode node joins the group on the
first announcement (in a thread: joining waits for the peer), posts the matching
receive, and lands the buffer in the reserved blocks once it has arrived.
Process groups: gloo on CPU, nccl on CUDA, hccl on Ascend.

NOTE: the store and the group's connections are not authenticated (CURVE covers
only the ZeroMQ links), so dist is offered only when asked for by name, never
by `auto`; keep its ports on a trusted network.
"""
from __future__ import annotations

import queue
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Callable

import torch
import torch.distributed as dist

from common.base.log import get_logger
from common.engine.platform import platform_for
from common.transfer.backend import NO_DATA, Backend, LocalCache, Send, parse
from common.transfer.copy import TransferError, copy_blocks
from common.wire.codec import Name, Range
from common.wire.protocol import KVTransfer, KVWelcome

log = get_logger("transfer")
JOIN_TIMEOUT = timedelta(seconds=30)


@dataclass
class DistDescriptor:
    store: Name          # "host:port" of the TCPStore pairs meet at


@dataclass
class DistHeader:
    """The request's blocks follow as one send on the pair's process group `group` under `tag`."""
    group: Name
    tag: Annotated[int, Range(0, 2**31 - 1)]


def _group(store: dist.Store, name: str, rank: int, device: torch.device):
    prefixed = dist.PrefixStore(f"pdserve/{name}", store)
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(prefixed, rank, 2)
    if device.type == "npu":
        import torch_npu  # noqa: F401  (registers ProcessGroupHCCL)
        return torch.distributed.ProcessGroupHCCL(prefixed, rank, 2)
    return dist.ProcessGroupGloo(prefixed, rank, 2, JOIN_TIMEOUT)


class _Pipe:
    """A process group of two and a thread that joins it (joining blocks until the
    peer joins), then runs each queued operation to completion in order.

    NOTE: gloo marks a send or receive complete only in wait(), so waiting happens
    here, off the node loop; FIFO order on both sides pairs each send with its
    receive."""

    def __init__(self, make: Callable[[], object], what: str):
        self.error: str | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(make, what), daemon=True,
                                        name="kv-dist")
        self._thread.start()

    def put(self, op) -> None:
        """op(pg) -> Work; op.done is set once the work has completed."""
        self._queue.put(op)

    def _run(self, make, what: str) -> None:
        try:
            pg = make()
        except Exception as e:   # the requests that needed it fail by their lease
            self.error = f"joining the KV process group {what} failed: {e}"
            log.error("%s", self.error)
            return
        while (op := self._queue.get()) is not None:
            try:
                op.run(pg).wait()
                op.is_done = True
            except Exception as e:
                self.error = f"the KV process group {what} failed: {e}"
                log.error("%s", self.error)
                return

    def close(self) -> None:
        self._queue.put(None)


@dataclass
class _Send:
    request_id: str
    tag: int
    buf: torch.Tensor                   # the gathered blocks
    ready: object | None                # the gather is done (a platform event)
    is_announced: bool = False
    is_done: bool = False

    def run(self, pg):
        return pg.send([self.buf], 0, self.tag)


class DistWriter:
    name = "dist"

    def __init__(self, store_addr: str, cache: torch.Tensor, send: Send):
        host, _, port = store_addr.rpartition(":")
        self.src, self.send = cache, send
        self.group = uuid.uuid4().hex
        self._platform = platform_for(cache.device)
        self.stream = self._platform.side_stream()
        self._num_tags = 0
        self._sends: deque[_Send] = deque()

        def make():
            store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=JOIN_TIMEOUT)
            return _group(store, self.group, 1, cache.device)
        self._pipe = _Pipe(make, f"with the decode node at {store_addr}")

    @torch.inference_mode()
    def write(self, request_id: str, src_block_ids: list[int], dst_block_ids: list[int],
              within_s: float) -> None:
        # NOTE: within_s is not needed: a receive lands in a buffer of its own, copied into
        # the blocks only while they are still reserved.
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_block_ids)} blocks for {len(dst_block_ids)} reserved")
        if self._pipe.error:
            raise TransferError(self._pipe.error)
        idx = torch.tensor(src_block_ids, dtype=torch.int64)
        ready = None
        if self.stream is not None:
            self._platform.wait_for_current(self.stream)
            with self._platform.on_stream(self.stream):
                buf = self.src.index_select(2, idx.to(self.src.device, non_blocking=True))
                ready = self._platform.event()
        else:
            buf = self.src.index_select(2, idx)
        self._num_tags = (self._num_tags + 1) % 2**31
        self._sends.append(_Send(request_id, self._num_tags, buf, ready))

    def poll(self) -> list[tuple[str, str | None]]:
        """Announce each gathered send, in order, and hand it to the group's thread;
        name the sends completed since the last call."""
        for s in self._sends:
            if s.is_announced:
                continue
            if (s.ready is not None and not s.ready.query()) or \
                    not self.send(KVTransfer(s.request_id, "dist", {"group": self.group, "tag": s.tag},
                                             NO_DATA)):
                break
            s.is_announced = True
            self._pipe.put(s)
        done = []
        while self._sends and self._sends[0].is_done:
            done.append((self._sends.popleft().request_id, None))
        return done

    def cancel(self, request_id: str) -> None:
        pass   # NOTE: a send waits for its receive; nothing here can stop it sooner

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._pipe.close()
        self._sends.clear()


@dataclass
class _Recv:
    group: str
    tag: int
    dst_block_ids: list[int]
    buf: torch.Tensor
    is_done: bool = False

    def run(self, pg):
        return pg.recv([self.buf], 1, self.tag)


class DistReceiver:
    """Decode side: the store prefill nodes meet at, the groups they made, and the
    receives into reserved blocks."""

    def __init__(self, cache: LocalCache):
        self.cache, host = cache.tensor, cache.host
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=JOIN_TIMEOUT)
        self.address = f"[{host}]:{self.store.port}" if ":" in host else f"{host}:{self.store.port}"
        self._groups: dict[str, tuple[bytes, _Pipe]] = {}   # name -> (the peer that made it, its pipe)
        self._recvs: dict[str, _Recv] = {}
        self.failed: dict[str, str] = {}

    def describe(self) -> dict:
        return {"store": self.address}

    def progress(self) -> bool:
        return False

    def landing_error(self, request_id: str) -> str | None:
        return self.failed.get(request_id)

    def receive(self, sender: bytes, msg: KVTransfer, dst_block_ids: list[int]) -> None:
        m = parse(DistHeader, msg.header, "dist header")
        if msg.request_id in self._recvs:
            raise TransferError(f"a second KV announcement for {msg.request_id}")
        owner, pipe = self._groups.get(m.group, (sender, None))
        if owner != sender:
            raise TransferError("that KV process group belongs to another prefill node")
        if pipe is None:
            # One group per prefill node: a new one from the same peer replaces the old
            # (joining threads stay bounded whatever a peer sends).
            for old in [g for g, (peer, _) in self._groups.items() if peer == sender]:
                self._groups.pop(old)[1].close()
                for rid in [rid for rid, r in self._recvs.items() if r.group == old]:
                    self.failed[rid] = "its KV process group was replaced"
            group, device = m.group, self.cache.device
            pipe = _Pipe(lambda: _group(self.store, group, 0, device), group[:8])
            self._groups[group] = (sender, pipe)
        c = self.cache
        buf = torch.empty((c.shape[0], 2, len(dst_block_ids), *c.shape[3:]), dtype=c.dtype, device=c.device)
        r = self._recvs[msg.request_id] = _Recv(m.group, m.tag, list(dst_block_ids), buf)
        pipe.put(r)   # NOTE: even if the request is dropped later, to keep the pairing in order

    def is_landed(self, request_id: str) -> bool:
        """False while its blocks are on the way; True once they are in the reserved
        blocks (or it was never announced here)."""
        r = self._recvs.get(request_id)
        if r is None:
            return True
        _, pipe = self._groups.get(r.group, (None, None))
        error = self.failed.get(request_id) or (pipe.error if pipe else "its KV process group was replaced")
        if error:
            self.failed[request_id] = error
        elif not r.is_done:
            return False
        else:
            with torch.inference_mode():
                copy_blocks(r.buf, list(range(len(r.dst_block_ids))), self.cache, r.dst_block_ids)
        del self._recvs[request_id]
        return True

    def forget(self, request_id: str) -> None:
        # NOTE: a receive still under way lands in its own buffer, never in the cache.
        self._recvs.pop(request_id, None)
        self.failed.pop(request_id, None)

    def close(self) -> None:
        for _, pipe in self._groups.values():
            pipe.close()
        self._recvs.clear()
        self._groups.clear()
        self.store = None


def _open_writer(descriptor: dict, welcome: KVWelcome, cache: torch.Tensor, send: Send) -> DistWriter:
    return DistWriter(parse(DistDescriptor, descriptor, "dist").store, cache, send)


# NOTE: never offered by auto: its store and groups are not authenticated.
BACKEND = Backend("dist", lambda device: None, DistReceiver, _open_writer, is_auto=False)
