r"""KV transfer throughput, per backend: a real decode node, and this process as the
prefill side writing through the same transfer interface a prefill node uses.

    pdserve bench transfer --shape qwen3-0.6b --prefill-device cuda:0 --decode-device cuda:0 \
        --prompt-len 1024 --num-requests 32 --backends ipc,nixl,tcp,dist [--decode-batch 32]
    pdserve bench transfer --backends nixl,tcp --across-hosts     (root: simulated hosts)

Each handoff is reserve -> write -> commit. Per backend, one JSON line:
- one at a time: ms per request from the start of the write to the commit's
  acknowledgement (the reservation is left out: a prefill node asks for it
  while the prompt is still being computed);
- all at once: GB/s of KV moved with every request's write in flight;
- the floor: for ipc on one device, the device's copy bandwidth (a block copy
  reads and writes every byte); otherwise the link, measured here as one
  large ZeroMQ frame over the same transport (for dist on CPU: one gloo send).
With --across-hosts the decode node runs on a simulated host of its own
(launch/tools/netns.py: a network namespace joined to this side's by a veth pair and
a bridge, UCX_TLS=tcp) and the floor is TCP between the two hosts (1 and 4 streams).
With --decode-batch B the decode node first runs B long requests, and its
step time is read from its heartbeats with and without handoffs arriving.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from common.base.request import SamplingParams
from common.kv.blocks import num_blocks_for
from common.runtime.process import HelpFormat
from common.wire.codec import dtype_name
from common.wire.protocol import (
    NodeAbort,
)
from launch.bench.common import device_name, emit, measure_floors, sync
from launch.bench.link_floors import gloo_floor_GBps, hosts_floor_GBps, link_floor_GBps
from launch.bench.node_under_test import NodeUnderTest, worker_args
from launch.bench.prefill_side import PrefillSide


def step_ms(node: NodeUnderTest, window_s: float) -> float:
    t1, s1 = node.next_heartbeat(time.perf_counter())
    t2, s2 = node.next_heartbeat(t1 + window_s)
    steps = s2["num_decode_steps"] - s1["num_decode_steps"]
    return (t2 - t1) * 1e3 / steps if steps else float("nan")


def kv_bytes(spec, dtype: torch.dtype, num_tokens: int) -> int:
    return num_tokens * spec.kv_bytes_per_token(dtype.itemsize)


def run_backend(a, backend: str, base_port: int, spec, dtype) -> dict:
    bs = a.block_size
    n_blocks = num_blocks_for(a.prompt_len, bs)
    req_bytes = kv_bytes(spec, dtype, n_blocks * bs)
    ns = argparse.Namespace(
        model=None,
        shape=a.shape,
        device=a.decode_device,
        dtype=a.dtype,
        kv_cache_memory=a.kv_cache_memory,
        node_arg=a.node_arg,
    )
    # One row beyond the long requests: a timed handoff (max_tokens 1) ends at admission.
    args = worker_args(ns, a.decode_batch + 1, a.prompt_len + a.decode_tokens + 16)
    place = a.place or {}
    node = NodeUnderTest(
        "decode_node",
        args
        + ["--kv-transfer", backend, "--block-size", str(bs)]
        + (["--kv-verify"] if a.kv_verify else []),
        base_port,
        a.node_log,
        kv_is_router=False,
        keys_dir=a.keys_dir,
        host=place.get("host", "127.0.0.1"),
        node_host=place.get("decode_host", "127.0.0.1"),
        prefix=tuple(place.get("prefix", ())),
    )
    try:
        node.wait_ready()
        # Source blocks [1, n] on the prefill device, random (zeros hide unwritten copies).
        cache = torch.randn(
            spec.num_layers,
            2,
            n_blocks + 1,
            bs,
            spec.num_kv_heads,
            spec.head_dim,
            device=a.prefill_device,
            dtype=torch.float32,
        ).to(dtype)
        src = list(range(1, n_blocks + 1))
        side = PrefillSide(node, cache, backend, a.kv_verify)
        running = []
        if a.decode_batch:  # long requests that keep the decode node stepping
            params = SamplingParams(max_tokens=a.decode_tokens, ignore_eos=True)
            for i in range(a.decode_batch):
                rid = f"bg-{i}"
                dst = side.reserve(rid, a.prompt_len, a.decode_tokens)
                side.write(rid, src, dst)
                side.wait_written({rid}, lambda r: None)
                side.commit(rid, a.prompt_len, params)
                side.wait_acks({rid})
                running.append(rid)
            while node.next_heartbeat(time.perf_counter())[1]["num_running"] < a.decode_batch:
                pass
            quiet_ms = step_ms(node, a.window)

        def one_at_a_time(tag: str) -> list[float]:
            out = []
            for i in range(a.num_requests):
                rid = f"{tag}-{i}"
                dst = side.reserve(rid, a.prompt_len)
                sync(cache.device)
                t0 = time.perf_counter()
                side.write(rid, src, dst)
                side.wait_written({rid}, lambda r: side.commit(r, a.prompt_len))
                side.wait_acks({rid})
                out.append((time.perf_counter() - t0) * 1e3)
            return out

        one_at_a_time("warm")
        latencies = one_at_a_time("seq")

        def all_at_once(tag: str) -> float:
            rids = [f"{tag}-{i}" for i in range(a.num_requests)]
            dsts = [side.reserve(rid, a.prompt_len) for rid in rids]
            sync(cache.device)
            t0 = time.perf_counter()
            for rid, dst in zip(rids, dsts):
                side.write(rid, src, dst)
            side.wait_written(set(rids), lambda r: side.commit(r, a.prompt_len))
            side.wait_acks(set(rids))
            return time.perf_counter() - t0

        burst_s = all_at_once("burst")
        busy_ms = None
        if a.decode_batch:
            # Handoffs arrive back to back for a window; the step rate between the
            # first and the last heartbeat of that window is the loaded step time.
            t1, s1 = node.next_heartbeat(time.perf_counter())
            n_rounds = 0
            while node.last_stats_at < t1 + a.window:
                all_at_once(f"load{n_rounds}")
                n_rounds += 1
            t2, s2 = node.last_stats_at, node.last_stats
            steps = s2["num_decode_steps"] - s1["num_decode_steps"]
            busy_ms = (t2 - t1) * 1e3 / steps if steps else None
            for rid in running:
                node.send(NodeAbort(rid))
        side.writer.close()
    finally:
        node.close()
    total = req_bytes * a.num_requests
    record = {
        "bench": "kv_transfer",
        "backend": backend,
        "shape": a.shape,
        "dtype": dtype_name(dtype),
        "prefill_device": device_name(a.prefill_device),
        "decode_device": a.decode_device,
        "prompt_len": a.prompt_len,
        "num_requests": a.num_requests,
        "kv_verify": a.kv_verify,
        "MB_per_request": round(req_bytes / 1e6, 2),
        "ms_per_request_median": round(statistics.median(latencies), 3),
        "ms_per_request_p90": round(sorted(latencies)[int(0.9 * (len(latencies) - 1))], 3),
        "GBps_one_at_a_time": round(req_bytes / (statistics.median(latencies) / 1e3) / 1e9, 2),
        "GBps_all_at_once": round(total / burst_s / 1e9, 2),
    }
    if a.decode_batch:
        record.update(
            {
                "decode_batch": a.decode_batch,
                "decode_step_ms_quiet": round(quiet_ms, 3),
                "decode_step_ms_while_receiving": round(busy_ms, 3) if busy_ms else None,
            }
        )
    return record


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="pdserve bench transfer", description=__doc__, formatter_class=HelpFormat
    )
    p.add_argument("--shape", default="qwen3-0.6b", help="a preset model shape (random weights)")
    has_cuda = torch.cuda.is_available()
    p.add_argument(
        "--prefill-device",
        default="cuda:0" if has_cuda else "cpu",
        help="where this process (the prefill side) holds its KV",
    )
    p.add_argument(
        "--decode-device", default="cuda:0" if has_cuda else "cpu", help="the decode node's device"
    )
    p.add_argument(
        "--dtype", default=None, help="default: bfloat16 on accelerators, float32 on cpu"
    )
    p.add_argument("--prompt-len", type=int, default=1024, help="tokens of KV per handoff")
    p.add_argument("--num-requests", type=int, default=16, help="handoffs per backend")
    p.add_argument("--backends", default="ipc,tcp", help="comma-separated: one run each")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-memory", default=None, help="the decode node's, e.g. 8GiB")
    p.add_argument(
        "--decode-batch",
        type=int,
        default=0,
        help="run this many long requests on the decode node and compare its step time",
    )
    p.add_argument("--decode-tokens", type=int, default=4096, help="their max_tokens")
    p.add_argument("--window", type=float, default=3.0, help="seconds per step-time reading")
    p.add_argument(
        "--base-port", type=int, default=5800, help="the node's links take this port and the next"
    )
    p.add_argument(
        "--kv-verify",
        action="store_true",
        help="both sides check the KV end to end, as nodes started with --kv-verify do",
    )
    p.add_argument("--node-log", default=None, help="file for the node's log (default: discard)")
    p.add_argument(
        "--node-arg",
        action="append",
        default=[],
        help="one more flag for the decode node, e.g. --node-arg=--threads=1 (repeatable)",
    )
    p.add_argument(
        "--curve",
        action="store_true",
        help="CURVE keys on the node and KV links, as start_cluster.sh runs them",
    )
    p.add_argument(
        "--across-hosts",
        action="store_true",
        help="the decode node on a simulated host of its own (needs root)",
    )
    p.add_argument(
        "--place", type=json.loads, default=None, help=argparse.SUPPRESS
    )  # set by --across-hosts
    a = p.parse_args(argv)
    if a.across_hosts and a.place is None:
        across_hosts(sys.argv[1:] if argv is None else list(argv))
        return
    a.keys_dir = None
    if a.curve:
        import tempfile

        from common.wire.keys import make_keys

        a.keys_dir = tempfile.mkdtemp(prefix="pdserve-bench-keys-")
        make_keys(a.keys_dir, ["prefill-0", "decode-0"])
    from common.base.config import DTYPES
    from common.base.model_spec import preset_spec

    spec = preset_spec(a.shape)
    dtype = (
        DTYPES[a.dtype]
        if a.dtype
        else (torch.float32 if a.prefill_device == "cpu" else torch.bfloat16)
    )
    if a.kv_cache_memory is None:
        tokens = (a.num_requests + 2) * (a.prompt_len + 16) + a.decode_batch * (
            a.prompt_len + a.decode_tokens
        )
        need = kv_bytes(spec, dtype, tokens)
        a.kv_cache_memory = str(int(need * 1.2))
    bytes_per_req = kv_bytes(spec, dtype, num_blocks_for(a.prompt_len, a.block_size) * a.block_size)
    for i, backend in enumerate(a.backends.split(",")):
        record = run_backend(a, backend, a.base_port + 10 * i, spec, dtype)
        if backend in ("ipc", "nixl") and a.prefill_device == a.decode_device and not a.place:
            # NOTE: one host: UCX moves nixl's writes through shared memory too (cma, cuda_ipc).
            bw = measure_floors(a.decode_device, dtype)["bandwidth_GBps"]
            record.update(
                {"floor": "device copy bandwidth (read + write)", "floor_GBps": round(bw / 2, 1)}
            )
        elif a.place:
            # NOTE: UCX opens several connections per peer: one stream is not the link's bound.
            streams = {n: round(hosts_floor_GBps(bytes_per_req, a.place, n), 2) for n in (1, 4)}
            record.update(
                {
                    "floor": "TCP between the hosts (veth pairs and a bridge), "
                    "the better of 1 and 4 streams",
                    "floor_GBps": max(streams.values()),
                    "floor_GBps_1_stream": streams[1],
                    "floor_GBps_4_streams": streams[4],
                    "across_hosts": True,
                }
            )
        else:
            record.update(
                {
                    "floor": "ZeroMQ frame on loopback TCP",
                    "floor_GBps": round(link_floor_GBps(bytes_per_req), 2),
                }
            )
        if backend == "dist" and a.decode_device == "cpu":
            record.update(
                {
                    "floor": "gloo send on loopback TCP",
                    "floor_GBps": round(gloo_floor_GBps(bytes_per_req), 2),
                }
            )
        record["floor_fraction"] = round(record["GBps_all_at_once"] / record["floor_GBps"], 3)
        record["is_curve"] = bool(a.curve)
        emit(record)


def across_hosts(argv: list[str]) -> None:
    """This benchmark again on simulated host a, its decode nodes on host b."""
    from launch.tools import netns

    why = netns.why_not()
    if why:
        sys.exit(f"--across-hosts: {why}")
    with netns.Hosts(["a", "b"]) as hosts:
        place = {
            "host": hosts.addr("a"),
            "decode_host": hosts.addr("b"),
            "prefix": hosts.prefix("b"),
        }
        inner = [a for a in argv if a != "--across-hosts"] + ["--place", json.dumps(place)]
        # NOTE: UCX sees one machine behind the namespaces and would pick shared memory.
        env = {**os.environ, "UCX_TLS": "tcp", "PYTHONPATH": os.getcwd()}
        rc = hosts.popen(
            "a", [sys.executable, "-m", "launch.bench.transfer", *inner], env=env
        ).wait()
    if rc:
        sys.exit(rc)


if __name__ == "__main__":
    main()
