"""The cluster launcher (launch/start_cluster.sh runs it; `--help` for its flags): it checks
the host before anything starts (launch/cluster/preflight.py), starts the frontend and this
host's nodes under the supervisor (launch/cluster/supervisor.py), says ready once each node is
registered, and on SIGTERM/SIGINT drains and stops everything, leaving no process, key or
file behind. With --ray, Ray places and supervises the processes instead
(launch/ray/cluster.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from common.base.env import read_env
from common.base.model_dir import check_model_dir
from launch.cluster import plan as cluster_plan
from launch.cluster.default_model import make_default
from launch.cluster.leftovers import remove_core_tables, remove_leftovers
from launch.cluster.plan import Plan, PlanError
from launch.cluster.preflight import (
    check_ports,
    describe_threads,
    make_cluster_keys,
    memory_refusal,
    role_warnings,
)
from launch.cluster.supervisor import Supervisor, say


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--ray" in argv:  # Ray places and supervises the processes (launch/ray/cluster.py)
        from launch.ray.cluster import serve

        return serve(argv)
    try:
        a = cluster_plan.parse(argv)
        if a.help:
            print(cluster_plan.USAGE)
            return 0
        plan = cluster_plan.make_plan(a, cluster_plan.num_cores(), read_env().home)
    except PlanError as e:
        print(f"start_cluster: {e}", file=sys.stderr)
        return 2
    try:  # NOTE: before any process starts: a bad model or a host too small is one line
        if a.model:
            check_model_dir(plan.model, needs_tokenizer=not a.join)
        else:
            make_default(plan.model, say)
        why = memory_refusal(plan)
    except ValueError as e:
        print(f"start_cluster: {e}", file=sys.stderr)
        return 2
    if why:
        print(f"start_cluster: {why}", file=sys.stderr)
        return 1
    for warning in role_warnings(plan):
        say(f"warning: {warning}")
    why = check_ports(a.host, plan.ports)
    if why:
        print(f"start_cluster: {why}", file=sys.stderr)
        return 1
    cores = cluster_plan.num_cores()
    per = {
        role: next(
            (plan.threads[n.name] for n in plan.nodes if n.role == role and n.device == "cpu"), 1
        )
        for role in ("prefill", "decode")
    }
    shared = (
        " (shared: each up to that, owed its split; --no-core-sharing: fixed)"
        if plan.core_pools
        else ""
    )
    frontend = "no frontend here" if a.join else "the frontend 1 thread"
    say(
        f"{cores} cores: each cpu prefill node {describe_threads(per['prefill'])} (low priority), "
        f"each cpu decode node {describe_threads(per['decode'])}{shared}, {frontend}"
    )
    remove_leftovers()
    try:
        plan.key_args, links, temp_keys = make_cluster_keys(plan)
    except PlanError as e:
        print(f"start_cluster: {e}", file=sys.stderr)
        return 2
    ready_dir = Path(tempfile.mkdtemp(prefix=f"pdserve-ready-{os.getpid()}-"))
    sup = Supervisor(plan, ready_dir)
    sup.temp_keys = temp_keys

    def on_signal(signum, _frame) -> None:
        sup.signal = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        return _run(sup, plan, links)
    finally:
        shutil.rmtree(ready_dir, ignore_errors=True)
        if temp_keys:
            shutil.rmtree(temp_keys, ignore_errors=True)
        remove_core_tables(plan)


def _run(sup: Supervisor, plan: Plan, links: str) -> int:
    a = plan.opts
    drain_s = float(a.drain_timeout)

    def stop(rc: int) -> int:
        # NOTE: a second signal while stopping ends the launcher at once (its children die
        # with it).
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if sup.signal is not None:
            say(f"stopping (draining for up to {a.drain_timeout}s)")
            rc = 128 + sup.signal
        sup.stop(drain_s)
        return rc

    if not a.join:
        sup.start_frontend()
    for node in plan.nodes:
        sup.start_node(node)
    why = sup.wait_ready(float(a.ready_timeout))
    if why:
        if sup.signal is None:
            say(why)
        return stop(1)
    pids = " ".join(str(sup.procs[n.name].pid) for n in plan.nodes)
    host = plan.clients.rsplit(":", 1)[0].removeprefix("tcp://")
    if a.join:
        names = " ".join(n.name for n in plan.nodes)
        say(
            f"joined the frontend at {a.join}: {names} registered (node pids {pids}; "
            f"KV at {host} from port {int(a.base_port) + 2}; {links})"
        )
        print(f"PDSERVE_JOINED={a.join}", flush=True)
    else:
        http = "" if a.no_http else f", OpenAI API at http://{host}:{a.http_port}/v1"
        num = {role: sum(n.role == role for n in plan.nodes) for role in ("prefill", "decode")}
        say(
            f"ready: {num['prefill']} prefill + {num['decode']} decode nodes; "
            f"clients connect to {plan.clients}{http} "
            f"(frontend pid {sup.frontend.pid}, node pids {pids}; {links})"
        )
        print(f"PDSERVE_ENDPOINT={plan.clients}", flush=True)
    if a.demo:
        rc = 0
        for extra in (
            [
                "--max-tokens",
                "24",
                "--ignore-eos",
                "--prompt",
                "The prefill node computes the prompt",
                "--prompt",
                "Hello, world! How are you?",
                "--prompt",
                "café naïve résumé",
            ],
            [
                "--max-tokens",
                "24",
                "--temperature",
                "0.8",
                "--seed",
                "7",
                "--prompt",
                "A streamed, sampled answer:",
            ],
        ):
            rc = (
                subprocess.run(
                    [sys.executable, "-m", "frontend.cli", "--endpoint", plan.clients, *extra]
                ).returncode
                or rc
            )
        say("demo done; stopping")
        return stop(rc)
    # Serve until a signal arrives or the frontend exits; a node that exits starts again
    # after its backoff.
    while True:
        if sup.signal is not None:
            return stop(0)
        rc = sup.turn()
        if rc is not None:
            return stop(rc)
        sup.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
