"""What a KV transfer backend is: one module in this package that defines BACKEND.

A backend has two halves. The decode node opens a receiver over its cache; the
receiver's descriptor (plain data, bytes allowed) travels to prefill nodes in
KVWelcome under the backend's name. A prefill node that picks the backend opens
a writer from that descriptor. Whatever else must cross the KV link goes as
KVTransfer messages under the backend's name, checked by the backend itself
(codec.parse into a dataclass of its own)."""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

import torch

from common.engine.platform import platform_for
from common.transfer.copy import TransferError
from common.wire import codec
from common.wire.protocol import KVTransfer, KVWelcome, ProtocolError
from kernels import kv_quant

Send = Callable[[KVTransfer], bool]  # on the KV link; False: not now (not connected, or full)
NO_DATA = torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class LocalCache:
    """A decode node's cache as its receivers see it."""

    tensor: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    host: str  # the address its KV link is reached at
    shm_name: str | None = None  # CPU: the shared-memory segment the cache lives in


class WholeWriter(Protocol):
    """Prefill side, one per decode node: a writer that starts a write whole, all its
    layers at once (a backend with no layer-wise form; WholeWrite gives it one)."""

    name: str
    is_stalled: bool  # every write under way waits on the peer (or a thread): no need to poll hard
    src: torch.Tensor  # this node's cache
    wire_dtypes: tuple[str, ...]  # as KVWriter's

    def write(
        self,
        request_id: str,
        reservation: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        within_s: float,
        wire: str = "same",
    ) -> int:
        """Start the write into the grant `reservation`; returns at once, with the units of
        it the receiver will count (KVCommit.num_written). Source blocks stay untouched
        until poll() names it. within_s: past this the write must be stopped, whatever the
        peer does (poll() then names it failed): the reservation may end soon after.
        wire: as KVWriter's."""

    def poll(self) -> list[tuple[str, str | None]]:
        """(request id, why it failed or None) for writes that ended since the last call."""

    def cancel(self, request_id: str) -> None:
        """Its handoff is over: stop the write if it can be stopped (a network write to a
        peer gone silent); poll() names it ended either way, and its source blocks are
        free from then on."""

    def close(self) -> None: ...


