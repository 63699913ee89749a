"""What both benchmarks share: the hardware floors, the transformers baseline,
and a stand-in frontend that starts one node and talks to it over its sockets."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common.base.config import DTYPES, check_model_dir, endpoint, parse_bytes
from common.base.model_spec import ModelSpec, load_spec, preset_spec
from common.engine.platform import check_device
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
from decode_node.scheduler import WATERMARK

# NOTE: re-exported: the benchmarks' names for them
from launch.bench.floors import matmul_params, measure_floors, sync  # noqa: F401
from launch.cluster import memory_check

ROOT = Path(__file__).resolve().parents[2]
HANDOFF_WAIT_S = 120.0  # for a reservation the stand-in prefill node asks for


def add_common_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", help="a Hugging Face Qwen3 directory")
    g.add_argument(
        "--shape",
        help="a preset shape with random weights made on the device, e.g. qwen3-0.6b or qwen3-14b",
    )
    p.add_argument(
        "--device",
        default="cuda:0" if torch.cuda.is_available() else "cpu",
        help="where the node runs: cpu, cuda:N or npu:N",
    )
    p.add_argument(
        "--dtype", default=None, help="default: bfloat16 on accelerators, float32 on cpu"
    )
    p.add_argument(
        "--kv-cache-memory",
        default=None,
        metavar="SIZE",
        help="the node's KV cache, e.g. 2GiB (default: what the benchmark needs)",
    )
    p.add_argument(
        "--base-port",
        type=int,
        default=5700,
        help="the node's links take this port and the next two",
    )
    p.add_argument(
        "--baseline",
        choices=["none", "transformers"],
        default="none",
        help="also time transformers' model of the same shape, in this process",
    )
    p.add_argument("--node-log", default=None, help="file for the node's log (default: discard)")
    p.add_argument(
        "--node-arg",
        action="append",
        default=[],
        help="one more flag for the node, e.g. --node-arg=--threads=1 (repeatable)",
    )


def resolve(a: argparse.Namespace) -> tuple[ModelSpec, torch.dtype]:
    """The model's shape and dtype; a model or device this machine cannot run exits
    with one line saying why."""
    try:
        check_device(a.device)
        if a.model:
            check_model_dir(a.model)
    except ValueError as e:
        raise SystemExit(f"{Path(sys.argv[0]).stem}: {e}") from None
    spec = load_spec(a.model) if a.model else preset_spec(a.shape)
    dtype = DTYPES[a.dtype] if a.dtype else (torch.float32 if a.device == "cpu" else torch.bfloat16)
    return spec, dtype


def fit_len(given: int | None, default: int, room: int, flag: str) -> int:
    """A length option: the given value, which must fit in `room` tokens of the
    model's length, or the default cut down to fit."""
    if room < 1:
        raise SystemExit(
            f"{flag}: the model's maximum length leaves no room; shorten the other lengths"
        )
    if given is None:
        return min(default, room)
    if given > room:
        raise SystemExit(
            f"{flag} {given} does not fit the model's maximum length: at most {room} here"
        )
    return given


def kv_budget(
    a: argparse.Namespace, spec: ModelSpec, elem: int, num_tokens: list[int], block_size: int
) -> int:
    """The KV cache the node is given: --kv-cache-memory, or blocks for num_tokens (each
    sequence's length at most), what a decode node keeps free, the null block and a block
    of slack per sequence, in whole MiB."""
    if a.kv_cache_memory:
        return parse_bytes(a.kv_cache_memory)
    held = sum(num_blocks_for(n, block_size) for n in num_tokens)
    # NOTE: a decode node admits only while WATERMARK of its blocks stays free
    blocks = math.ceil(held / (1 - WATERMARK)) + 2 + len(num_tokens)
    need = blocks * block_size * spec.kv_bytes_per_token(elem)
    return -(-need // 2**20) * 2**20


def check_memory(
    a: argparse.Namespace, spec: ModelSpec, elem: int, kv_bytes: int, baseline_bytes: int = 0
) -> None:
    """Exit with one line, before anything loads, where the device cannot hold the node's
    weights and KV cache (and the baseline's model, asked for)."""
    device = torch.device(a.device)
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
    elif device.type == "cpu":
        have = memory_check.available_bytes()
    else:
        return  # the node checks its own device
    need = {f"the weights ({elem} bytes each)": spec.num_params() * elem, "the KV cache": kv_bytes}
    if baseline_bytes:
        need["the transformers baseline"] = baseline_bytes
    why = memory_check.refusal(
        f"{a.model or a.shape} on {a.device}",
        need,
        "try a smaller shape, --dtype bfloat16, fewer or smaller batches, or another --device",
        have,
    )
    if why:
        raise SystemExit(f"{Path(sys.argv[0]).stem}: {why}")


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return device


def hf_model(spec: ModelSpec, device: str, dtype: torch.dtype):
    """transformers' Qwen3 of the same shape, random weights, on the device."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.is_tied_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


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
    """The node's options; kv_bytes: its KV cache (else --kv-cache-memory, else its default)."""
    args = ["--model", a.model] if a.model else ["--shape", a.shape]
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


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)
