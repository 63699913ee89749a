"""Starting a handoff's KV write: whole, once every layer of its prompt is queued on
the device, or layer by layer during the pass that computes it (--kv-layerwise).

Pushed as the pass computes it (the layers written so far, as each layer's KV is written),
the transfer hides behind the pass: the first token decoded waits for max(prefill,
transfer) rather than their sum. The cost is more, smaller writes (a frame or a post
per group) and their gathers running beside the pass. Which writes go layer by layer is
the rule in common/base/layerwise.py, at the rate whole writes to that backend have
measured: timed from a whole write's start to its commit's acknowledgement, over writes
of MIN_RATE_BYTES or more."""

from __future__ import annotations

from typing import Callable

from common.base import kv_wire
from common.base.layerwise import is_layerwise
from common.handoff.states import Handoff, Stage
from common.transfer import TransferError

MIN_RATE_BYTES = 2**20  # writes this large time the link more than its latency


def goes_layerwise(peer, mode: str, num_bytes: int, bytes_per_s: float) -> bool:
    """Whether a write of num_bytes to peer (a DecodePeer) is pushed layer by layer."""
    return peer.is_layerwise and is_layerwise(mode, num_bytes, bytes_per_s)


def rate_to(peer, figures: dict) -> float:
    """Bytes/s of whole writes to peer's backend (0: none yet); figures: TransferFigures by
    backend."""
    f = figures.get(peer.writer.name if peer.writer else "")
    return f.bytes_per_s if f else 0.0


def wire_rate_to(peer, figures: dict) -> tuple[float, bool]:
    """(the link rate the wire's format is chosen by, whether it is of tails): whole
    writes', else, where every write goes layer by layer (long prompts), their tails'. A
    tail is what the pass did not hide: a tail rate leaves the hiding out already (and
    reads high where the pass hid part, which favours the KV as it is: a safe error)."""
    f = figures.get(peer.writer.name if peer.writer else "")
    if f is None or f.bytes_per_s > 0:
        return (f.bytes_per_s if f else 0.0), False
    return f.tail_bytes_per_s, f.tail_bytes_per_s > 0


def choose_wire(
    h: Handoff, mode: str, bytes_per_s: float, block_bytes: int, hidden_s: float = 0.0
) -> None:
    """As its write starts: the format its KV crosses in (mode: --kv-wire-dtype; bytes_per_s:
    the link's measured rate; hidden_s: the prefill a write pushed layer by layer runs
    beside), said in its timings where its writer could send int8."""
    w, num_blocks = h.peer.writer, len(h.job.block_ids)
    h.wire, h.wire_bytes = "same", num_blocks * block_bytes
    if "int8" not in w.wire_dtypes:
        return
    int8_bytes = w.wire_bytes(num_blocks)
    c = kv_wire.choose(
        mode, h.wire_bytes, int8_bytes, bytes_per_s, w.round_trip_bytes_per_s, hidden_s
    )
    h.timings.update(c.stamps())
    if c.dtype == "int8":
        h.wire, h.wire_bytes = "int8", int8_bytes


def can_start(
    h: Handoff,
    now: float,
    is_partial: bool = False,
    mode: str = "off",
    bytes_per_s: float = 0.0,
    block_bytes: int = 0,
) -> bool:
    """Whether its write may start now; is_partial: with part of its layers queued, which
    only a write pushed layer by layer does (mode, and the backend's rate, say whether)."""
    if not (
        h.stage is Stage.RESERVED
        and (h.is_kv_queued or is_partial)
        and h.peer.writer is not None
        and h.epoch == h.peer.epoch
        and now < h.lease.write_by
    ):
        return False
    return not is_partial or goes_layerwise(
        h.peer, mode, len(h.job.block_ids) * block_bytes, bytes_per_s
    )


