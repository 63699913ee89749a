"""nixl: anywhere. NIXL (its UCX backend) writes a request's blocks from the prefill
node's cache straight into the decode node's reserved blocks (one-sided WRITE, CPU
or CUDA memory), and a notification naming the request follows the data.

Each side registers its whole cache once with an agent of its own. The decode
node's agent metadata (how to reach it and the keys of its registered memory)
and its cache's address travel in KVWelcome, on the KV link, which CURVE
authenticates: only a holder of a node key learns how to write this cache. A
writer announces each write with a KVTransfer naming its agent, so the decode
node waits for that agent's notification before the request may run.

NOTE: neither agent runs NIXL's progress thread, which spins a core (2 s of CPU
in 2 s idle, measured). The loops drive progress: the prefill node polls while a
write is under way, and the decode node does not sleep while one is announced.
NOTE: a one-sided write that is late could land in blocks given to another
request. A write still under way when its reservation may end (within_s), or
when its handoff ends (cancel: the request was aborted or moved, say to a peer
gone silent), is stopped by dropping the connection to that agent (UCX cancels
what it holds), and its source blocks are free again;
the decode node's lease keeps a third of its length after the last write may
start (lease.py).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from common.base.log import get_logger
from common.engine.platform import platform_for, platform_type
from common.kv.blocks import num_cache_blocks
from common.transfer.backend import (
    NO_DATA,
    Backend,
    KVWriter,
    LocalCache,
    Send,
    parse,
    why_not_same_kind,
)
from common.transfer.copy import TransferError, runs
from common.transfer.nixl_receiver import NixlReceiver
from common.wire.limits import Name
from common.wire.protocol import KVTransfer, KVWelcome

log = get_logger("transfer")


@dataclass
class NixlDescriptor:
    agent: Name
    metadata: bytes  # the decode agent's: its UCX addresses and the remote keys of its cache
    address: int  # where its cache starts
    device_id: int


@functools.lru_cache(maxsize=1)
def _module():
    """NIXL's Python module, or why not."""
    # NOTE: UCX's cma transport aborts the process (an arbiter assertion) when an agent
    # that wrote to a peer that died is destroyed (UCX bundled with nixl-cu12 1.5.1);
    # without cma the write fails the same way and the agent closes. Set before any
    # agent exists; a UCX_TLS given by the user stands.
    os.environ.setdefault("UCX_TLS", "^cma")
    try:
        module = importlib.import_module("nixl_cu12")
    except Exception as e:  # ImportError, or a bundled library that does not load here
        return (
            None,
            f"cannot import nixl_cu12 ({type(e).__name__}: {str(e)[:160]}; pip install nixl-cu12)",
        )
    # NOTE: NIXL logs to stdout by default, where launchers print their ready lines;
    # its warnings go to our log (stderr) instead.
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):
        nixl_log.removeHandler(handler)
    nixl_log.setLevel(logging.WARNING)
    nixl_log.propagate = True
    return module, None


def why_unusable(device: torch.device) -> str | None:
    if platform_type(device).nixl_memory is None:
        return f"NIXL's UCX backend has no {device.type} memory (tcp stages through host memory)"
    return _module()[1]


def _agent(cache: torch.Tensor):
    """A new agent with the cache registered, and its memory type and device id."""
    nixl, why = _module()
    if nixl is None:
        raise TransferError(why)
    name = f"pdserve-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        agent = nixl.nixl_agent(
            name, nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        regs = agent.register_memory([cache])
    except Exception as e:  # no UCX transport here (UCX_TLS), no memory registration, ...
        raise TransferError(f"cannot start a NIXL agent: {e}") from None
    return agent, regs, platform_type(cache.device).nixl_memory, max(cache.get_device(), 0)


def _plane_bytes(cache_shape, element_size: int) -> int:
    """Bytes of one block in one layer's K or V: block_size * kv_heads * head_dim."""
    return int(np.prod(cache_shape[3:])) * element_size


