"""pdserve on a Ray cluster: `pdserve serve --ray [ADDRESS]` (or start_cluster.sh --ray)
and `pdserve scale`. Ray places the frontend and each node (launch/ray/members.py) on
the machines of a cluster started as Ray documents (`ray start --head` on one machine,
`ray start --address HEAD:6379` on the others); pdserve's own processes and links run
as without Ray. docs/ray.md says what Ray's channel protects and how to run this on
Kubernetes (deploy/).

    pdserve serve --ray auto --model DIR --num-prefill 1 --num-decode 2 [start_cluster flags]
    pdserve scale --endpoint tcp://HOST:5600 --num-prefill 1 --num-decode 3
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from common.base.env import read_env
from launch.cluster import plan as cluster_plan
from launch.cluster.default_model import make_default
from launch.cluster.plan import PlanError

NAMESPACE = "pdserve"  # Ray's namespace for the controller's name
CONTROLLER_PREFIX = "pdserve:"  # the controller's actor name: pdserve:<base port>
RAY_FLAGS = {"--ray": "address", "--ray-cpus-per-node": "num_cpus"}
RAY_SWITCHES = {"--ray-ship-model": "ship_model"}
NOT_WITH_RAY = ("join", "demo", "no_keys", "keys", "advertise_host")


def say(line: str) -> None:
    print(f"[pdserve] {line}", file=sys.stderr, flush=True)


def split_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(--ray's options, start_cluster's flags). --ray with no address: auto."""
    ours, rest, i = {"address": "auto", "num_cpus": "1", "ship_model": False}, [], 0
    while i < len(argv):
        if argv[i] in RAY_SWITCHES:
            ours[RAY_SWITCHES[argv[i]]] = True
            i += 1
        elif argv[i] in RAY_FLAGS:
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            if argv[i] != "--ray" and not has_value:
                raise PlanError(f"{argv[i]} needs a value")
            if has_value:
                ours[RAY_FLAGS[argv[i]]] = argv[i + 1]
            i += 1 + has_value
        else:
            rest.append(argv[i])
            i += 1
    if not ours["num_cpus"].isdigit() or int(ours["num_cpus"]) < 1:
        raise PlanError(f"--ray-cpus-per-node needs a whole number, got '{ours['num_cpus']}'")
    return ours, rest


def has_ray(prog: str) -> bool:
    try:
        import ray

        del ray
    except ImportError:
        print(
            f"{prog}: --ray needs Ray in this environment: pip install 'pdserve[ray]' "
            f"(or pip install ray)",
            file=sys.stderr,
        )
        return False
    return True


def controller_name(base_port: int | str) -> str:
    return f"{CONTROLLER_PREFIX}{base_port}"


