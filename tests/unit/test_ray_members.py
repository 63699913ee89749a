"""The Ray controller's key handling and scale (launch/ray/members.py, launch/ray/keys.py)
on fake actors: no Ray cluster runs here (tests/cluster/test_ray.py runs one)."""

from __future__ import annotations

import shutil

import pytest

ray = pytest.importorskip("ray")

from launch.ray import cluster as ray_cluster  # noqa: E402
from launch.ray import keys as ray_keys  # noqa: E402
from launch.ray import members as ray_members  # noqa: E402
from launch.ray.members import Controller  # noqa: E402

OPTS = {
    "launcher": [],
    "model": "/m",
    "num_cpus": 1,
    "drain_s": 1.0,
    "base_port": 5600,
    "devices": {"prefill": "cpu", "decode": "cpu"},
    "ship_model": False,
}


class Method:
    """actor.method.remote(...) -> a ref: here, a call made when ray.get asks for it."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return lambda: self.fn(*args)


class FakeMember:
    def __init__(self, name: str, events: list, fails: list = ()):
        self.name, self.events, self.fails, self.keys = name, events, list(fails), None
        self.write_keys = Method(self._write)
        self.is_ready = Method(lambda: True)

    def _write(self, public):
        if self.fails:
            raise self.fails.pop(0)
        self.events.append(f"keys {self.name}")
        self.keys = public


def _get(ref, timeout=None):
    return [r() for r in ref] if isinstance(ref, list) else ref()


def restarting():
    return ray.exceptions.ActorUnavailableError("The actor is restarting", None)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s


@pytest.fixture
def controller(monkeypatch):
    """A controller with a frontend, prefill-0 and decode-0, whose placement and starts
    are recorded (events) instead of asked of Ray."""
    monkeypatch.setattr(ray_members.ray, "get", _get)
    monkeypatch.setattr(ray_members, "placement_group", lambda bundles, strategy: object())
    c = Controller(dict(OPTS))
    c.events, clock = [], Clock()
    c.clock, c.sleep = clock, clock.sleep
    monkeypatch.setattr(ray_members, "say", lambda line: None)
    ray_members.make_keys(c.key_dir, ["prefill-0", "decode-0"])

    def start(spec, group, bundle, res):
        c.events.append(f"start {spec['name']}")
        c.roles[spec["name"]] = spec["role"]
        c.members[spec["name"]] = FakeMember(spec["name"], c.events)
        c.groups[spec["name"]] = group

    monkeypatch.setattr(c, "_start", start)
    monkeypatch.setattr(
        c,
        "_place",
        lambda group, bundles, what, timeout_s, more="": c.events.append(f"place {what}"),
    )
    monkeypatch.setattr(c, "_wait_ready", lambda names, timeout_s: c.events.append("ready"))
    for name, role in (("frontend", "frontend"), ("prefill-0", "prefill"), ("decode-0", "decode")):
        c.roles[name], c.members[name] = role, FakeMember(name, c.events)
    yield c
    shutil.rmtree(c.key_dir, ignore_errors=True)


def test_keys_are_handed_only_to_the_clusters_members(controller):
    """Controller.keys_for handed every public key and a node's secret key to any Ray job
    that asked. Only a caller with the token the controller gave its members is answered."""
    with pytest.raises(PermissionError, match="only to the members"):
        controller.keys_for("prefill-0", "guessed")
    with pytest.raises(PermissionError):
        controller.keys_for("prefill-0", None)
    with pytest.raises(PermissionError, match="not a member"):
        controller.keys_for("decode-7", controller._token)
    keys = controller.keys_for("prefill-0", controller._token)
    assert "prefill-0.key_secret" in keys and "decode-0.key" in keys
    assert "decode-0.key_secret" not in keys


def test_scale_places_first_then_gives_keys_to_the_members_that_read_them(controller):
    """Scale up sent the new keys to every member before anything was placed. Now each
    new node is placed and started first, then its key goes to the members whose links
    read it: the other role's nodes, then the frontend (last: a node registers only once
    the frontend admits it)."""
    changes = controller.scale(1, 2, 30)
    assert changes["added"] == ["decode-1"] and changes["notes"] == []
    assert controller.events == [
        "place decode-1",
        "start decode-1",
        "keys prefill-0",
        "keys frontend",
        "ready",
    ]
    assert "decode-1.key" in controller.members["frontend"].keys
    controller.events.clear()
    controller.scale(2, 2, 30)
    assert controller.events == [
        "place prefill-1",
        "start prefill-1",
        "keys decode-0",
        "keys decode-1",
        "keys frontend",
        "ready",
    ]


def test_a_member_ray_is_starting_again_fails_no_scale(controller):
    """`pdserve scale` up failed with Ray's raw "The actor is restarting" whenever Ray was
    starting any member again. Such a member is asked again until it answers, each step
    said in a line; the node is added."""
    controller.members["prefill-0"].fails = [restarting(), restarting()]
    changes = controller.scale(1, 2, 30)
    assert changes["added"] == ["decode-1"]
    assert "decode-1.key" in controller.members["prefill-0"].keys
    said = "prefill-0 is being started again by Ray; giving it the new keys once it answers"
    assert len(changes["notes"]) == 1 and said in changes["notes"][0]
    assert controller.events.index("keys prefill-0") < controller.events.index("keys frontend")


def test_a_member_that_read_the_keys_at_its_start_or_never_answers_is_not_waited_for(controller):
    controller.members["prefill-0"].fails = [restarting()]
    controller.keys_read["prefill-0"] = controller.key_version + 1  # its start read them
    changes = controller.scale(1, 2, 30)
    assert changes["notes"] == [
        "prefill-0 is being started again by Ray; it read the new keys at its start"
    ]
    controller.members["prefill-0"].fails = [restarting()] * 100
    changes = controller.scale(1, 3, 5)
    assert changes["added"] == ["decode-2"] and "did not answer in 5s" in changes["notes"][-1]
    controller.members["prefill-0"].fails = [ray.exceptions.ActorDiedError()]
    changes = controller.scale(1, 4, 5)
    assert (
        changes["added"] == ["decode-3"]
        and "prefill-0 was not given the new keys: it is gone" in changes["notes"][-1]
    )


def test_no_room_for_a_new_node_still_gives_the_placed_ones_keys(controller, monkeypatch):
    def place(group, bundles, what, timeout_s, more=""):
        if what == "decode-2":
            raise RuntimeError(f"Ray found no room for {what}{more}")

    monkeypatch.setattr(controller, "_place", place)
    with pytest.raises(RuntimeError, match="no room for decode-2; added so far: decode-1"):
        controller.scale(1, 3, 30)
    assert "decode-1.key" in controller.members["frontend"].keys
    assert not (ray_members.Path(controller.key_dir) / "decode-2.key_secret").exists()


def test_only_the_other_role_and_the_frontend_read_a_new_nodes_key():
    assert ray_keys.needs_key("frontend", "decode") and ray_keys.needs_key("prefill", "decode")
    assert ray_keys.needs_key("decode", "prefill") and not ray_keys.needs_key("decode", "decode")


def test_pdserve_scale_says_a_ray_error_in_one_line(monkeypatch, capsys):
    """A Ray error from the controller (a member restarting, the controller gone) escaped
    `pdserve scale` as a traceback. It is one line, exit 1."""

    class FakeController:
        where = Method(lambda: {"frontend": {"endpoint": "tcp://h:5600"}, "decode-0": None})
        scale = Method(lambda *a: (_ for _ in ()).throw(restarting()))

    monkeypatch.setattr(ray_cluster, "has_ray", lambda prog: True)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "get_actor", lambda name: FakeController)
    monkeypatch.setattr(ray, "get", _get)
    rc = ray_cluster.scale(
        ["--endpoint", "tcp://h:5600", "--num-prefill", "1", "--num-decode", "2"]
    )
    err = capsys.readouterr().err
    assert (
        rc == 1
        and err.count("\n") == 1
        and err.startswith("pdserve scale: The actor")
        and "restarting" in err
    ), err
