"""KV transfer: how a prefill node's KV blocks reach a decode node's reserved blocks.
Imports base, kv, wire and engine (its device platform).

A handoff is reserve -> write -> commit. The decode node reserves destination
blocks, the prefill node writes its blocks into them through a KVWriter, and
the commit makes the request runnable on the decode node without a copy. Node
code calls only what this module exports; it never names a backend.

    prefill node                                  decode node
    open_writer(requested, welcome, cache, send)  KVSink(cache, offered(requested, ...))
    writer.write(rid, grant, src, dst, within_s)  sink.welcome(epoch) -> KVWelcome
      or begin(...), write_layers(rid, a, b), end(rid): layer by layer, during the pass
      -> units the commit says it wrote           sink.receive(sender, KVTransfer, dst_ids)
    writer.poll() -> [(rid, error or None)]       sink.why_incomplete(backend, rid, n, units)
    writer.cancel(rid) / close()                  sink.progress() / is_landed(rid) / forget(rid)

Backends (backend.py says what one is; each is common/transfer/<name>.py, listed
best first in KV_BACKENDS):
    ipc  one host: the decode node's cache is mapped into the prefill process once
         (CUDA IPC handle; a shared-memory segment on CPU) and written device to device.
    nixl anywhere: NIXL (UCX) writes the blocks from the prefill node's registered cache
         straight into the reserved ones; agent metadata travels on the keyed KV link.
    tcp  anywhere: blocks travel as raw frames on the KV link, gathered on a side
         stream into pinned memory and written on arrival into the reserved blocks.
    dist torch.distributed point-to-point (gloo on CPU, nccl on CUDA, hccl on Ascend),
         one process group per prefill/decode pair, joined on first contact; only
         when asked for by name (its connections are not authenticated).
"""

from __future__ import annotations

import functools
import importlib

import torch

from common.base.config import KV_BACKENDS, KV_TRANSFERS
from common.base.log import get_logger
from common.engine.kv_cache import describe_dtype, is_quantized_dtype
from common.transfer.backend import (
    Backend,
    KVReceiver,
    KVWriter,
    LocalCache,
    Send,
    UnusableBackend,
    WholeWrite,
)
from common.transfer.copy import TransferError, block_checksums, copy_blocks, host_id
from common.wire.protocol import KVTransfer, KVWelcome, dtype_name

__all__ = [
    "KVSink",
    "KVWriter",
    "LocalCache",
    "Send",
    "TransferError",
    "UnusableBackend",
    "WholeWrite",
    "availability",
    "backend",
    "block_checksums",
    "check_layout",
    "check_usable",
    "choose_backend",
    "copy_blocks",
    "host_id",
    "needs_shared_cache",
    "offered",
    "open_writer",
]

log = get_logger("transfer")


@functools.lru_cache(maxsize=None)
def backend(name: str) -> Backend:
    if name not in KV_BACKENDS:
        raise TransferError(f"no KV transfer backend {name!r}: there are {', '.join(KV_BACKENDS)}")
    return importlib.import_module(f"common.transfer.{name}").BACKEND


def availability(device: torch.device = torch.device("cpu")) -> str:
    """One line for --help: which backends this process can use."""
    why = {name: backend(name).why_unusable(device) for name in KV_BACKENDS}
    usable = [n for n, w in why.items() if w is None]
    return f"usable here ({device.type}): {', '.join(usable) or 'none'}" + "".join(
        f"; {n}: {w}" for n, w in why.items() if w is not None
    )


def _check(requested: str) -> None:
    if requested not in KV_TRANSFERS:
        raise TransferError(f"kv transfer must be one of {KV_TRANSFERS}, got {requested!r}")


def check_usable(requested: str, device: torch.device) -> None:
    """UnusableBackend (a TransferError and a ValueError, so a node's start says it in one
    line) unless a process on `device` can use the backend asked for (auto: always)."""
    _check(requested)
    why = None if requested == "auto" else backend(requested).why_unusable(device)
    if why:
        raise UnusableBackend(f"cannot use the {requested} KV transfer here: {why}")


