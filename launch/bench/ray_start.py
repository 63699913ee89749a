"""pdserve bench ray-start: on this one machine, the time from a launch to ready
(PDSERVE_ENDPOINT printed) with start_cluster.sh and with `--ray` on a Ray head started
here (and Ray's own start), alternately, and the memory Ray's own processes take:
its daemons (GCS, raylet, agents) idle, and with the cluster placed (its workers too,
less the pdserve processes they run). One JSON line per run, then a summary line.

    pdserve bench ray-start [--runs 3] [--num-decode 2] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RAY_CLI = os.path.join(os.path.dirname(sys.executable), "ray")
OURS = ("-m frontend", "-m prefill_node", "-m decode_node")


def _rss_mib(marker: str) -> float:
    """Resident memory of Ray's processes (their command line names Ray's temp dir, or
    a worker's title), pdserve's own left out."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = (
                Path(f"/proc/{pid}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
            # NOTE: Ray's workers retitle themselves (ray::Member, ray::IDLE): their command line
            # no longer names the temp dir.
            if (marker in cmd or cmd.startswith("ray::")) and not any(o in cmd for o in OURS):
                rss = next(
                    x
                    for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if x.startswith("VmRSS")
                )
                total += int(rss.split()[1])
        except (OSError, StopIteration):
            continue
    return total / 1024


def _time_to_ready(argv: list[str], env: dict) -> tuple[float, subprocess.Popen]:
    started = time.monotonic()
    p = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    line = p.stdout.readline().decode()
    if not line.startswith("PDSERVE_ENDPOINT="):
        os.killpg(p.pid, signal.SIGKILL)
        raise SystemExit(f"bench ray-start: {argv[:4]} did not get ready")
    return time.monotonic() - started, p


def _stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGINT)
    try:
        p.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pdserve bench ray-start",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--runs", type=int, default=3, help="starts of each kind, alternating")
    p.add_argument("--num-decode", type=int, default=2, help="decode nodes per cluster")
    p.add_argument("--model", default="", help="default: the tiny model start_cluster.sh makes")
    p.add_argument("--port", type=int, default=6390, help="the Ray head's port")
    a = p.parse_args(argv)
    try:
        import ray

        del ray  # only to say so early
    except ImportError:
        print("bench ray-start: needs Ray (pip install 'pdserve[ray]')", file=sys.stderr)
        return 2
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    flags = [
        "--num-prefill",
        "1",
        "--num-decode",
        str(a.num_decode),
        "--no-http",
        "--base-port",
        "5780",
        *(["--model", a.model] if a.model else []),
    ]
    temp = tempfile.mkdtemp(
        prefix="pdsray-"
    )  # NOTE: short: Ray's socket paths are at most 107 bytes
    rows = []
    try:
        started = time.monotonic()
        # NOTE: --num-cpus: Ray's logical CPUs, one per node and the frontend (the nodes'
        # threads share the real cores as start_cluster.sh's do).
        subprocess.run(
            [
                RAY_CLI,
                "start",
                "--head",
                "--port",
                str(a.port),
                "--include-dashboard=false",
                "--num-cpus",
                "16",
                "--temp-dir",
                temp,
                "--disable-usage-stats",
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        ray_up_s = time.monotonic() - started
        time.sleep(3)
        idle_mib = _rss_mib(temp)
        head = f"127.0.0.1:{a.port}"
        for run in range(a.runs):
            plain_s, cluster = _time_to_ready(
                ["bash", str(ROOT / "launch/start_cluster.sh"), *flags], env
            )
            _stop(cluster)
            ray_s, cluster = _time_to_ready(
                ["bash", str(ROOT / "launch/start_cluster.sh"), "--ray", head, *flags], env
            )
            placed_mib = _rss_mib(temp)
            _stop(cluster)
            row = {
                "bench": "ray_start",
                "run": run,
                "ready_start_cluster_s": round(plain_s, 2),
                "ready_on_ray_s": round(ray_s, 2),
                "ray_rss_placed_mib": round(placed_mib),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        subprocess.run(
            [RAY_CLI, "stop", "--force"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        shutil.rmtree(temp, ignore_errors=True)
    print(
        json.dumps(
            {
                "bench": "ray_start",
                "device": "cpu",
                "num_prefill": 1,
                "num_decode": a.num_decode,
                "runs": a.runs,
                "ray_start_head_s": round(ray_up_s, 2),
                "ray_rss_idle_mib": round(idle_mib),
                "ready_start_cluster_s_median": statistics.median(
                    r["ready_start_cluster_s"] for r in rows
                ),
                "ready_on_ray_s_median": statistics.median(r["ready_on_ray_s"] for r in rows),
                "ray_rss_placed_mib_median": statistics.median(
                    r["ray_rss_placed_mib"] for r in rows
                ),
                "bound": "start_cluster.sh's own time to ready on the same machine",
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
