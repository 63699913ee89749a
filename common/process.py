"""What every node process does at start: read worker options, tie its life to
its launcher, and turn SIGTERM/SIGINT into a clean stop."""
from __future__ import annotations

import argparse
import ctypes
import signal
import sys
import threading

from common.config import WorkerConfig, parse_bytes


def add_worker_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and device")
    g.add_argument("--model", help="a Hugging Face Qwen3 model directory")
    g.add_argument("--shape", help="a preset shape with random weights (e.g. qwen3-0.6b)")
    g.add_argument("--device", default="cpu", help="cpu, cuda:N or npu:N")
    g.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 2GiB")
    g.add_argument("--kv-cache-fraction", type=float, default=0.85,
                   help="of free accelerator memory, when --kv-cache-memory is not given")
    g.add_argument("--max-batch-size", type=int, default=64)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-graphs", action="store_true", help="eager decode steps on CUDA")


def worker_config(a: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(model=a.model, shape=a.shape, device=a.device, dtype=a.dtype,
                        block_size=a.block_size, kv_cache_memory=parse_bytes(a.kv_cache_memory),
                        kv_cache_fraction=a.kv_cache_fraction, max_batch_size=a.max_batch_size,
                        max_model_len=a.max_model_len, use_graphs=not a.no_graphs)


def die_with_parent() -> None:
    """Linux: get SIGTERM when the launching process dies, however it dies."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_event_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT; the node loop checks it each turn."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop
