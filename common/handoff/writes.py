"""Starting a handoff's KV write: whole, once every layer of its prompt is queued on
the device, or layer by layer during the pass that computes it (--kv-layerwise).

Pushed as the pass computes it (the layers done so far, at each layer's end), the
transfer hides behind the pass: the first token decoded waits for max(prefill,
transfer) rather than their sum. The cost is more, smaller writes (a frame or a post
per group) and their gathers running beside the pass, which a short prompt's
transfer does not repay. `auto` pushes layer by layer where the KV would take at
least MIN_HIDDEN_S at the rate whole writes to that backend have measured, or,
before one is measured, where it is at least UNMEASURED_BYTES. The rate is timed from a
whole write's start to its commit's acknowledgement, over writes of MIN_RATE_BYTES or more."""
from __future__ import annotations

from typing import Callable

from common.handoff.states import Handoff, Stage
from common.transfer import TransferError

MODES = ("auto", "on", "off")
MIN_HIDDEN_S = 0.01
UNMEASURED_BYTES = 4 * 2**20
MIN_RATE_BYTES = 2**20   # writes this large time the link more than its latency


def is_layerwise(mode: str, num_bytes: int, bytes_per_s: float) -> bool:
    """mode: --kv-layerwise; bytes_per_s: the backend's measured rate (0: none yet)."""
    if mode != "auto":
        return mode == "on"
    if bytes_per_s <= 0:
        return num_bytes >= UNMEASURED_BYTES
    return num_bytes / bytes_per_s >= MIN_HIDDEN_S


def can_start(h: Handoff, now: float, is_partial: bool = False, mode: str = "off",
              bytes_per_s: float = 0.0, block_bytes: int = 0) -> bool:
    """Whether its write may start now; is_partial: with part of its layers queued, which
    only a write pushed layer by layer does (mode, and the backend's rate, say whether)."""
    if not (h.stage is Stage.RESERVED and (h.is_kv_queued or is_partial) and h.peer.writer is not None
            and h.epoch == h.peer.epoch and now < h.lease.write_by):
        return False
    return not is_partial or (h.peer.is_layerwise and is_layerwise(mode, len(h.job.block_ids) * block_bytes,
                                                                   bytes_per_s))


def write(h: Handoff, num_layers: int, num_done: int | None, checksums, clock: Callable[[], float]) -> None:
    """Start its write whole (num_done None, the first call), or layer by layer: each call
    with num_done writes the layers queued since the last, one without ends it.
    TransferError: not started (its stage unchanged), or stopped (still WRITING: cancel it)."""
    w, rid = h.peer.writer, h.job.request_id
    if h.stage is Stage.RESERVED:
        # NOTE: an id past the peer's cache would index out of bounds on the device.
        if not all(0 <= b < h.peer.num_blocks for b in h.dst_block_ids):
            raise TransferError(f"reserved block ids do not fit the decode node's "
                                f"{h.peer.num_blocks}-block cache")
        h.write_deadline = h.lease.write_deadline
        within_s = h.write_deadline - clock()
        if num_done is None:
            if checksums is not None:
                h.checksums = checksums(h.job.block_ids)   # NOTE: before the blocks can be freed
            h.num_written = w.write(rid, h.reservation, h.job.block_ids, h.dst_block_ids, within_s=within_s)
            h.stage, h.write_started = Stage.WRITING, clock()
            return
        w.begin(rid, h.reservation, h.job.block_ids, h.dst_block_ids, within_s=within_s)
        h.stage, h.write_started, h.layers_sent = Stage.WRITING, clock(), 0
    if h.stage is not Stage.WRITING or h.layers_sent < 0:
        return
    end = num_layers if num_done is None else num_done
    if end > h.layers_sent:
        w.write_layers(rid, h.layers_sent, end)
        h.layers_sent = end
    if num_done is None:
        if checksums is not None:
            h.checksums = checksums(h.job.block_ids)
        # NOTE: timed from here, what the pass did not hide (the figures' write time)
        h.num_written, h.write_started = w.end(rid), clock()


def observe_ack(h: Handoff, figures, now: float, num_bytes: int) -> None:
    """Its commit acknowledged: a whole write's start to here is the rate the decode node
    got its KV at (the writer's own end can be earlier: tcp's is when the last frame is
    queued on the socket). figures: that backend's TransferFigures."""
    if h.layers_sent < 0 and num_bytes >= MIN_RATE_BYTES and now > h.write_started:
        figures.observe_rate(num_bytes / (now - h.write_started))
