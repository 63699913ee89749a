"""What launch/start_cluster.sh starts, decided before anything runs: its options, read
as the launcher's flags; the node list (names, roles, devices, KV ports); the endpoints;
each process's arguments; and the thread budget. Pure: tests/unit/test_supervisor.py checks
the decisions without starting a process (launch/cluster/supervisor.py runs the plan).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from common.base.speculative import parse_speculative
from launch.cluster.usage import USAGE  # noqa: F401 (cluster_plan.USAGE: --help)

LOOPBACK_HOSTS = ("localhost", "::1")


class PlanError(ValueError):
    """A bad option: one line, exit code 2."""


@dataclass(frozen=True)
class Node:
    name: str
    role: str  # "prefill" or "decode"
    device: str
    kv: str = ""  # a decode node's KV endpoint


@dataclass
class Plan:
    opts: argparse.Namespace
    model: str
    clients: str  # the client endpoint (BASE)
    node_link: str  # the frontend's node endpoint (BASE+1, or --join's)
    nodes: list[Node]
    ports: list[int]  # every port bound on this host
    threads: dict[str, int]  # node name -> its --threads
    core_pools: dict[str, str] = field(default_factory=dict)  # node name -> its --core-pool
    remote: list[str] = field(default_factory=list)  # ["--allow-remote"] beyond loopback
    advertise: str = ""  # the host decode nodes advertise, under a wildcard --host
    key_args: list[str] = field(default_factory=list)

    @property
    def is_joining(self) -> bool:
        return bool(self.opts.join)


def _port(text: str, name: str, hi: int = 65535) -> int:
    if not re.fullmatch(r"\d+", text) or not 1 <= int(text) <= hi:
        raise PlanError(f"{name} needs a port number, got '{text}'")
    return int(text)


CORE_TABLE_PREFIX = "pdserve-cores-"  # /dev/shm/pdserve-cores-<launcher pid>-<base port>

# option -> (dest, default) for options that take a value
VALUED = {
    "--model": ("model", ""),
    "--prefill-device": ("prefill_devices", "cpu"),
    "--prefill-devices": ("prefill_devices", "cpu"),
    "--decode-device": ("decode_devices", "cpu"),
    "--decode-devices": ("decode_devices", "cpu"),
    "--num-prefill": ("num_prefill", ""),
    "--num-decode": ("num_decode", ""),
    "--kv-transfer": ("kv_transfer", "auto"),
    "--kv-layerwise": ("kv_layerwise", ""),
    "--disaggregate": ("disaggregate", ""),
    "--host": ("host", "127.0.0.1"),
    "--advertise-host": ("advertise_host", ""),
    "--base-port": ("base_port", "5600"),
    "--name-prefix": ("prefix", ""),
    "--join": ("join", ""),
    "--dtype": ("dtype", ""),
    "--kv-cache-memory": ("kv_cache_memory", ""),
    "--kv-cache-dtype": ("kv_cache_dtype", ""),
    "--kv-wire-dtype": ("kv_wire_dtype", ""),
    "--max-batch-size": ("max_batch_size", "64"),
    "--max-num-seqs": ("max_batch_size", "64"),
    "--max-model-len": ("max_model_len", ""),
    "--block-size": ("block_size", ""),
    "--token-budget": ("token_budget", ""),
    "--max-num-batched-tokens": ("token_budget", ""),
    "--kv-cache-fraction": ("kv_cache_fraction", ""),
    "--gpu-memory-utilization": ("kv_cache_fraction", ""),
    "--http-port": ("http_port", "8000"),
    "--served-model-name": ("served_model_name", ""),
    "--log-level": ("log_level", ""),
    "--ready-timeout": ("ready_timeout", "300"),
    "--keys": ("keys", ""),
    "--drain-timeout": ("drain_timeout", "30"),
    "--swap-space": ("swap_space", ""),
    "--speculative-config": ("speculative_config", ""),
    "--reasoning-parser": ("reasoning_parser", ""),
    "--tool-call-parser": ("tool_call_parser", ""),
    "--logprobs-mode": ("logprobs_mode", ""),
}
# option -> (dest, value) for switches
SWITCHES = {
    "--no-http": ("no_http", True),
    "--no-keys": ("no_keys", True),
    "--no-restart-nodes": ("no_restart", True),
    "--restart-nodes": ("no_restart", False),
    "--no-preemption": ("no_preemption", True),
    "--kv-verify": ("kv_verify", True),
    "--demo": ("demo", True),
    "--enable-auto-tool-choice": ("auto_tool_choice", True),
    "--allow-json-whitespace": ("json_whitespace", True),
    "--core-sharing": ("no_core_sharing", False),
    "--no-core-sharing": ("no_core_sharing", True),
    "--no-prefix-caching": ("no_prefix_caching", True),
    "--no-enable-prefix-caching": ("no_prefix_caching", True),
    "--access-log": ("no_access_log", False),
    "--no-access-log": ("no_access_log", True),
    "-h": ("help", True),
    "--help": ("help", True),
}
PASSED_ON = {
    "--frontend-arg": "frontend_args",
    "--prefill-arg": "prefill_args",
    "--decode-arg": "decode_args",
}


def parse(argv: list[str]) -> argparse.Namespace:
    """The launcher's options, read as its flags always were. PlanError: one line."""
    a = argparse.Namespace(
        **{d: v for d, v in VALUED.values()},
        **{d: False for d, _ in SWITCHES.values()},
        **{d: [] for d in PASSED_ON.values()},
    )
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in VALUED:
            if i + 1 >= len(argv) or not argv[i + 1] or argv[i + 1].startswith("--"):
                raise PlanError(f"{arg} needs a value")
            setattr(a, VALUED[arg][0], argv[i + 1])
            i += 2
        elif arg in PASSED_ON:  # passed on as given, an option's name included
            if i + 1 >= len(argv):
                raise PlanError(f"{arg} needs a value")
            getattr(a, PASSED_ON[arg]).append(argv[i + 1])
            i += 2
        elif arg in SWITCHES:
            setattr(a, *SWITCHES[arg])
            i += 1
        else:
            raise PlanError(f"unknown option {arg}")
    return a


