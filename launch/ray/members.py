"""The Controller actor for `pdserve serve --ray` (launch/ray/cluster.py is the driver): it
places the members (launch/ray/member.py: one per pdserve process) on Ray's machines, scales
them, hands out their keys, and stops them; the members are its actors and die with it.
Importing this module imports ray: only the --ray path does.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.wire.keys import make_keys
from launch.ray.keys import check_token, make_token, send_keys
from launch.ray.member import STOP_GRACE_S, Member, resources, say
from launch.ray.model_copy import manifest, read_part

MAX_START_TRIES = 3  # a node that exits this often before it is first ready fails the start
HEAD_RESOURCE = "node:__internal_head__"  # what only the Ray head has


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
                    f"{', '.join(failing)} exited {MAX_START_TRIES} times while starting "
                    f"(its error is above)"
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
        read it (launch/ray/keys.py): nothing is sent before a node has a place, and a
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
