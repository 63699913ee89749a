"""What Ray runs for `pdserve serve --ray` (launch/ray_cluster.py is the driver): a Member
actor per pdserve process (the frontend or one node), and the Controller actor that
places, scales and stops them. Each Member runs pdserve's own process, with the same
argv start_cluster.sh gives it (launch/cluster_plan.py), on the machine Ray put the
actor on; Ray places, restarts and stops the actors. Importing this module imports
ray: only the --ray path does.

Restarts: a node process that exits while its Member is not stopping takes the Member
with it (os._exit), and Ray starts the actor again, in its placement group bundle,
which Ray moves to another machine when the bundle's machine is gone. The node comes
back under its name and key; the frontend moves its requests meanwhile as for any
node that dies. The frontend is not restarted: its clients' endpoint would move, so
the driver stops the cluster instead (as start_cluster.sh does).
"""

from __future__ import annotations

import os
import re
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
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.base.env import read_env
from common.wire.keys import make_keys
from launch import cluster_plan
from launch.cluster_plan import Node, Plan
from launch.leftovers import remove_leftovers
from launch.model_copy import MAX_COPY_TRIES, ModelChanged, copy_model, manifest, read_part
from launch.ray_keys import check_token, make_token, send_keys

STOP_GRACE_S = 10
MAX_START_TRIES = 3  # a node that exits this often before it is first ready fails the start
HEAD_RESOURCE = "node:__internal_head__"  # what only the Ray head has
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
            env={**os.environ, **env},
            start_new_session=True,
            cwd=str(Path(__file__).resolve().parents[1]),
        )
        say(f"{spec['name']} started on {self.ip} (pid {self.proc.pid})")
        threading.Thread(target=self._watch, daemon=True, name="watch").start()

    def _copy_model(self, controller) -> str:
        """The model fetched from the driver's machine into this one's cache, with
        --ray-ship-model; else the error that names the path and the machine."""
        s = self.spec
        if not s.get("ship_model"):
            raise RuntimeError(
                f"{s['name']}: the model directory {s['model']} is not on {self.ip}: give --model a "
                f"path every machine sees (a shared file system), or add --ray-ship-model"
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


class Controller:
    """Places the cluster and changes it: start(), scale(), stop(). One per cluster, named
    pdserve:<base port> in the pdserve namespace, so `pdserve scale` finds it;
    the members are its actors and die with it (and it with the driver)."""

    clock = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)

    def __init__(self, opts: dict):
        self.opts = opts  # launcher, model, num_cpus, drain_s, base_port, devices, ship_model
        self.lock = threading.RLock()  # one scale() or stop() at a time
        self.key_dir = tempfile.mkdtemp(prefix=f"pdserve-keys-{os.getpid()}-")
        self._token = make_token()  # NOTE: no method returns it: members get it at start
        self.key_version = 0  # bumped whenever keys are made
        self.keys_read: dict[str, int] = {}  # name -> the key_version its member last read
        self.members: dict[str, object] = {}  # name -> its actor
        self.groups: dict[str, object] = {}  # name -> the placement group it runs in
        self.roles: dict[str, str] = {}
        self.num_starts: dict[str, int] = {}  # name -> times its member started (Ray restarts it)
        self.node_link = ""
        self.endpoint = ""

    # ---- keys -----------------------------------------------------------------

    def _public_keys(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in Path(self.key_dir).glob("*.key")}

    def keys_for(self, name: str, token: str) -> dict[str, bytes]:
        """Every public key, and this member's secret key: made once here, handed to
        each actor at its start (also when Ray starts it again), and to no other caller."""
        # NOTE: takes no lock: a member starting while scale() holds it asks for its keys.
        check_token(token, self._token)
        if name not in self.roles:
            raise PermissionError(f"{name!r} is not a member of this cluster")
        self.num_starts[name] = self.num_starts.get(name, 0) + 1  # each start asks once
        self.keys_read[name] = self.key_version  # NOTE: before the files are read
        secret = (Path(self.key_dir) / f"{name}.key_secret").read_bytes()
        return {**self._public_keys(), f"{name}.key_secret": secret}

    def model_files(self) -> list[tuple[str, int, str]]:
        return manifest(self.opts["model"])

    def read_model(self, rel: str, offset: int, length: int) -> bytes:
        return read_part(self.opts["model"], rel, offset, length)

    # ---- placement ------------------------------------------------------------

    def _spec(self, name: str, role: str) -> dict:
        o = self.opts
        return {
            "name": name,
            "role": role,
            "device": "cpu" if role == "frontend" else o["devices"][role],
            "launcher": o["launcher"],
            "base_port": o["base_port"],
            "node_link": self.node_link,
            "num_cpus": o["num_cpus"],
            "model": o["model"],
            "ship_model": o["ship_model"],
        }

    def _start(self, spec: dict, group, bundle: int, res: dict[str, float]):
        actor_cls = ray.remote(Member)
        kind = {k: v for k, v in res.items() if k not in ("CPU", "GPU")}
        self.roles[spec["name"]] = spec["role"]  # NOTE: before it starts: it asks for its keys
        actor = actor_cls.options(
            num_cpus=res.get("CPU", 0),
            num_gpus=res.get("GPU", 0),
            resources=kind or None,
            max_restarts=0 if spec["role"] == "frontend" else -1,
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=bundle
            ),
        ).remote({**spec, "token": self._token}, ray.get_runtime_context().current_actor)
        self.members[spec["name"]], self.groups[spec["name"]] = actor, group
        return actor

    def start(self, num_prefill: int, num_decode: int, timeout_s: float) -> dict:
        """The frontend and prefill-0 in one bundle on the Ray head, every other node in a
        bundle of its own, spread over the machines (SPREAD: one machine each where there
        are enough)."""
        o = self.opts
        names = [f"prefill-{i}" for i in range(num_prefill)] + [
            f"decode-{i}" for i in range(num_decode)
        ]
        make_keys(self.key_dir, names)
        node_res = {
            role: resources(o["devices"][role], o["num_cpus"]) for role in ("prefill", "decode")
        }
        # (name, bundle, resources): bundle 0 holds the frontend and prefill-0 where there is one.
        shares_first = bool(names) and names[0] == "prefill-0"
        placed = [
            (n, i if shares_first else i + 1, node_res[n.partition("-")[0]])
            for i, n in enumerate(names)
        ]
        # NOTE: the frontend asks Ray for no CPU (it shares the head's with prefill-0): the
        # head's CPUs stay free for a node Ray moves there when a machine is lost.
        first = dict(node_res["prefill"]) if shares_first else {}
        # NOTE: on the Ray head: where `ray start --head` ran, and where KubeRay's head
        # service points, so clients find the frontend there.
        first[HEAD_RESOURCE] = 0.001
        bundles = [first] + [res for _, b, res in placed if b > 0]
        group = placement_group(
            bundles, strategy="SPREAD", name=f"pdserve-{o['base_port']}-{os.getpid()}"
        )
        self._place(group, bundles, "the cluster", timeout_s)
        frontend = self._start(self._spec("frontend", "frontend"), group, 0, {"CPU": 0})
        where = ray.get(frontend.where.remote(), timeout=timeout_s)
        self.endpoint = where["endpoint"]
        self.node_link = f"{self.endpoint.rsplit(':', 1)[0]}:{int(o['base_port']) + 1}"
        for name, bundle, res in placed:
            self._start(self._spec(name, name.partition("-")[0]), group, bundle, res)
        self._wait_ready(names, timeout_s)
        return {"endpoint": self.endpoint, "where": self.where()}

    @staticmethod
    def _place(group, bundles: list[dict], what: str, timeout_s: float, more: str = "") -> None:
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise RuntimeError(
                f"Ray found no room for {what} ({bundles}) in {timeout_s:.0f}s: add a machine "
                f"(ray start --address HEAD:6379) or ask for fewer nodes{more}"
            ) from None

    def _wait_ready(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(names)
        while waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout_s:.0f}s: {', '.join(waiting)}")
            failing = [n for n in waiting if self.num_starts.get(n, 0) > MAX_START_TRIES]
            if failing:  # a node that cannot start: Ray would start it for ever
                raise RuntimeError(
                    f"{', '.join(failing)} exited {MAX_START_TRIES} times while starting (its error "
                    f"is above)"
                )
            refs = {n: self.members[n].is_ready.remote() for n in waiting}
            waiting = [n for n, ref in refs.items() if not self._answer(ref, timeout_s)]
            time.sleep(0.2)

    @staticmethod
    def _answer(ref, timeout_s: float):
        """A member's answer, or None while Ray starts it again; RuntimeError for one that
        could not be made (its __init__ raised: Ray does not try again)."""
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.ActorUnavailableError:
            return None
        except ray.exceptions.ActorDiedError as e:
            cause = re.search(r"RuntimeError: (.*)", str(e))
            raise RuntimeError(
                cause.group(1) if cause else str(e).strip().splitlines()[-1]
            ) from None

    def where(self) -> dict[str, dict]:
        """name -> its machine's address, hostname, pid and endpoint (a member Ray is
        starting again: None)."""
        refs = {n: a.where.remote() for n, a in list(self.members.items())}
        out = {}
        for name, ref in refs.items():
            try:
                out[name] = ray.get(ref, timeout=10)
            except Exception:  # noqa: BLE001 -- restarting or gone: said as None
                out[name] = None
        return out

    def is_frontend_alive(self) -> bool:
        try:
            ray.get(self.members["frontend"].where.remote(), timeout=30)
            return True
        except Exception:  # noqa: BLE001 -- the actor died (its process exited)
            return False

    # ---- scale ----------------------------------------------------------------

    def scale(self, num_prefill: int, num_decode: int, timeout_s: float) -> dict:
        """Add nodes (each in a placement group of its own, spread) or drain the newest
        ones (their requests move to the others; none fails) until there are this many."""
        with self.lock:
            changes = {"added": [], "drained": [], "notes": []}
            for role, want in (("prefill", num_prefill), ("decode", num_decode)):
                have = sorted(
                    (n for n, r in self.roles.items() if r == role),
                    key=lambda n: int(n.rpartition("-")[2]),
                )
                if want > len(have):
                    taken = {int(n.rpartition("-")[2]) for n in have}
                    new = [f"{role}-{i}" for i in range(want + len(taken) + 1) if i not in taken][
                        : want - len(have)
                    ]
                    self._add(role, new, timeout_s, changes)
                for name in reversed(have[want:]):
                    self._remove(name)
                    changes["drained"].append(name)
            return changes

    def _add(self, role: str, new: list[str], timeout_s: float, changes: dict) -> None:
        """Place and start each new node, then give its public key to the members that
        read it (launch/ray_keys.py): nothing is sent before a node has a place, and a
        member Ray is starting again meanwhile fails nothing (said in changes["notes"])."""
        added = changes["added"]

        def note(line: str) -> None:
            say(line)
            changes["notes"].append(line)

        make_keys(self.key_dir, new)  # NOTE: before any starts: each asks for its keys
        self.key_version += 1
        res = resources(self.opts["devices"][role], self.opts["num_cpus"])
        placed = []
        try:
            for name in new:
                group = placement_group([res], strategy="SPREAD")
                self._place(
                    group,
                    [res],
                    name,
                    timeout_s,
                    f"; added so far: {' '.join(added + placed) or 'none'}",
                )
                self._start(self._spec(name, role), group, 0, res)
                placed.append(name)
        finally:
            added += placed
            for name in new[len(placed) :]:  # no room: its keys go with it
                self._forget_keys(name)
            if placed:
                send_keys(
                    self.members,
                    self.roles,
                    placed,
                    role,
                    self._public_keys(),
                    lambda n: self.keys_read.get(n, -1) >= self.key_version,
                    timeout_s,
                    note,
                    self.clock,
                    self.sleep,
                )
        self._wait_ready(placed, timeout_s)

    def _forget_keys(self, name: str) -> None:
        for key in (f"{name}.key", f"{name}.key_secret"):
            (Path(self.key_dir) / key).unlink(missing_ok=True)

    def _remove(self, name: str) -> None:
        actor, group = self.members.pop(name), self.groups.pop(name)
        self.roles.pop(name)
        try:
            ray.get(actor.stop.remote(float(self.opts["drain_s"])))
        except Exception:  # noqa: BLE001 -- already gone
            pass
        ray.kill(actor, no_restart=True)
        if not any(g is group for g in self.groups.values()):
            remove_placement_group(group)
        self._forget_keys(name)

    # ---- stop -----------------------------------------------------------------

    def stop(self) -> None:
        """The frontend drains first, then every node stops; every actor and placement
        group goes, and the keys."""
        with self.lock:
            drain_s = float(self.opts["drain_s"])
            if "frontend" in self.members:
                try:
                    ray.get(
                        self.members["frontend"].stop.remote(drain_s),
                        timeout=drain_s + 2 * STOP_GRACE_S,
                    )
                except Exception:  # noqa: BLE001 -- already gone
                    pass
            refs = [a.stop.remote(0.0) for n, a in self.members.items() if n != "frontend"]
            for ref in refs:
                try:
                    ray.get(ref, timeout=3 * STOP_GRACE_S)
                except Exception:  # noqa: BLE001 -- already gone
                    pass
            groups = {id(g): g for g in self.groups.values()}
            for actor in self.members.values():
                ray.kill(actor, no_restart=True)
            for group in groups.values():
                remove_placement_group(group)
            self.members.clear()
            self.groups.clear()
            shutil.rmtree(self.key_dir, ignore_errors=True)