def offered(requested: str, device: torch.device, is_reachable_remotely: bool) -> list[str]:
    """What a decode node on `device` offers its prefill nodes, best first.
    is_reachable_remotely: its KV link listens where other hosts can reach it."""
    _check(requested)
    if requested != "auto":
        why = backend(requested).why_unusable(device)
        if why:
            raise TransferError(f"cannot offer the {requested} KV transfer: {why}")
        return [requested]
    names = []
    for name in KV_BACKENDS:
        b = backend(name)
        if not b.is_auto or (b.is_auto_across_hosts_only and not is_reachable_remotely):
            continue
        why = b.why_unusable(device)
        if why:
            log.info("the %s KV transfer is not offered: %s", name, why)
        else:
            names.append(name)
    return names


def needs_shared_cache(
    requested: str, device: torch.device, is_reachable_remotely: bool = False
) -> bool:
    """Whether a decode node's cache must be allocated where other processes can map it."""
    return any(
        backend(n).needs_shared_cache(device)
        for n in offered(requested, device, is_reachable_remotely)
    )


def choose_backend(requested: str, welcome: KVWelcome, device: torch.device) -> str:
    """The backend a prefill node on `device` uses for the decode node that sent `welcome`."""
    _check(requested)
    is_local = welcome.host_id == host_id()
    theirs = [n for n in welcome.backends if n in KV_BACKENDS]

    def why_not(name: str) -> str | None:
        b = backend(name)
        if name not in theirs:
            return f"it accepts {', '.join(theirs) or 'none'}"
        return b.why_unusable(device) or b.why_not_with(device, welcome, is_local)

    if requested != "auto":
        why = why_not(requested)
        if why:
            raise TransferError(
                f"cannot use the {requested} KV transfer with this decode node: {why}"
            )
        return requested
    usable = [n for n in KV_BACKENDS if backend(n).is_auto and why_not(n) is None]
    if not usable:
        raise TransferError(
            f"no KV transfer in common: the decode node accepts {', '.join(theirs) or 'none'}"
        )
    return usable[0]


def check_layout(welcome: KVWelcome, cache: torch.Tensor) -> None:
    """The decode node's cache must match ours block for block: same layers, block size,
    heads, head size and dtype."""
    theirs = list(welcome.cache_shape)
    ours = list(cache.shape)
    our_dtype = dtype_name(cache.dtype)
    is_quantized = is_quantized_dtype(welcome.dtype) or is_quantized_dtype(our_dtype)
    if welcome.dtype != our_dtype and is_quantized:
        # NOTE: never landed and read in another format: 8-bit rows misread are noise
        raise TransferError(
            f"the decode node keeps its KV cache in {describe_dtype(welcome.dtype)}, this "
            f"node in {describe_dtype(our_dtype)}: nodes that hand KV over keep it alike "
            "(start both with the same --kv-cache-dtype)"
        )
    if (
        len(theirs) != 6
        or theirs[:2] + theirs[3:] != ours[:2] + ours[3:]
        or welcome.dtype != our_dtype
    ):
        raise TransferError(
            f"the decode node's KV cache {theirs} {welcome.dtype} does not match this "
            f"node's {ours} {our_dtype} (outside the block count)"
        )


def open_writer(requested: str, welcome: KVWelcome, cache: torch.Tensor, send: Send) -> KVWriter:
    """A writer into the decode node that sent `welcome`; TransferError says why not."""
    check_layout(welcome, cache)
    name = choose_backend(requested, welcome, cache.device)
    b = backend(name)
    writer = b.open_writer(welcome.backends[name], welcome, cache, send)
    return writer if b.is_layerwise else WholeWrite(writer)


