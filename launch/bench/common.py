"""What the node benchmarks share: their options, the model's shape and dtype, the KV and
memory budgets, the hardware floors, the transformers baseline (the stand-in frontend that
starts one node is node_under_test.py)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from common.base.config import DTYPES, check_model_dir, parse_bytes
from common.base.model_spec import ModelSpec, load_spec, preset_spec
from common.engine.platform import check_device
from common.kv.blocks import num_blocks_for
from decode_node.scheduler import WATERMARK

# NOTE: re-exported: the benchmarks' names for them
from launch.bench.floors import (  # noqa: F401
    matmul_params,
    measure_bandwidth,
    measure_floors,
    sync,
)
from launch.cluster import memory_check


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


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def best_ms(fn, repeats: int) -> float:
    """The best of `repeats` timed calls of fn, in ms (one untimed call first)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3