class NixlWriter(KVWriter):
    name = "nixl"
    is_layerwise = True

    def __init__(self, descriptor: dict, welcome: KVWelcome, cache: torch.Tensor, send: Send):
        self.desc = parse(NixlDescriptor, descriptor, "nixl")
        self.src, self.send = cache, send
        self._platform = platform_for(cache.device)
        self.agent, self._regs, self.mem, self.device_id = _agent(cache)
        self.remote: str | None = self._connect()
        self._block_bytes = _plane_bytes(cache.shape, cache.element_size())
        self._num_planes = cache.shape[0] * 2
        self._num_dst_blocks = num_cache_blocks(welcome.cache_shape)
        self._writes: OrderedDict[str, _Write] = OrderedDict()

    def _connect(self) -> str:
        try:
            return self.agent.add_remote_agent(self.desc.metadata)
        except Exception as e:
            raise TransferError(
                f"cannot connect to the decode node's NIXL agent {self.desc.agent}: {e}"
            ) from None

    def _descs(
        self, base: int, num_blocks: int, starts: np.ndarray, lens: np.ndarray, layers: range
    ) -> np.ndarray:
        """(address, bytes, device) per K/V plane of those layers and run of consecutive blocks."""
        planes = np.arange(2 * layers.start, 2 * layers.stop, dtype=np.uint64)[:, None]
        addr = np.uint64(base) + (planes * np.uint64(num_blocks) + starts[None, :]) * np.uint64(
            self._block_bytes
        )
        n = np.broadcast_to(lens[None, :] * np.uint64(self._block_bytes), addr.shape)
        return np.stack(
            [addr.ravel(), n.ravel(), np.full(addr.size, self.device_id, dtype=np.uint64)], axis=1
        )

    is_stalled = False  # posted writes move only while polled (no progress thread)

    def begin(
        self,
        request_id: str,
        reservation: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        within_s: float,
        wire: str = "same",
    ) -> None:
        if len(src_block_ids) != len(dst_block_ids):
            raise TransferError(f"{len(src_block_ids)} blocks for {len(dst_block_ids)} reserved")
        if any(not 0 < b < self._num_dst_blocks for b in dst_block_ids):
            raise TransferError(
                f"destination blocks outside the decode cache of {self._num_dst_blocks}"
            )
        if request_id in self._writes:
            raise TransferError(f"a second write of {request_id} under way")
        if self.remote is None:
            self.remote = self._connect()  # again, after a failed write dropped it
        self._writes[request_id] = _Write(
            list(src_block_ids),
            list(dst_block_ids),
            reservation,
            time.monotonic() + max(within_s, 0.0),
        )

    def write_layers(
        self, request_id: str, first_layer: int, end_layer: int, blocks: range | None = None
    ) -> None:
        """Those layers (of those of its blocks) go as a part of their own once the device
        has computed them; the latest is held back until the next, so the last part
        carries the notification."""
        w = self._writes[request_id]
        if first_layer >= end_layer:  # none: what is held stays held
            return
        if w.held is not None:
            w.parts.append(self._part(request_id, w, *w.held, notify=False))
        # The forward pass that computes these layers may still be queued on the device.
        w.held = (
            range(first_layer, end_layer),
            self._platform.event(),
            range(len(w.src)) if blocks is None else blocks,
        )

    def renew(self, request_id: str, within_s: float) -> None:
        w = self._writes.get(request_id)
        if w is not None:
            w.deadline = time.monotonic() + max(within_s, 0.0)

    def end(self, request_id: str) -> int:
        w = self._writes[request_id]
        if w.held is None:
            raise TransferError(f"the write of {request_id} ended with no layers")
        w.parts.append(self._part(request_id, w, *w.held, notify=True))
        w.held, w.is_open = None, False
        return 1

    def _part(
        self, request_id: str, w: _Write, layers: range, ready, blocks: range, notify: bool
    ) -> _Part:
        if w.runs_of != blocks:  # NOTE: made once per block range, not per layer
            w.runs = np.array(
                runs(w.src[blocks.start : blocks.stop], w.dst[blocks.start : blocks.stop]),
                dtype=np.uint64,
            ).reshape(-1, 3)
            w.runs_of = blocks
        r = w.runs
        local = self._descs(self.src.data_ptr(), self.src.shape[2], r[:, 0], r[:, 2], layers)
        remote = self._descs(self.desc.address, self._num_dst_blocks, r[:, 1], r[:, 2], layers)
        try:
            handle = self.agent.initialize_xfer(
                "WRITE",
                self.agent.get_xfer_descs(local, self.mem),
                self.agent.get_xfer_descs(remote, self.mem),
                self.remote,
                request_id.encode() if notify else b"",
            )
        except Exception as e:
            raise TransferError(f"NIXL refused the write: {e}") from None
        return _Part(handle, ready, notify)

    def flush(self) -> None:
        """Post the parts that are ready (nothing ends here)."""
        now = time.monotonic()
        for rid, w in self._writes.items():
            if not w.is_cancelled and now <= w.deadline and self._drive(rid, w) is False:
                break

    def _drive(self, rid: str, w: _Write) -> str | None | bool:
        """Announce the write, post its parts in order, drop those done. -> None: all done;
        "": under way; False: the link is not ready (later writes wait); else why it failed.
        NOTE: the part with the notification is posted only once every other is done, so
        the notification says that all of it landed."""
        if not w.is_announced:
            if not self.send(
                KVTransfer(rid, w.reservation, "nixl", {"agent": self.agent.name}, NO_DATA)
            ):
                return False  # announced in order; the link is not ready: next turn
            w.is_announced = True
        for part in list(w.parts):
            if part.is_posted:
                why = self._state(part, post=False)
            elif (part.ready is not None and not part.ready.query()) or (
                part.notify and part is not w.parts[0]
            ):
                break
            else:
                part.is_posted, w.is_posted = True, True
                why = self._state(part, post=True)
            if why == "":
                continue
            if why is not None:
                return why
            w.parts.remove(part)
            self._release(part)
        return "" if w.parts or w.is_open else None

    def poll(self) -> list[tuple[str, str | None]]:
        ended: list[tuple[str, str | None]] = []
        now = time.monotonic()
        is_blocked = False
        for rid, w in list(self._writes.items()):
            late = "it did not complete before its reservation could end"
            if w.is_cancelled:
                why = "cancelled"
            elif now > w.deadline:
                # NOTE: before driving it on: a process that was stopped (SIGSTOP) and goes on
                # past the deadline must not let UCX complete it now.
                why = late
            elif is_blocked or (w.is_open and not w.parts and w.held is None):
                continue
            else:
                why = self._drive(rid, w)
                if why is False:
                    is_blocked = True
                    continue
            if why == "":
                continue  # under way
            del self._writes[rid]
            for part in w.parts:
                self._release(part)
            if why is not None and w.is_posted:
                self._reset()
            ended.append((rid, why))
        return ended

    def cancel(self, request_id: str) -> None:
        w = self._writes.get(request_id)
        if w is not None:
            w.is_cancelled = True  # poll() stops it (a posted one: by dropping the connection)

    def _state(self, part: _Part, post: bool) -> str | None:
        """None: done; "": under way; else why it failed."""
        try:
            state = (
                self.agent.transfer(part.handle)
                if post
                else self.agent.check_xfer_state(part.handle)
            )
        except Exception as e:  # NIXL_ERR_REMOTE_DISCONNECT and the like
            return f"NIXL: {e}"
        return None if state == "DONE" else "" if state == "PROC" else f"NIXL reported {state}"

    def _release(self, part: _Part) -> None:
        try:
            part.handle.release()
        except Exception as e:  # still under way: the connection reset below cancels it
            log.debug("releasing a NIXL transfer: %s", e)

    def _reset(self) -> None:
        """Drop the connection to the decode agent (cancelling what UCX still holds for it),
        so a failed or late write cannot land later; the next write connects again."""
        if self.remote is None:
            return
        try:
            self.agent.remove_remote_agent(self.remote)
        except Exception as e:
            log.warning("dropping the NIXL connection to %s: %s", self.desc.agent, e)
        self.remote = None

    def close(self) -> None:
        for w in self._writes.values():
            for part in w.parts:
                self._release(part)
        self._writes.clear()
        self._reset()
        try:
            self.agent.deregister_memory(self._regs)
        except Exception as e:
            log.debug("closing a NIXL agent: %s", e)
        self.agent = None