class KVWriter(abc.ABC):
    """Prefill side, one per decode node: writes local blocks into reserved remote ones,
    whole (write(), as WholeWriter's) or layer by layer as the forward pass computes them.

    Layer-wise: begin() takes what write() takes; write_layers(rid, a, b, blocks) says
    layers [a, b) of its blocks `blocks` (a range of indices into its block list; None:
    all) are queued on the device (a chunked prompt's pass computes some of its blocks);
    end(rid) that no more will come, and returns what write() returns. Every (layer,
    block) is written once. poll() names it ended only after end(). renew(rid, within_s):
    its reservation was renewed while it spans passes, the new bound replaces begin()'s.
    A whole write is the same: begun, every layer at once, ended.

    wire: the format its KV crosses in, "same" (the cache's) or one of wire_dtypes
    (common/base/kv_wire.py); a writer is asked only for those it names."""

    name: ClassVar[str]
    wire_dtypes: tuple[str, ...] = ()  # formats other than the cache's it can send
    is_layerwise: ClassVar[bool]  # it writes layers as they come (WholeWrite's: False)
    is_stalled: bool  # every write under way waits on the peer (or a thread): no need to poll hard
    src: torch.Tensor  # this node's cache [layers, 2, blocks, block_size, kv_heads, head_dim]

    def write(
        self,
        request_id: str,
        reservation: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        within_s: float,
        wire: str = "same",
    ) -> int:
        """As WholeWriter.write: begun, every layer queued, ended."""
        self.begin(request_id, reservation, src_block_ids, dst_block_ids, within_s, wire)
        try:
            self.write_layers(request_id, 0, self.src.shape[0])
        except TransferError:  # stopped part-way: not started, as far as the caller knows
            self.drop_begun(request_id)
            raise
        return self.end(request_id)

    def drop_begun(self, request_id: str) -> None:
        """write() could not queue every layer of a write it began: forget it. NOTE: only a
        writer whose write_layers can raise TransferError has anything to forget."""

    def wire_bytes(self, num_blocks: int) -> int:
        """What a write of num_blocks blocks puts on the link as int8."""
        return int8_wire_bytes(self.src, num_blocks)

    def round_trip_bytes_per_s(self) -> float:
        """Bytes/s (of the cache's dtype) this node quantizes and dequantizes KV at,
        measured on first call (a few milliseconds)."""
        if not getattr(self, "_round_trip_rate", 0.0):
            self._round_trip_rate = round_trip_rate(self.src)
        return self._round_trip_rate

    @abc.abstractmethod
    def begin(
        self,
        request_id: str,
        reservation: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        within_s: float,
        wire: str = "same",
    ) -> None: ...

    @abc.abstractmethod
    def write_layers(
        self, request_id: str, first_layer: int, end_layer: int, blocks: range | None = None
    ) -> None: ...

    @abc.abstractmethod
    def end(self, request_id: str) -> int: ...

    @abc.abstractmethod
    def renew(self, request_id: str, within_s: float) -> None: ...

    @abc.abstractmethod
    def flush(self) -> None:
        """Move what can move now (send what is ready) without ending anything: called
        during a pass, where no handoff may end."""

    @abc.abstractmethod
    def poll(self) -> list[tuple[str, str | None]]:
        """(request id, why it failed or None) for writes that ended since the last call."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        """As WholeWriter.cancel."""

    @abc.abstractmethod
    def close(self) -> None: ...


class KVReceiver(Protocol):
    """Decode side: one per accepted backend."""

    def describe(self) -> dict:
        """This backend's descriptor in KVWelcome."""

    def receive(self, sender: bytes, msg: KVTransfer, dst_block_ids: list[int]) -> None:
        """A KVTransfer for a reservation of `sender`'s; TransferError if it does not fit."""

    def num_units(self, num_blocks: int) -> int:
        """The units a whole write of num_blocks blocks is (what a commit must say it wrote)."""

    def num_received(self, request_id: str) -> int:
        """The units of the request's write that arrived (since its last forget)."""

    def progress(self) -> bool:
        """Drive transfers this process must drive; True while one is under way."""

    def is_landed(self, request_id: str) -> bool:
        """Everything announced for the request is in its blocks (True if nothing was)."""

    def landing_error(self, request_id: str) -> str | None: ...

    def is_lossy(self, request_id: str) -> bool:
        """Some of the request's KV arrived as int8 rows (--kv-wire-dtype): its blocks hold
        them dequantized, not the prefill node's exact values."""

    def forget(self, request_id: str) -> None:
        """Its blocks go back to the pool: return once nothing of ours can still write them."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class Backend:
    name: str
    why_unusable: Callable[[torch.device], str | None]  # None: this process can use it there
    open_receiver: Callable[[LocalCache], KVReceiver]
    # (its descriptor, their welcome, our cache, send) -> a writer
    open_writer: Callable[[dict, KVWelcome, torch.Tensor, Send], KVWriter | WholeWriter]
    is_auto: bool = True  # auto may offer it
    # NOTE: a one-sided write lands without the decode node taking part, so it cannot
    # refuse a late one: a reservation it may write into is freed only at its lease's end.
    is_one_sided: bool = False
    is_auto_across_hosts_only: bool = False  # auto offers it only on a KV link other hosts reach
    # (our device, their welcome, whether they share our host) -> why not with that decode node
    why_not_with: Callable[[torch.device, KVWelcome, bool], str | None] = (
        lambda device, welcome, is_local: None
    )
    needs_shared_cache: Callable[[torch.device], bool] = lambda device: False
    is_layerwise: bool = False  # its writer has a layer-wise form (else WholeWrite gives one)
    # Its KVTransfers carry the KV itself: they travel on the KV link's data connection, apart
    # from control, so a commit can arrive before the last of them (and waits for them).
    is_kv_apart: bool = False


def why_not_same_kind(device: torch.device, welcome: KVWelcome) -> str | None:
    """For backends that move memory of one kind only (cpu to cpu, cuda to cuda)."""
    # NOTE: not torch.device(): the name comes off the wire, and a malformed one must only refuse.
    theirs = welcome.device.split(":")[0]
    return (
        None
        if theirs == device.type
        else f"its cache is on {welcome.device}, this node's on {device.type}"
    )


class UnusableBackend(TransferError, ValueError):
    """A --kv-transfer this process cannot use: a bad option (said in one line at start)."""


def parse(cls, fields, where: str):
    """A backend's descriptor or KVTransfer header -> its dataclass; TransferError if malformed."""
    try:
        return codec.parse(cls, fields, where)
    except ProtocolError as e:
        raise TransferError(str(e)) from None


