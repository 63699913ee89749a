"""KV transfer: how a prefill node's KV blocks reach a decode node's reserved blocks.
Imports base, kv, wire and engine (its device platform).

A handoff is reserve -> write -> commit. The decode node reserves destination
blocks, the prefill node writes its blocks into them through a KVWriter, and
the commit makes the request runnable on the decode node without a copy. Node
code calls only what this module exports; it never names a backend.

    prefill node                                  decode node
    open_writer(requested, welcome, cache, send)  KVSink(cache, shm_name, accepted)
    writer.write(rid, src_ids, dst_ids)           sink.welcome(epoch) -> KVWelcome
    writer.poll() -> rids whose write is done     sink.receive(sender, msg, dst_ids)  (tcp, dist)
    writer.close()                                sink.is_landed(rid) / landing_error(rid)
                                                  sink.forget(rid)

Backends:
    ipc  one host: the decode node's cache is mapped into the prefill process once
         (CUDA IPC handle; a shared-memory segment on CPU) and written device to device.
    tcp  anywhere: blocks travel as raw frames on the KV link, gathered on a side
         stream into pinned memory and written on arrival into the reserved blocks.
    dist torch.distributed point-to-point (gloo on CPU, nccl on CUDA, hccl on Ascend),
         one process group per prefill/decode pair, joined on first contact; only
         when asked for by name (its connections are not authenticated).
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from common.base.config import KV_TRANSFERS
from common.wire.protocol import KVBlocks, KVDist, KVWelcome, dtype_name
from common.transfer import dist, ipc, tcp
from common.transfer.copy import TransferError, copy_blocks, host_id  # noqa: F401

CHOICES = KV_TRANSFERS               # what --kv-transfer takes
BACKENDS = tuple(c for c in CHOICES if c != "auto")


class KVWriter(Protocol):
    """Prefill side, one per decode node: writes local blocks into reserved remote ones."""
    name: str

    def write(self, request_id: str, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Start the write; returns at once. Source blocks stay untouched until poll() names it."""

    def poll(self) -> list[str]:
        """Request ids whose write has completed since the last call."""

    def close(self) -> None: ...


def accepted_backends(requested: str, device: torch.device) -> list[str]:
    """What a decode node offers its prefill nodes, best first."""
    if requested not in CHOICES:
        raise ValueError(f"kv transfer must be one of {CHOICES}, got {requested!r}")
    # NOTE: auto never offers dist: its store and groups are not authenticated.
    offered = [b for b in BACKENDS if requested == b or (requested == "auto" and b != "dist")]
    return [b for b in offered if b != "ipc" or ipc.is_supported(device)]


def choose_backend(requested: str, welcome: KVWelcome, device: torch.device) -> str:
    """The backend a prefill node on `device` uses for the decode node that sent `welcome`."""
    if requested not in CHOICES:
        raise TransferError(f"kv transfer must be one of {CHOICES}, got {requested!r}")
    is_local = welcome.host_id == host_id()
    usable = [b for b in welcome.backends if b in BACKENDS and
              (b != "ipc" or (is_local and ipc.can_write(device, torch.device(welcome.device))))]
    if requested != "auto":
        if requested not in usable:
            why = "it is on another host" if requested == "ipc" and not is_local else \
                f"it accepts {welcome.backends}"
            raise TransferError(f"cannot use the {requested} KV transfer with this decode node: {why}")
        return requested
    if not usable:
        raise TransferError(f"no KV transfer in common: the decode node accepts {welcome.backends}")
    return usable[0]


def check_layout(welcome: KVWelcome, cache: torch.Tensor) -> None:
    """The decode node's cache must match ours block for block: same layers, block size,
    heads, head size and dtype."""
    theirs = list(welcome.cache_shape)
    ours = list(cache.shape)
    our_dtype = dtype_name(cache.dtype)
    if len(theirs) != 6 or theirs[:2] + theirs[3:] != ours[:2] + ours[3:] or welcome.dtype != our_dtype:
        raise TransferError(f"the decode node's KV cache {theirs} {welcome.dtype} does not match this "
                            f"node's {ours} {our_dtype} (outside the block count)")


def open_writer(requested: str, welcome: KVWelcome, cache: torch.Tensor,
                send: Callable[[KVBlocks | KVDist], bool]) -> KVWriter:
    """A writer into the decode node that sent `welcome`; TransferError says why not."""
    check_layout(welcome, cache)
    backend = choose_backend(requested, welcome, cache.device)
    if backend == "ipc":
        return ipc.IpcWriter(welcome, cache)
    if backend == "dist":
        if not welcome.dist_store:
            raise TransferError("the decode node offers dist but names no store")
        return dist.DistWriter(welcome.dist_store, cache, send)
    return tcp.TcpWriter(cache, send)


class KVSink:
    """Decode side: describes the cache to prefill nodes and lands tcp frames and dist
    receives in it. host: the KV link's address (dist's store listens there)."""

    def __init__(self, cache: torch.Tensor, shm_name: str | None, accepted: list[str], host: str):
        self.cache = cache
        self.shm_name = shm_name
        self.accepted = accepted
        self.tcp = tcp.TcpReceiver(cache)
        self.dist = dist.DistReceiver(cache, host) if "dist" in accepted else None

    def welcome(self, epoch: str) -> KVWelcome:
        c = self.cache
        return KVWelcome(epoch, host_id(), str(c.device), list(c.shape),
                         dtype_name(c.dtype), list(self.accepted),
                         shm_name=self.shm_name if "ipc" in self.accepted else None,
                         cuda_ipc=ipc.share(c) if "ipc" in self.accepted and c.is_cuda else None,
                         dist_store=self.dist.address if self.dist is not None else None)

    def receive(self, sender: bytes, msg: KVBlocks | KVDist, dst_block_ids: list[int]) -> None:
        """A tcp frame (written into dst_block_ids) or a dist announcement (its receive
        posted); TransferError if it does not fit or is not accepted here."""
        if isinstance(msg, KVDist):
            if self.dist is None:
                raise TransferError("this decode node does not accept dist KV transfers")
            self.dist.receive(sender, msg, dst_block_ids)
            return
        if "tcp" not in self.accepted:
            raise TransferError("this decode node does not accept tcp KV frames")
        self.tcp.receive(msg, dst_block_ids)

    def is_landed(self, request_id: str) -> bool:
        """Every frame or receive for the request is in the cache."""
        return self.tcp.is_landed(request_id) and (self.dist is None or self.dist.is_landed(request_id))

    def landing_error(self, request_id: str) -> str | None:
        """Why a landed request's KV is not usable, if it is not."""
        return self.tcp.failed.get(request_id) or (self.dist.failed.get(request_id) if self.dist else None)

    def forget(self, request_id: str) -> None:
        self.tcp.forget(request_id)
        if self.dist is not None:
            self.dist.forget(request_id)

    def close(self) -> None:
        self.tcp.forget_all()
        if self.dist is not None:
            self.dist.close()
        self.cache = None