class KVSink:
    """Decode side: one receiver per offered backend, each describing the cache to
    prefill nodes and landing what its writers send."""

    def __init__(self, cache: LocalCache, accepted: list[str], is_layerwise: bool = True):
        """is_layerwise: prefill nodes may push a write's layers as they compute them."""
        self.cache, self.is_layerwise = cache.tensor, is_layerwise
        self.accepted = list(accepted)
        self.receivers: dict[str, KVReceiver] = {}
        try:
            for name in accepted:
                self.receivers[name] = backend(name).open_receiver(cache)
        except Exception:
            self.close()
            raise

    def welcome(self, epoch: str) -> KVWelcome:
        c = self.cache
        return KVWelcome(
            epoch,
            host_id(),
            str(c.device),
            list(c.shape),
            dtype_name(c.dtype),
            {name: r.describe() for name, r in self.receivers.items()},
            self.is_layerwise,
        )

    def _receiver(self, name: str) -> KVReceiver:
        r = self.receivers.get(name)
        if r is None:
            raise TransferError(
                f"this decode node does not accept {name[:32]!r} KV transfers "
                f"(it accepts {', '.join(self.accepted)})"
            )
        return r

    def receive(self, sender: bytes, msg: KVTransfer, dst_block_ids: list[int]) -> None:
        """TransferError if the backend is not accepted here or the message does not fit."""
        self._receiver(msg.backend).receive(sender, msg, dst_block_ids)

    def why_incomplete(
        self, backend_name: str, request_id: str, num_blocks: int, num_written: int
    ) -> str | None:
        """Why a commit that says num_written units of a backend's write must be refused:
        less than a whole write, or not all of it arrived."""
        try:
            r = self._receiver(backend_name)
        except TransferError as e:
            return str(e)
        whole, arrived = r.num_units(num_blocks), r.num_received(request_id)
        if num_written != whole or arrived != whole:
            return (
                f"its KV did not all arrive: a whole {backend_name} write of {num_blocks} "
                f"blocks is {whole} units, the commit says {num_written}, {arrived} arrived"
            )
        return None

    def is_arriving(
        self, backend_name: str, request_id: str, num_blocks: int, num_written: int
    ) -> bool:
        """A commit for a whole write came before all of its KV, which travels apart from
        commits with this backend: the rest may still be on the way."""
        r = self.receivers.get(backend_name)
        return (
            r is not None
            and backend(backend_name).is_kv_apart
            and num_written == r.num_units(num_blocks) > r.num_received(request_id)
        )

    def checksums(self, block_ids: list[int]) -> list[int]:
        """--kv-verify: the checksums of these blocks of the cache as they are now."""
        return block_checksums(self.cache, block_ids).tolist()

    def why_unverified(self, block_ids: list[int], checksums: list[int]) -> str | None:
        """--kv-verify: why these blocks do not hold what the prefill node wrote, if they do not."""
        got = self.checksums(block_ids)
        bad = [i for i, (a, b) in enumerate(zip(got, checksums)) if a != b]
        if not bad:
            return None
        return (
            f"its KV does not hold what the prefill node wrote (--kv-verify: {len(bad)} of "
            f"{len(got)} blocks differ, the first at block {bad[0]})"
        )

    @staticmethod
    def is_one_sided(backend_name: str) -> bool:
        """Whether that backend's writes land without this node taking part."""
        return backend_name not in KV_BACKENDS or backend(backend_name).is_one_sided

    def progress(self) -> bool:
        """True while a transfer this process drives is under way (the loop must not sleep)."""
        return any([r.progress() for r in self.receivers.values()])  # NOTE: a list: every one moves

    def is_landed(self, request_id: str) -> bool:
        return all(r.is_landed(request_id) for r in self.receivers.values())

    def landing_error(self, request_id: str) -> str | None:
        """Why a landed request's KV is not usable, if it is not."""
        return next(
            (e for r in self.receivers.values() if (e := r.landing_error(request_id))), None
        )

    def is_lossy(self, request_id: str) -> bool:
        """Its KV landed from int8 rows: not the exact values (not for a prefix cache)."""
        return any(r.is_lossy(request_id) for r in self.receivers.values())

    def forget(self, request_id: str) -> None:
        for r in self.receivers.values():
            r.forget(request_id)

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()
        self.receivers.clear()
        self.cache = None