def devices_for(devices: str, count: str, role: str) -> list[str]:
    """One device per node: a list gives one node each; a count repeats the one device."""
    listed = devices.split(",")
    if not count:
        return listed
    if len(listed) != 1:
        raise PlanError(f"give --num-{role} with one --{role}-devices device, not {len(listed)}")
    if not re.fullmatch(r"\d+", count):
        raise PlanError(f"--num-{role} needs a whole number, got '{count}'")
    return listed * int(count)


def thread_split(num_cores: int, devices: dict[str, tuple[str, str]]) -> dict[str, int]:
    """name -> (role, device) -> --threads. A decode node (latency-bound) gets an even share
    of the cores among the CPU nodes; a prefill node's lanes run at low priority and take
    what the others leave, so the CPU prefill nodes divide every core among themselves;
    accelerator nodes, whose host work is launches, get one thread."""
    num_prefill = sum(1 for role, d in devices.values() if d == "cpu" and role == "prefill")
    num_decode = sum(1 for role, d in devices.values() if d == "cpu" and role == "decode")
    prefill, decode = (
        max(num_cores // max(num_prefill, 1), 1),
        max(num_cores // max(num_prefill + num_decode, 1), 1),
    )
    return {
        n: 1 if d != "cpu" else prefill if role == "prefill" else decode
        for n, (role, d) in devices.items()
    }


def core_pools(num_cores: int, devices: dict[str, tuple[str, str]], base: int) -> dict[str, str]:
    """name -> --core-pool NAME:BUDGET:SHARE for the CPU nodes started here: they share the
    host's cores (common/engine/cores.py), each owed the split thread_split would give a
    decode node, the prefill nodes what is left, every one capped at all of them. The
    table's name holds this launcher's pid: one left by a launcher killed is swept."""
    cpu = [n for n, (_, d) in devices.items() if d == "cpu"]
    if len(cpu) < 2 or num_cores < 2:
        return {}
    num_decode = sum(1 for n in cpu if devices[n][0] == "decode")
    decode = max(num_cores // len(cpu), 1)
    prefill = max((num_cores - decode * num_decode) // max(len(cpu) - num_decode, 1), 1)
    return {
        n: f"{CORE_TABLE_PREFIX}{os.getpid()}-{base}:{num_cores}:"
        f"{min(decode if devices[n][0] == 'decode' else prefill, num_cores)}"
        for n in cpu
    }


def make_plan(a: argparse.Namespace, num_cores: int, home: Path) -> Plan:
    base = _port(a.base_port, "--base-port", 65000)
    if not a.no_http:
        _port(a.http_port, "--http-port")
    if not re.fullmatch(r"\d+", a.ready_timeout):
        raise PlanError(f"--ready-timeout needs whole seconds, got '{a.ready_timeout}'")
    if not re.fullmatch(r"\d+(\.\d+)?", a.drain_timeout):
        raise PlanError(f"--drain-timeout needs seconds, got '{a.drain_timeout}'")
    try:
        parse_speculative(a.speculative_config)
    except ValueError as e:
        raise PlanError(str(e)) from None
    from common.base.config import KV_CACHE_DTYPES  # NOTE: here: it loads torch
    from common.base.kv_wire import KV_WIRE_DTYPES

    if a.kv_cache_dtype not in ("", *KV_CACHE_DTYPES):
        raise PlanError(f"--kv-cache-dtype is one of {', '.join(KV_CACHE_DTYPES)}")
    if a.kv_wire_dtype not in ("", *KV_WIRE_DTYPES):
        raise PlanError(f"--kv-wire-dtype is one of {', '.join(KV_WIRE_DTYPES)}")
    prefill_devs = devices_for(a.prefill_devices, a.num_prefill, "prefill")
    decode_devs = devices_for(a.decode_devices, a.num_decode, "decode")
    if not re.fullmatch(r"[A-Za-z0-9._-]*", a.prefix):
        raise PlanError(f"--name-prefix takes letters, digits, '.', '_' and '-', got '{a.prefix}'")
    if a.join:
        if not re.fullmatch(r"tcp://[^/]+:\d+", a.join):
            raise PlanError(
                f"--join needs the frontend's node endpoint tcp://HOST:PORT, got '{a.join}'"
            )
        if not prefill_devs and not decode_devs:
            raise PlanError("--join with no node to start (--num-prefill 0 --num-decode 0)")
        if a.demo:
            raise PlanError("--demo needs a frontend here: not with --join")
        if not a.no_keys and not a.keys:
            raise PlanError(
                "--join needs --keys DIR, the cluster's key directory copied from the frontend's "
                "host (or --no-keys, as the frontend)"
            )
    addr = f"[{a.host}]" if ":" in a.host else a.host
    nodes = [
        Node(f"{a.prefix}decode-{i}", "decode", d, f"tcp://{addr}:{base + 2 + i}")
        for i, d in enumerate(decode_devs)
    ]
    nodes += [Node(f"{a.prefix}prefill-{i}", "prefill", d) for i, d in enumerate(prefill_devs)]
    node_link = a.join or f"tcp://{addr}:{base + 1}"
    is_local = a.host.startswith("127.") or a.host in LOOPBACK_HOSTS
    is_local_link = re.match(r"tcp://(127\.|localhost:|\[::1\]:)", node_link) is not None
    advertise = ""
    if a.host in ("0.0.0.0", "::", "*"):  # a wildcard names no address a peer can reach
        advertise = a.advertise_host or _first_address() or "127.0.0.1"
        advertise = f"[{advertise}]" if ":" in advertise else advertise
    ports = [] if a.join else [base, base + 1] + ([] if a.no_http else [int(a.http_port)])
    ports += [base + 2 + i for i in range(len(decode_devs))]
    model = a.model or str(home / "tiny-qwen3")
    devices = {n.name: (n.role, n.device) for n in nodes}
    threads = thread_split(num_cores, devices)
    pools = {} if a.no_core_sharing else core_pools(num_cores, devices, base)
    threads.update({n: num_cores for n in pools})  # a pooled node's cap: every core, when lent
    return Plan(
        a,
        model,
        f"tcp://{addr}:{base}",
        node_link,
        nodes,
        ports,
        threads,
        pools,
        [] if is_local and is_local_link else ["--allow-remote"],
        advertise,
    )


def _first_address() -> str:
    try:
        out = subprocess.run(
            ["hostname", "-I"], capture_output=True, text=True, timeout=5
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return ""
    return out[0] if out else ""


def frontend_argv(plan: Plan) -> list[str]:
    a = plan.opts
    argv = [
        "-m",
        "frontend",
        "--model",
        plan.model,
        "--clients",
        plan.clients,
        "--nodes",
        plan.node_link,
        *plan.key_args,
        "--threads",
        "1",
        "--drain-timeout",
        a.drain_timeout,
        *plan.remote,
    ]
    argv += [] if a.no_http else ["--http-port", a.http_port]
    argv += _given(
        a,
        ("served_model_name", "--served-model-name"),
        ("max_model_len", "--max-model-len"),
        ("log_level", "--log-level"),
        ("reasoning_parser", "--reasoning-parser"),
        ("tool_call_parser", "--tool-call-parser"),
        ("logprobs_mode", "--logprobs-mode"),
        ("disaggregate", "--disaggregate"),
    )
    argv += ["--enable-auto-tool-choice"] * a.auto_tool_choice + [
        "--allow-json-whitespace"
    ] * a.json_whitespace
    argv += ["--no-access-log"] * a.no_access_log
    return argv + a.frontend_args


def node_argv(plan: Plan, node: Node) -> list[str]:
    a = plan.opts
    argv = [
        "-m",
        f"{node.role}_node",
        "--model",
        plan.model,
        "--max-batch-size",
        a.max_batch_size,
        "--kv-transfer",
        a.kv_transfer,
    ]
    argv += _given(
        a,
        ("dtype", "--dtype"),
        ("kv_cache_memory", "--kv-cache-memory"),
        ("kv_cache_dtype", "--kv-cache-dtype"),
        ("max_model_len", "--max-model-len"),
        ("block_size", "--block-size"),
        ("kv_cache_fraction", "--kv-cache-fraction"),
        ("log_level", "--log-level"),
        ("kv_layerwise", "--kv-layerwise"),
    )
    argv += [
        "--device",
        node.device,
        "--name",
        node.name,
        "--threads",
        str(plan.threads[node.name]),
        "--frontend",
        plan.node_link,
        *plan.key_args,
        *plan.remote,
    ]
    argv += ["--core-pool", plan.core_pools[node.name]] if node.name in plan.core_pools else []
    if node.role == "decode":
        argv += ["--kv-bind", node.kv] + _given(a, ("speculative_config", "--speculative-config"))
        if plan.advertise:
            argv += ["--kv-advertise", f"tcp://{plan.advertise}:{node.kv.rsplit(':', 1)[1]}"]
        argv += ["--swap-space", a.swap_space] * bool(a.swap_space) + [
            "--no-preemption"
        ] * a.no_preemption
        argv += (
            ["--kv-verify"] * a.kv_verify
            + ["--no-prefix-caching"] * a.no_prefix_caching
            + a.decode_args
        )
    else:
        argv += _given(a, ("token_budget", "--token-budget"), ("kv_wire_dtype", "--kv-wire-dtype"))
        argv += (
            ["--no-prefix-caching"] * a.no_prefix_caching
            + ["--kv-verify"] * a.kv_verify
            + a.prefill_args
        )
    return argv


def _given(a: argparse.Namespace, *pairs: tuple[str, str]) -> list[str]:
    return [x for dest, flag in pairs if getattr(a, dest) for x in (flag, getattr(a, dest))]


def num_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