def write(
    h: Handoff,
    num_layers: int,
    num_done: int | None,
    checksums,
    clock: Callable[[], float],
    end_block: int | None = None,
) -> None:
    """Start its write whole (num_done None, the first call), or layer by layer: each call
    with num_done writes the layers queued since the last, one without ends it. A chunked
    prompt's write spans its passes: end_block says how many of its blocks this pass
    completes (None: all, the last chunk); once a pass has queued every layer of them,
    the next pass's layers are of the blocks after them.
    TransferError: not started (its stage unchanged), or stopped (still WRITING: cancel it)."""
    w, rid = h.peer.writer, h.job.request_id
    if h.stage is Stage.RESERVED:
        # NOTE: an id past the peer's cache would index out of bounds on the device.
        if not all(0 <= b < h.peer.num_blocks for b in h.dst_block_ids):
            raise TransferError(
                f"reserved block ids do not fit the decode node's {h.peer.num_blocks}-block cache"
            )
        h.write_deadline = h.lease.write_deadline
        within_s = h.write_deadline - clock()
        if num_done is None:
            if checksums is not None:
                # NOTE: before the blocks can be freed
                h.checksums = checksums(h.job.block_ids, h.wire)
            h.num_written = w.write(
                rid, h.reservation, h.job.block_ids, h.dst_block_ids, within_s=within_s, wire=h.wire
            )
            h.stage, h.write_started = Stage.WRITING, clock()
            return
        w.begin(
            rid, h.reservation, h.job.block_ids, h.dst_block_ids, within_s=within_s, wire=h.wire
        )
        h.stage, h.write_started, h.layers_sent, h.blocks_sent = Stage.WRITING, clock(), 0, 0
    if h.stage is not Stage.WRITING or h.layers_sent < 0:
        return
    end = num_layers if num_done is None else num_done
    blocks = range(
        h.blocks_sent, len(h.job.block_ids) if num_done is None or end_block is None else end_block
    )
    if end > h.layers_sent and blocks:
        # NOTE: checked before every layer pushed: a long pass (or a paused process) must
        # not write into blocks whose grant may have ended (the writer checks too).
        if clock() >= h.write_deadline:
            raise TransferError(
                "its reservation could end before these layers are written: stopped"
            )
        w.write_layers(rid, h.layers_sent, end, blocks)
    h.layers_sent, h.pushed_at = max(h.layers_sent, end), clock()  # a pass computes it
    if end == num_layers and num_done is not None and end_block is not None:
        h.blocks_sent, h.layers_sent = max(h.blocks_sent, end_block), 0  # the next pass's blocks
    if num_done is None:
        if checksums is not None:
            h.checksums = checksums(h.job.block_ids, h.wire)
        # NOTE: timed from here, what the pass did not hide (the figures' write time)
        h.num_written, h.write_started = w.end(rid), clock()


def renew_open(h: Handoff, now: float) -> bool:
    """A write pushed layer by layer that spans passes (a chunked prompt) holds its grant
    as a reserved one does, while its prompt is computed: -> whether to ask for a renewal
    now (not if nothing was pushed since the lease began: a prompt whose passes stopped
    must not hold its blocks for ever). A renewal answered moves its deadline, the
    writer's too; once it has ended, its tail keeps the deadline it has.
    NOTE: never past the lease the decode node confirmed, which frees the blocks then."""
    if not (h.stage is Stage.WRITING and h.layers_sent >= 0 and not h.is_kv_queued):
        return False
    if h.lease.write_deadline > h.write_deadline:
        h.write_deadline = h.lease.write_deadline
        h.peer.writer.renew(h.job.request_id, h.write_deadline - now)
    return now >= h.next_ask_at and h.pushed_at > h.lease.start


def observe_ack(h: Handoff, figures, now: float, num_bytes: int) -> None:
    """Its commit acknowledged: a whole write's start to here is the rate the decode node
    got its KV at (the writer's own end can be earlier: tcp's is when the last frame is
    queued on the socket). figures: that backend's TransferFigures."""
    if num_bytes >= MIN_RATE_BYTES and now > h.write_started:
        # layer by layer: timed from the pass's end (write()), its tail
        figures.observe_rate(num_bytes / (now - h.write_started), is_tail=h.layers_sent >= 0)
