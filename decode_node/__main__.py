"""python -m decode_node --frontend tcp://127.0.0.1:5601 --kv-bind tcp://127.0.0.1:5602 --model DIR"""
import argparse
import dataclasses
import sys

from common.base.config import KV_TRANSFERS, DecodeConfig, NodeLinks, parse_bytes
from common.runtime.process import (HelpFormat, add_worker_args, die_with_parent, run_node, stop_event_on_signals,
                            worker_config)
from decode_node.node import DecodeNode


def swap_bytes(text: str) -> int:
    """--swap-space: a bare number is GiB (as vLLM's flag), else a size with its unit."""
    try:
        return int(float(text) * 2**30)
    except ValueError:
        return parse_bytes(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m decode_node", description=__doc__,
                                formatter_class=HelpFormat)
    add_worker_args(p)
    p.add_argument("--frontend", required=True, help="the frontend's node endpoint")
    p.add_argument("--kv-bind", required=True, help="where prefill nodes hand KV to this node")
    p.add_argument("--name", default="decode-0", help="unique in the cluster (with keys: its key's name)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="reservations held (being written or waiting for a batch row)")
    p.add_argument("--reservation-lease", type=float, default=30.0,
                   help="seconds before an uncommitted reservation is freed")
    p.add_argument("--kv-transfer", choices=KV_TRANSFERS, default="auto",
                   help="KV transfer backends offered to prefill nodes (auto: ipc and tcp)")
    p.add_argument("--swap-space", default="4", metavar="SIZE",
                   help="host memory for the KV of preempted requests: GiB, or a size such as "
                        "512MiB; past it, a preempted request's KV is dropped and recomputed when "
                        "it resumes (0: always)")
    p.add_argument("--no-preemption", action="store_true",
                   help="reserve every block a request could need (prompt + max_tokens) before it "
                        "starts, as a smaller batch that is never preempted")
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="CURVE keys (python -m launch.keys DIR); this node's is DIR/NAME.key_secret")
    p.add_argument("--allow-remote", action="store_true", help="allow non-loopback endpoints")
    a = p.parse_args(argv)
    die_with_parent()
    stop = stop_event_on_signals()

    def build() -> DecodeNode:
        # ipc on CPU maps the cache through shared memory, so it is allocated there.
        worker = dataclasses.replace(worker_config(a), is_cache_in_shm=a.kv_transfer in ("auto", "ipc"))
        return DecodeNode(DecodeConfig(
            worker=worker, frontend_endpoint=a.frontend, kv_endpoint=a.kv_bind, name=a.name,
            max_queue=a.max_queue, reservation_lease_s=a.reservation_lease, kv_transfer=a.kv_transfer,
            links=NodeLinks(), allow_remote=a.allow_remote, keys_dir=a.keys,
            is_preemptive=not a.no_preemption, swap_space=swap_bytes(a.swap_space)))
    return run_node("decode_node", build, stop)


if __name__ == "__main__":
    sys.exit(main())