def serve(argv: list[str]) -> int:
    # NOTE: before Ray is imported, which reads it once: Ray folds lines that differ only in
    # numbers ("decode-0: ..." and "decode-1: ...") into one, and an operator loses a node's.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        ours, rest = split_args(argv)
        a = cluster_plan.parse(rest)
        if a.help:
            print(__doc__.strip() + "\n\n" + cluster_plan.USAGE)
            return 0
        for dest in NOT_WITH_RAY:
            if getattr(a, dest):
                raise PlanError(
                    f"--{dest.replace('_', '-')} is not for --ray (Ray places every node; keys are "
                    f"made and handed out here)"
                )
        plan = cluster_plan.make_plan(a, 1, read_env().home)  # the flags' own checks, the node list
    except PlanError as e:
        print(f"start_cluster: {e}", file=sys.stderr)
        return 2
    num = {role: sum(n.role == role for n in plan.nodes) for role in ("prefill", "decode")}
    devices = {role: getattr(a, f"{role}_devices").split(",")[0] for role in ("prefill", "decode")}
    if not a.model:
        make_default(plan.model, say, " (every machine must see this path)")
    if not has_ray("start_cluster"):
        return 2
    import ray

    from launch.ray.keys import why_failed
    from launch.ray.members import Controller

    started = time.monotonic()
    # NOTE: stdout carries the ready line alone; Ray prints the actors' output (and its own
    # warnings) to sys.stdout from a thread, so that goes to stderr with the logs.
    ready_out, sys.stdout = sys.stdout, sys.stderr
    ray.init(address=ours["address"], namespace=NAMESPACE, log_to_driver=True)
    opts = {
        "launcher": rest,
        "model": str(Path(plan.model).resolve()),
        "num_cpus": int(ours["num_cpus"]),
        "drain_s": a.drain_timeout,
        "base_port": a.base_port,
        "devices": devices,
        "ship_model": ours["ship_model"],
    }
    here = ray.get_runtime_context().get_node_id()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    controller = (
        ray.remote(Controller)
        .options(
            name=controller_name(a.base_port),
            num_cpus=0,
            max_concurrency=16,
            lifetime=None,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        )
        .remote(opts)
    )
    stop_signal: list[int] = []

    def on_signal(signum, _frame) -> None:
        stop_signal.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    def stop(rc: int) -> int:
        signal.signal(
            signal.SIGINT, signal.SIG_DFL
        )  # NOTE: a second signal ends the driver at once
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        say(f"stopping (draining for up to {a.drain_timeout}s)")
        try:
            ray.get(controller.stop.remote(), timeout=float(a.drain_timeout) + 60)
        except Exception as e:  # noqa: BLE001 -- whatever is left dies with this driver's actors
            say(f"stop: {e}")
        ray.kill(controller)
        ray.shutdown()
        return 128 + stop_signal[0] if stop_signal else rc

    try:
        placed = ray.get(
            controller.start.remote(num["prefill"], num["decode"], float(a.ready_timeout))
        )
    except Exception as e:  # noqa: BLE001 -- a start that failed: said, then everything stops
        say(f"not ready: {why_failed(e)}")
        return stop(1)
    endpoint = placed["endpoint"]
    host = endpoint.rsplit(":", 1)[0].removeprefix("tcp://")
    where = ", ".join(
        f"{n} on {w['hostname']} ({w['ip']})" for n, w in placed["where"].items() if w
    )
    http = "" if a.no_http else f", OpenAI API at http://{host}:{a.http_port}/v1"
    say(
        f"ready in {time.monotonic() - started:.1f}s: {num['prefill']} prefill + "
        f"{num['decode']} decode nodes on Ray; clients connect to {endpoint}{http} "
        f"({where}; CURVE keys made here, handed to each actor)"
    )
    print(f"PDSERVE_ENDPOINT={endpoint}", file=ready_out, flush=True)
    while not stop_signal:
        if not ray.get(controller.is_frontend_alive.remote()):
            say("the frontend exited; stopping the cluster")
            return stop(1)
        time.sleep(1)
    return stop(0)


def scale(argv: list[str]) -> int:
    """pdserve scale: add nodes to a cluster `pdserve serve --ray` placed, or drain its
    newest ones (their requests move; none fails), until it has this many."""
    from common.runtime.process import HelpFormat  # NOTE: here: it imports torch

    p = argparse.ArgumentParser(
        prog="pdserve scale", description=scale.__doc__, formatter_class=HelpFormat
    )
    p.add_argument(
        "--endpoint", required=True, help="the cluster's client endpoint (PDSERVE_ENDPOINT)"
    )
    p.add_argument("--num-prefill", type=int, required=True, help="prefill nodes wanted in all")
    p.add_argument("--num-decode", type=int, required=True, help="decode nodes wanted in all")
    p.add_argument("--ray", default="auto", help="the Ray cluster's address")
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait for new nodes")
    a = p.parse_args(argv)
    if a.num_prefill < 0 or a.num_decode < 0:
        p.error("node counts are 0 or more")
    port = a.endpoint.rsplit(":", 1)[-1]
    if not has_ray("pdserve scale"):
        return 2
    import ray

    from launch.ray.keys import why_failed

    ray.init(address=a.ray, namespace=NAMESPACE, log_to_driver=False)
    try:
        controller = ray.get_actor(controller_name(port))
    except ValueError:
        print(
            f"pdserve scale: no cluster placed by pdserve serve --ray at {a.endpoint}",
            file=sys.stderr,
        )
        return 1
    try:  # NOTE: Ray's errors (the controller gone, a member restarting) said in one line
        placed = ray.get(controller.where.remote())
        frontend = placed.get("frontend") or {}
        if frontend.get("endpoint") != a.endpoint:
            print(
                f"pdserve scale: the cluster on port {port} serves {frontend.get('endpoint')}, "
                f"not {a.endpoint}",
                file=sys.stderr,
            )
            return 1
        changes = ray.get(controller.scale.remote(a.num_prefill, a.num_decode, a.timeout))
    except ray.exceptions.RayError as e:
        print(f"pdserve scale: {why_failed(e)}", file=sys.stderr)
        return 1
    for line in changes.get("notes", []):
        print(f"pdserve scale: {line}", file=sys.stderr)
    added = " ".join(changes["added"]) or "-"
    drained = " ".join(changes["drained"]) or "-"
    print(f"added: {added}; drained: {drained}")
    return 0
