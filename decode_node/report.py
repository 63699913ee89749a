"""What the decode node says of itself: its ready message to the frontend (sent until
accepted), its ready line in the log, and the handoff's figures among its stats."""

from __future__ import annotations

import os

from common.base.config import DecodeConfig
from common.base.log import get_logger
from common.engine.kv_cache import format_name
from common.handoff.receiver import Receiver
from common.runtime.process import describe_threads
from common.wire.protocol import NodeReady

log = get_logger("decode")


def ready_message(cfg: DecodeConfig, worker, epoch: str) -> NodeReady:
    """worker: the node's DeviceWorker, prepared; epoch: its runtime's."""
    return NodeReady(
        "decode",
        cfg.name,
        os.getpid(),
        epoch,
        cfg.worker.device,
        worker.num_kv_blocks,
        worker.block_size,
        worker.max_model_len,
        kv_endpoint=cfg.kv_reachable,
        kv_transfer=cfg.kv_transfer,
        max_batch_size=cfg.worker.max_batch_size,
    )


def log_ready(cfg: DecodeConfig, worker, num_blocks: int, accepted: list[str]) -> None:
    """num_blocks: usable KV blocks; accepted: the KV transfer backends the sink takes."""
    log.info(
        "ready on %s (%s): %d KV blocks (%d tokens in %s), batch up to %d, KV at %s (%s), %s, "
        "%s; %s",
        cfg.worker.device,
        describe_threads(worker.num_threads),
        num_blocks,
        worker.token_capacity,
        format_name(str(worker.kv_cache.dtype).removeprefix("torch.")),
        cfg.worker.max_batch_size,
        cfg.kv_endpoint
        if cfg.kv_advertise is None
        else f"{cfg.kv_endpoint}, advertised as {cfg.kv_advertise}",
        ", ".join(accepted),
        f"preemption on, {cfg.swap_space / 2**20:.4g} MiB swap"
        if cfg.is_preemptive
        else "full reservation",
        _speculation(cfg.worker.speculative),
        worker.describe_kernels(),
    )


def _speculation(spec) -> str:
    """What the ready line says of speculative decoding."""
    if not spec.is_on:
        return "no speculative decoding"
    kind = {"ngram": "prompt lookup", "suffix": "suffix decoding"}[spec.method]
    return f"speculative decoding: {kind}, up to {spec.num_speculative_tokens} drafts a step"


def handoff_figures(h: Receiver) -> dict:
    """The handoff's reservations and what became of them."""
    return {
        "num_reservations": len(h.held),
        "num_expired_reservations": h.num_expired,
        "num_asking": len(h.waiting),
        "num_granted": h.num_granted,
        "num_incomplete_commits": h.num_incomplete,
        "num_early_commits": h.num_early_commits,
        "num_kv_verify_failures": h.num_verify_failures,
        "num_peer_drops": h.num_peer_drops,
    }