class WholeWrite(KVWriter):
    """The layer-wise form for a writer that has none: begin() remembers the write and end()
    starts it whole; whole writes, polls and closes are the inner writer's."""

    is_layerwise = False

    def __init__(self, writer: WholeWriter):
        self.inner, self.name = writer, writer.name
        self.src, self.wire_dtypes = writer.src, writer.wire_dtypes
        self._begun: dict[str, tuple] = {}
        self._dropped: list[tuple[str, str | None]] = []  # cancelled before end()

    @property
    def is_stalled(self) -> bool:
        return self.inner.is_stalled

    def write(
        self,
        request_id: str,
        reservation: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        within_s: float,
        wire: str = "same",
    ) -> int:
        return self.inner.write(
            request_id, reservation, src_block_ids, dst_block_ids, within_s, wire
        )

    def begin(
        self,
        request_id: str,
        reservation: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        within_s: float,
        wire: str = "same",
    ) -> None:
        self._begun[request_id] = (
            reservation,
            src_block_ids,
            dst_block_ids,
            time.monotonic() + within_s,
            wire,
        )

    def write_layers(
        self, request_id: str, first_layer: int, end_layer: int, blocks: range | None = None
    ) -> None:
        pass

    def renew(self, request_id: str, within_s: float) -> None:
        if request_id in self._begun:
            reservation, src, dst, _, wire = self._begun[request_id]
            self._begun[request_id] = (reservation, src, dst, time.monotonic() + within_s, wire)

    def end(self, request_id: str) -> int:
        reservation, src, dst, deadline, wire = self._begun.pop(request_id)
        try:
            return self.inner.write(
                request_id, reservation, src, dst, deadline - time.monotonic(), wire
            )
        except TransferError as e:
            # NOTE: begun, its handoff waits for poll() to name it ended (and free its blocks)
            self._dropped.append((request_id, str(e)))
            raise

    def flush(self) -> None:
        pass

    def poll(self) -> list[tuple[str, str | None]]:
        ended, self._dropped = self._dropped, []
        return ended + self.inner.poll()

    def cancel(self, request_id: str) -> None:
        if self._begun.pop(request_id, None) is not None:
            self._dropped.append((request_id, "cancelled"))
        else:
            self.inner.cancel(request_id)

    def close(self) -> None:
        self.inner.close()


def int8_wire_bytes(cache: torch.Tensor, num_blocks: int) -> int:
    """What num_blocks blocks of a cache in the model's dtype are as int8 rows: a byte a
    value and each (token, head) row's 4-byte scale (kernels/kv_quant.py)."""
    rows = cache[:, :, :1, ..., :1].numel()  # (token, head) rows of a block, every layer
    return num_blocks * rows * (cache.shape[-1] + kv_quant.SCALE_BYTES)


def round_trip_rate(cache: torch.Tensor) -> float:
    """Bytes/s at which this process quantizes a cache's rows to int8 and back, over
    PROBE_BYTES of rows like the cache's (a writer quantizes a frame of about that)."""
    sync = platform_for(cache.device).synchronize
    return kv_quant.round_trip_rate(cache[0, 0, :1], sync, PROBE_BYTES)


PROBE_BYTES = 2**20  # tcp's frames aim at this size
