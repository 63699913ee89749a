"""The stand-in frontend of the node benchmarks: NodeUnderTest starts one node as a
subprocess and talks to it over its sockets (as the frontend, and for the decode benchmark
as the prefill node too); worker_args gives the node its options."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common.base.config import endpoint
from common.base.model_spec import ModelSpec
from common.kv.blocks import num_blocks_for
from common.transfer import host_id
from common.wire.channel import BadMessage, Channel, Poller, node_tag, open_context
from common.wire.codec import dtype_name
from common.wire.keys import ClusterKeys
from common.wire.protocol import (
    HandoffAck,
    Heartbeat,
    KVCommit,
    KVHello,
    KVReserve,
    KVReserved,
    KVTransfer,
    KVWelcome,
    NodeReady,
    ReadyReply,
)

ROOT = Path(__file__).resolve().parents[2]
HANDOFF_WAIT_S = 120.0  # for a reservation the stand-in prefill node asks for


class NodeUnderTest:
    """Starts one node as a subprocess and stands in for the frontend (and, for the
    decode benchmark, the prefill node) on its sockets."""

    def __init__(
        self,
        module: str,
        args: list[str],
        base_port: int,
        log: str | None,
        kv_is_router: bool,
        keys_dir: str | None = None,
        host: str = "127.0.0.1",
        node_host: str = "127.0.0.1",
        prefix: tuple[str, ...] = (),
    ):
        """kv_is_router: we bind the KV endpoint (the prefill node hands off to us).
        keys_dir: CURVE on both links; we hold the frontend's key and the other node's.
        host: where we listen; node_host: where the node's KV link listens; prefix: what
        runs the node on its host (another simulated host, say)."""
        name = "prefill-0" if module == "decode_node" else "decode-0"
        keys = (lambda who: ClusterKeys(Path(keys_dir), who)) if keys_dir else (lambda who: None)
        self.ctx = open_context(keys("frontend"))
        self.kv_ctx = open_context(keys(name))
        self.node_endpoint = endpoint(host, base_port + 1)
        self.kv_endpoint = endpoint(host if kv_is_router else node_host, base_port + 2)
        if (host, node_host) != ("127.0.0.1", "127.0.0.1"):
            args = [*args, "--allow-remote"]
        self.link = Channel(
            self.ctx, True, self.node_endpoint, max_message_bytes=None, domain="nodes"
        )
        if keys_dir:
            args = [*args, "--keys", keys_dir]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        # NOTE: without --node-log the node's output still goes to a file of ours, so a node
        # that exits can be quoted (its last line says why), and the file goes at close.
        self.log_file = open(log, "a+b") if log else tempfile.TemporaryFile()
        out = self.log_file
        cmd = [*prefix, sys.executable, "-m", module, *args, "--frontend", self.node_endpoint]
        if not kv_is_router:
            cmd += ["--kv-bind", self.kv_endpoint]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.kv = Channel(
            self.kv_ctx,
            kv_is_router,
            self.kv_endpoint,
            max_message_bytes=None,
            domain="nodes" if kv_is_router else None,
            server=None if kv_is_router else "decode-0",
            tag=None if kv_is_router else node_tag(name, "bench"),
        )
        self.poller = Poller(self.link, self.kv)
        self.identity: bytes | None = None
        self.last_stats: dict = {}
        self.last_stats_at = 0.0

    def poll(self, timeout_s: float) -> list[tuple[Channel, bytes | None, object]]:
        """Messages from the node (heartbeats are absorbed into last_stats)."""
        out = []
        for ch in self.poller.wait(timeout_s):
            while ch.has_message():
                sender, msg = ch.recv()
                if isinstance(msg, BadMessage):
                    raise RuntimeError(f"bad message from the node: {msg.error}")
                if isinstance(msg, NodeReady):
                    self.identity = sender
                    self.link.send(ReadyReply(True), to=sender)  # registered, as a frontend says
                elif isinstance(msg, Heartbeat):
                    self.last_stats, self.last_stats_at = msg.stats, time.perf_counter()
                out.append((ch, sender, msg))
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"the node exited with code {self.proc.returncode}{self._last_words()}"
            )
        return out

    def wait_ready(self, timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        while self.identity is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the node did not become ready")
            self.poll(0.1)

    def next_heartbeat(self, after: float) -> tuple[float, dict]:
        deadline = time.monotonic() + max(after - time.perf_counter(), 0) + HANDOFF_WAIT_S
        while self.last_stats_at <= after:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node sent no heartbeat for {HANDOFF_WAIT_S:.0f}s")
            self.poll(0.05)
        return self.last_stats_at, dict(self.last_stats)

    def send(self, msg) -> None:
        self.link.send(msg, to=self.identity)

    # ---- standing in for the other node on the KV link (tcp transfer) ----------

    def answer_kv(
        self, sender: bytes, msg, spec: ModelSpec, dtype: torch.dtype, block_size: int
    ) -> KVCommit | None:
        """As a decode node that discards what it is sent: welcome, reserve, accept.
        Returns a commit once it is acknowledged."""
        if isinstance(msg, KVHello):
            shape = [spec.num_layers, 2, 2**30, block_size, spec.num_kv_heads, spec.head_dim]
            self.kv.send(
                KVWelcome("bench", host_id(), "cpu", shape, dtype_name(dtype), {"tcp": {}}),
                to=sender,
            )
        elif isinstance(msg, KVReserve):
            n = num_blocks_for(msg.prompt_len, block_size)
            self.kv.send(
                KVReserved(
                    msg.request_id,
                    "bench",
                    list(range(1, n + 1)),
                    ask=msg.ask,
                    reservation=f"bench-{msg.request_id}"[:128],
                ),
                to=sender,
            )
        elif isinstance(msg, KVCommit):
            self.kv.send(HandoffAck(msg.request_id, True), to=sender)
            return msg
        return None

    def hand_off(
        self, requests: list[tuple[str, int]], prompt_len: int, params, kv: torch.Tensor
    ) -> list[tuple[Channel, bytes | None, object]]:
        """As a prefill node with many prompts ready at once: ask the decode node to
        reserve blocks for every (request id, first token) of requests, write kv into each
        grant as tcp frames and commit it as its answer comes. Returns the other messages
        that came meanwhile (the decode node's steps), in order.
        NOTE: all asks go out together: asked one at a time, each answer waits for a step,
        and at a large batch the first requests would finish before the last joined."""
        first_token = dict(requests)
        waiting = set(first_token)
        asked_at: dict[str, float] = {}
        wait_s = HANDOFF_WAIT_S + 2 * len(requests)
        deadline = time.monotonic() + wait_s
        other = []
        while waiting:
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(
                    f"the decode node reserved no room for {len(waiting)} requests "
                    f"within {wait_s:.0f}s: give a larger --kv-cache-memory"
                )
            for rid in waiting:  # asked again after a refusal for now, or to keep a queued place
                if now - asked_at.get(rid, -1e9) > 1.0:
                    self.kv.send(KVReserve(rid, prompt_len, params.max_tokens))
                    asked_at[rid] = now
            for ch, sender, msg in self.poll(0.05):
                if ch is not self.kv:
                    other.append((ch, sender, msg))
                elif isinstance(msg, KVReserved) and msg.request_id in waiting:
                    if msg.block_ids is not None:
                        waiting.discard(msg.request_id)
                        token = first_token[msg.request_id]
                        self._write_and_commit(msg, prompt_len, token, params, kv)
                    elif not msg.is_retryable:
                        raise RuntimeError(f"decode node refused {msg.request_id}: {msg.reason}")
                    elif not msg.is_queued:  # full for now: ask again soon
                        asked_at[msg.request_id] = time.monotonic() - 0.95
        return other

    def _write_and_commit(
        self, reply: KVReserved, prompt_len: int, first_token: int, params, kv: torch.Tensor
    ) -> None:
        rid = reply.request_id
        self.kv.send(
            KVTransfer(
                rid,
                reply.reservation,
                "tcp",
                {"first_layer": 0},
                kv[:, :, : len(reply.block_ids)].contiguous(),
            )
        )
        self.kv.send(
            KVCommit(
                rid,
                prompt_len,
                first_token,
                params,
                {},
                "tcp",
                [1] * prompt_len,
                reply.reservation,
                kv.shape[0],
            )
        )

    def _last_words(self) -> str:
        """': ' and the last line the node wrote, or nothing."""
        try:
            f = self.log_file
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
        except OSError:
            return ""
        return f": {lines[-1].strip()}" if lines else ""

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.link.close()
        self.kv.close()
        self.ctx.term()
        self.kv_ctx.term()
        self.log_file.close()


def worker_args(
    a: argparse.Namespace, max_batch: int, max_model_len: int, kv_bytes: int | None = None
) -> list[str]:
    """The node's options; kv_bytes: its KV cache (else --kv-cache-memory, else its default).
    NOTE: plain steps (--speculative-config off) whatever the default: a decode node's step
    times and floors here are of one token a row (bench transfer's background rows, one
    token repeated, would draft well; speculation is bench spec's); a --node-arg, given
    after, wins."""
    args = ["--speculative-config", "off"]
    args += ["--model", a.model] if a.model else ["--shape", a.shape]
    args += [
        "--device",
        a.device,
        "--max-batch-size",
        str(max_batch),
        "--max-model-len",
        str(max_model_len),
    ]
    if a.dtype:
        args += ["--dtype", a.dtype]
    if kv_bytes or a.kv_cache_memory:
        args += ["--kv-cache-memory", str(kv_bytes or a.kv_cache_memory)]
    return args + a.node_arg
