"""The Member actor Ray runs per pdserve process for `pdserve serve --ray` (the Controller in
launch/ray/members.py places them): it runs pdserve's own process, the frontend or one node,
with the same argv start_cluster.sh gives it (launch/cluster/plan.py), on the machine Ray put
the actor on. Importing this module imports ray: only the --ray path does.

Restarts: a node process that exits while its Member is not stopping takes the Member
with it (os._exit), and Ray starts the actor again, in its placement group bundle,
which Ray moves to another machine when the bundle's machine is gone. The node comes
back under its name and key; the frontend moves its requests meanwhile as for any
node that dies. The frontend is not restarted: its clients' endpoint would move, so
the driver stops the cluster instead (as start_cluster.sh does).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray

from common.base.env import PARENT_PID_ENV, read_env
from launch.cluster import plan as cluster_plan
from launch.cluster.leftovers import remove_leftovers
from launch.cluster.plan import Node, Plan
from launch.ray.model_copy import MAX_COPY_TRIES, ModelChanged, copy_model

STOP_GRACE_S = 10
ACCELERATORS = {"cuda": "GPU", "npu": "NPU"}  # device kind -> Ray's resource name


def say(line: str) -> None:
    print(f"[pdserve] {line}", file=sys.stderr, flush=True)


def free_port(host: str) -> int:
    """A port free on this machine now (a decode node's KV port: nodes Ray moves here
    must not collide with the ones already here)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resources(device: str, num_cpus: int) -> dict[str, float]:
    """What one node asks Ray for: its accelerator, or CPUs for a CPU node."""
    kind = device.partition(":")[0]
    if kind in ACCELERATORS:
        return {"CPU": 1, ACCELERATORS[kind]: 1}
    return {"CPU": num_cpus}


class Member:
    """One pdserve process on this actor's machine. spec: role ("frontend", "prefill" or
    "decode"), name, device, launcher (start_cluster.sh's flags), base_port, node_link
    (nodes: the frontend's node endpoint), num_cpus, model, ship_model (fetch the model
    from the driver's machine when this one lacks it), token (to ask for its keys)."""

    def __init__(self, spec: dict, controller):
        self.spec, self.stopping = spec, False
        self.ip = ray.util.get_node_ip_address()
        remove_leftovers()  # of members killed on this machine (their pid, in the name, is gone)
        self.key_dir = tempfile.mkdtemp(prefix=f"pdserve-keys-{os.getpid()}-")
        self.ready_file = Path(self.key_dir) / "ready"
        self.write_keys(ray.get(controller.keys_for.remote(spec["name"], spec["token"])))
        self.model_hold: int | None = None  # a lock on the model's copy here, while in use
        if not (Path(spec["model"]) / "config.json").is_file():
            self.spec = {**spec, "model": self._copy_model(controller)}
        self.endpoint, argv, env = self._argv()
        # NOTE: started from this actor's main thread: a node dies with the thread that
        # started it (PR_SET_PDEATHSIG), which is this process's for the actor's life.
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            env={**os.environ, **env, PARENT_PID_ENV: str(os.getpid())},
            start_new_session=True,
            cwd=str(Path(__file__).resolve().parents[2]),
        )
        say(f"{spec['name']} started on {self.ip} (pid {self.proc.pid})")
        threading.Thread(target=self._watch, daemon=True, name="watch").start()

    def _copy_model(self, controller) -> str:
        """The model fetched from the driver's machine into this one's cache, with
        --ray-ship-model; else the error that names the path and the machine."""
        s = self.spec
        if not s.get("ship_model"):
            raise RuntimeError(
                f"{s['name']}: the model directory {s['model']} is not on {self.ip}: "
                f"give --model a path every machine sees (a shared file system), "
                f"or add --ray-ship-model"
            )
        cache = read_env().home / "models"
        started = time.monotonic()

        def read(rel: str, at: int, n: int) -> bytes:
            return ray.get(controller.read_model.remote(rel, at, n))

        try:
            copy = copy_model(
                s["model"],
                lambda: ray.get(controller.model_files.remote()),
                read,
                cache,
                lambda line: say(f"{s['name']}: {line}"),
            )
        except ModelChanged as e:
            raise RuntimeError(f"{s['name']}: {e} (each of {MAX_COPY_TRIES} tries)") from None
        self.model_hold = copy.hold_fd  # NOTE: kept open: no member prunes a copy in use
        took = f"{copy.num_fetched / 2**20:.1f} MiB fetched in {time.monotonic() - started:.1f}s"
        pruned = f"; {copy.num_pruned} older copies removed" if copy.num_pruned else ""
        say(f"{s['name']}: the model copied to {copy.path} on {self.ip} ({took}{pruned})")
        return str(copy.path)

    def _argv(self) -> tuple[str, list[str], dict[str, str]]:
        s = self.spec
        opts = cluster_plan.parse(s["launcher"])
        addr = f"[{self.ip}]" if ":" in self.ip else self.ip
        base = int(s["base_port"])
        clients = f"tcp://{addr}:{base}"
        node_link = s.get("node_link") or f"tcp://{addr}:{base + 1}"
        device = s["device"]
        if device.partition(":")[0] in ACCELERATORS:  # Ray made only the one it gave us visible
            device = f"{device.partition(':')[0]}:0"
        kv = f"tcp://{addr}:{free_port(self.ip)}" if s["role"] == "decode" else ""
        node = Node(s["name"], s["role"], device, kv)
        plan = Plan(
            opts,
            s["model"],
            clients,
            node_link,
            [node],
            [],
            {node.name: int(s["num_cpus"])},
            remote=["--allow-remote"],
            key_args=["--keys", self.key_dir],
        )
        if s["role"] == "frontend":
            return clients, cluster_plan.frontend_argv(plan) + ["--http-host", self.ip], {}
        return kv, cluster_plan.node_argv(plan, node), {"PDSERVE_READY_FILE": str(self.ready_file)}

    def _watch(self) -> None:
        code = self.proc.wait()
        if not self.stopping:
            say(
                f"{self.spec['name']} (pid {self.proc.pid}) on {self.ip} exited with code {code}"
                + ("" if self.spec["role"] == "frontend" else "; Ray starts it again")
            )
            shutil.rmtree(self.key_dir, ignore_errors=True)
            time.sleep(1)  # NOTE: Ray restarts at once: a node that cannot start must not spin
            os._exit(1)

    def write_keys(self, files: dict[str, bytes]) -> None:
        """Key files (each node's public key, this member's secret one) into its directory."""
        for name, data in files.items():
            path = Path(self.key_dir) / name
            path.write_bytes(data)
            os.chmod(path, 0o600)

    def where(self) -> dict:
        return {
            "name": self.spec["name"],
            "ip": self.ip,
            "pid": self.proc.pid,
            "endpoint": self.endpoint,
            "hostname": socket.gethostname(),
        }

    def is_ready(self) -> bool:
        return self.spec["role"] == "frontend" or self.ready_file.exists()

    def stop(self, drain_s: float) -> int | None:
        """SIGTERM (a node drains: its requests move elsewhere; the frontend drains the
        cluster), SIGKILL after drain_s and STOP_GRACE_S more. -> the exit code."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(drain_s + STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.key_dir, ignore_errors=True)
        return self.proc.returncode
