"""dist's decode side (the backend is common/transfer/dist.py): the store prefill nodes
meet at, the groups they made, and each announced receive, landed in its reserved
blocks from the group's thread."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.transfer.backend import LocalCache, parse
from common.transfer.copy import TransferError, copy_blocks
from common.transfer.dist_pipe import JOIN_TIMEOUT, DistHeader, Pipe, pair_group
from common.wire.protocol import KVTransfer
from kernels import kv_quant


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
        # NOTE: zeros: a peer that sends fewer bytes than it announced (gloo lets it) must
        # leave nothing of another request's memory in its blocks
        self.buf = torch.zeros(
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
            str, tuple[bytes, Pipe]
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
        # NOTE: refused before its receive is posted: a receive sized for this cache would
        # not match what an honest writer sends, and a mismatch aborts gloo. The peer's
        # later sends wait until their deadline and move to a new group.
        owner, pipe = self._groups.get(m.group, (sender, None))
        if owner != sender:
            raise TransferError("that KV process group belongs to another prefill node")
        if pipe is None:
            # One group per prefill node: a new one from the same peer replaces the old
            # (joining threads stay bounded whatever a peer sends).
            for old in [g for g, (peer, _) in self._groups.items() if peer == sender]:
                self._groups.pop(old)[1].close()
            group, device = m.group, self.cache.device
            pipe = Pipe(lambda: pair_group(self.store, group, 0, device), group[:8])
            self._groups[group] = (sender, pipe)
        r = self._recvs[msg.request_id] = _Recv(
            self, msg.request_id, m.group, m.tag, list(dst_block_ids), m.is_int8
        )
        pipe.put(r)  # NOTE: even if the request is dropped later, to keep the pairing in order

    def land(self, r: _Recv, error: str | None) -> None:
        """The pipe's thread: a receive ended. int8 rows are dequantized first, a layer at a
        time and outside the lock (the decode loop's forget() waits on it)."""
        buf = r.buf
        if error is None and r.is_int8 and not r.is_forgotten:
            with torch.inference_mode():
                dense = torch.empty(*buf.shape[:-1], self.cache.shape[-1], dtype=self.cache.dtype,
                                    device=buf.device)  # fmt: skip
                for layer in range(buf.shape[0]):
                    dense[layer] = kv_quant.dequantize(buf[layer], self.cache.dtype)
                buf = dense
        with self._lock:
            if error is None and not r.is_forgotten:
                with torch.inference_mode():
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