@dataclass
class _Part:
    handle: object
    ready: object | None  # its layers are computed (a platform event)
    notify: bool  # the last part: its notification names the request
    is_posted: bool = False


@dataclass
class _Write:
    src: list[int]  # its blocks here
    dst: list[int]  # and there
    reservation: str
    deadline: float  # monotonic: stop it past this
    parts: list[_Part] = field(default_factory=list)
    held: tuple | None = None  # (layers, ready, blocks): the latest, made a part at the next call
    is_open: bool = True  # more layers may come (until end())
    is_announced: bool = False
    is_posted: bool = False  # a part was posted (stopping it needs the connection dropped)
    is_cancelled: bool = False
    runs_of: range | None = None  # the blocks `runs` was made for (the latest part's)
    runs: np.ndarray | None = None  # their (src, dst, length) runs of blocks [n, 3]


def _open_receiver(cache: LocalCache) -> NixlReceiver:
    agent, regs, _, device_id = _agent(cache.tensor)
    return NixlReceiver(cache, agent, regs, device_id)


# NOTE: one memory kind per pair (the descriptors carry one); mixed pairs use tcp.
BACKEND = Backend(
    "nixl",
    why_unusable,
    _open_receiver,
    NixlWriter,
    is_auto_across_hosts_only=True,
    is_one_sided=True,
    is_layerwise=True,
    why_not_with=lambda device, welcome, is_local: why_not_same_kind(device, welcome),
)
