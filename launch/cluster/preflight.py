"""What the launcher checks and prepares before any process starts: the ports free, the
host's memory enough for its cpu nodes, the roles a cluster needs, and the CURVE keys."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from launch.cluster.plan import Plan, PlanError


def check_ports(host: str, ports: list[int]) -> str | None:
    """Every port this cluster binds must be free now: a port in use means another
    cluster, which must not answer our readiness check or receive our nodes."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in ports:
        with socket.socket(family) as s:
            # As ZeroMQ binds: past connections lingering in TIME_WAIT do not hold the port.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                return (
                    f"port {port} on {host} is in use ({e.strerror}): another cluster? "
                    f"choose another --base-port (or --http-port)"
                )
    return None


def memory_refusal(plan: Plan) -> str | None:
    """Why this host's memory cannot hold its CPU nodes (each loads the weights and its
    KV cache), or None. Accelerator nodes check their own device as they start."""
    cpu = [n for n in plan.nodes if n.device == "cpu"]
    if not cpu:
        return None
    # NOTE: here, not above: these import torch, which a bad --model need not wait for
    from common.base.config import DTYPES, WorkerConfig, parse_bytes, parse_dtype
    from launch.cluster import memory_check

    a = plan.opts
    dtype = parse_dtype(a.dtype or "auto") or "float32"
    if dtype not in DTYPES:
        return None  # the node says what is wrong with it
    kv = parse_bytes(a.kv_cache_memory or None) or WorkerConfig.cpu_kv_cache_memory
    need = {
        f"the weights in {dtype}, x{len(cpu)} cpu nodes": len(cpu)
        * memory_check.checkpoint_bytes(plan.model, dtype),
        f"a KV cache of {memory_check.gib(kv)} each": len(cpu) * kv,
    }
    return memory_check.refusal(
        f"{len(cpu)} cpu node(s) of {plan.model}",
        need,
        "start fewer cpu nodes (--num-prefill, --num-decode), give --dtype "
        "bfloat16 or a smaller --kv-cache-memory, or put nodes on an "
        "accelerator",
    )


def role_warnings(plan: Plan) -> list[str]:
    """A cluster whose frontend is here but which cannot serve a request yet."""
    if plan.is_joining:
        return []  # this host adds nodes to a cluster: the others may be elsewhere
    roles = {n.role for n in plan.nodes}
    return [
        f"no {role} node (--num-{role} 0): every request is refused until one joins from "
        f"another host (start_cluster.sh --join {plan.node_link})"
        for role in ("prefill", "decode")
        if role not in roles
    ]


def describe_threads(num: int) -> str:
    """As each node's ready line counts them (common/runtime/process.py: describe_threads)."""
    return f"{num} thread{'s' * (num > 1)}"


def make_cluster_keys(plan: Plan) -> tuple[list[str], str, str]:
    """(--keys args, how links are secured, a temporary key directory to remove or "")."""
    a = plan.opts
    if a.no_keys:
        return [], "open node links", ""
    if a.join:  # the frontend's host made them: use, never make
        for file in ["frontend.key", *(f"{n.name}.key_secret" for n in plan.nodes)]:
            if not (Path(a.keys) / file).is_file():
                raise PlanError(
                    f"{a.keys} has no {file}: make the keys once for every node name "
                    f"(pdserve keys KEYS --nodes ...) and copy the directory to each host"
                )
        return ["--keys", a.keys], f"CURVE keys in {a.keys}", ""
    # NOTE: made for this cluster alone, the frontend removes them as it exits (also when this
    # launcher was killed); a launch removes those of launchers killed with their frontend.
    temp = "" if a.keys else tempfile.mkdtemp(prefix=f"pdserve-keys-{os.getpid()}-")
    keys = a.keys or temp
    subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.keys",
            keys,
            "--nodes",
            ",".join(n.name for n in plan.nodes),
        ],
        stdout=subprocess.DEVNULL,
        check=True,
    )
    return ["--keys", keys], f"CURVE keys in {keys}", temp
