"""The launcher's decisions, without a process: its options and plan (launch/cluster/plan.py),
and the supervisor (launch/cluster/supervisor.py) on a fake clock with stand-in processes:
restart backoff, a node that never becomes ready, a node that dies during start-up,
the frontend's death, and the stop order (drain first, SIGKILL last)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from launch.cluster import leftovers
from launch.cluster import plan as cluster_plan
from launch.cluster.plan import PlanError, make_plan, parse
from launch.cluster.supervisor import Backoff, Supervisor
from tests.handoff_util import FakeClock


class FakeProc:
    """A process that lives until told to exit (or ignores SIGTERM when stubborn)."""

    num = 0

    def __init__(self, argv: list[str], stubborn: bool = False):
        FakeProc.num += 1
        self.pid, self.argv, self.stubborn = 1000 + FakeProc.num, argv, stubborn
        self.returncode: int | None = None
        self.signals: list[int] = []

    def poll(self):
        return self.returncode

    def exit(self, code: int) -> None:
        self.returncode = code

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if not self.stubborn:
            self.returncode = -sig

    def kill(self) -> None:
        self.signals.append(signal.SIGKILL)
        self.returncode = -signal.SIGKILL

    def wait(self):
        return self.returncode


def _plan(*args: str, cores: int = 4):
    return make_plan(parse(list(args)), cores, Path("/home/x"))


def _supervisor(tmp_path, *args: str, ready=lambda plan, pid: True, stubborn=()):
    clock, spawned = FakeClock(), []

    def spawn(argv, env):
        p = FakeProc(argv, stubborn=argv[1] in stubborn)
        spawned.append(p)
        return p

    sup = Supervisor(
        _plan(*args), tmp_path, spawn=spawn, clock=clock, sleep=clock.advance, ask_frontend=ready
    )
    return sup, clock, spawned


def test_options_read_as_the_launcher_always_read_them():
    a = parse(
        [
            "--num-decode",
            "2",
            "--decode-arg",
            "--kv-cache-memory",
            "--decode-arg",
            "1MiB",
            "--kv-verify",
            "--max-num-seqs",
            "8",
            "--no-http",
        ]
    )
    assert (a.num_decode, a.decode_args, a.kv_verify, a.max_batch_size, a.no_http) == (
        "2",
        ["--kv-cache-memory", "1MiB"],
        True,
        "8",
        True,
    )
    for argv, why in (
        (["--model"], "--model needs a value"),
        (["--model", "--demo"], "--model needs a value"),
        (["--bogus"], "unknown option --bogus"),
    ):
        with pytest.raises(PlanError, match=why):
            parse(argv)


def test_the_plan_names_nodes_ports_and_threads():
    plan = _plan("--num-prefill", "2", "--name-prefix", "a-", "--base-port", "7000")
    assert [(n.name, n.role, n.kv) for n in plan.nodes] == [
        ("a-decode-0", "decode", "tcp://127.0.0.1:7002"),
        ("a-prefill-0", "prefill", ""),
        ("a-prefill-1", "prefill", ""),
    ]
    assert plan.ports == [7000, 7001, 8000, 7002] and plan.remote == []
    # 4 cores shared by the three cpu nodes: each may use all 4 when the others idle; the
    # decode node is owed an even share, the prefill nodes split what is left
    assert plan.threads == {"a-decode-0": 4, "a-prefill-0": 4, "a-prefill-1": 4}
    table = f"pdserve-cores-{os.getpid()}-7000"  # the launcher's pid: a killed one's table is swept
    assert plan.core_pools == {
        "a-decode-0": f"{table}:4:1",
        "a-prefill-0": f"{table}:4:1",
        "a-prefill-1": f"{table}:4:1",
    }
    argv = cluster_plan.node_argv(plan, plan.nodes[1])
    assert argv[argv.index("--core-pool") + 1] == f"{table}:4:1"
    assert (
        _plan(
            "--num-prefill", "2", "--name-prefix", "a-", "--base-port", "7000", "--core-sharing"
        ).core_pools
        == plan.core_pools
    )
    fixed = _plan("--num-prefill", "2", "--no-core-sharing")
    assert fixed.core_pools == {} and fixed.threads == {
        "decode-0": 1,
        "prefill-0": 2,
        "prefill-1": 2,
    }
    gpu = _plan("--prefill-devices", "cuda:0,cuda:1", "--decode-device", "cpu")
    assert gpu.threads == {"decode-0": 4, "prefill-0": 1, "prefill-1": 1} and gpu.core_pools == {}
    argv = cluster_plan.node_argv(plan, plan.nodes[0])
    assert (
        argv[:2] == ["-m", "decode_node"]
        and argv[argv.index("--kv-bind") + 1] == "tcp://127.0.0.1:7002"
    )
    joined = _plan(
        "--join", "tcp://10.0.0.1:5601", "--no-keys", "--num-prefill", "0", "--host", "10.0.0.2"
    )
    assert (
        joined.ports == [5602]
        and joined.remote == ["--allow-remote"]
        and joined.node_link == "tcp://10.0.0.1:5601"
    )


@pytest.mark.parametrize(
    "args,why",
    [
        (("--base-port", "x"), "--base-port needs a port number"),
        (("--num-prefill", "2", "--prefill-devices", "cpu,cpu"), "give --num-prefill with one"),
        (
            ("--join", "tcp://a:1", "--num-prefill", "0", "--num-decode", "1"),
            "--join needs --keys DIR",
        ),
        (
            ("--join", "tcp://a:1", "--no-keys", "--num-prefill", "0", "--num-decode", "0"),
            "no node to start",
        ),
        (("--name-prefix", "a b"), "--name-prefix takes"),
    ],
)
def test_bad_plans_are_one_line(args, why):
    with pytest.raises(PlanError, match=why):
        _plan(*args)


def test_backoff_doubles_to_thirty_seconds_and_starts_over_after_a_stable_run():
    b = Backoff()
    assert [b.after_exit(1.0) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert b.after_exit(60.0) == 1 and b.after_exit(5.0) == 2


def test_a_node_that_dies_is_restarted_after_its_backoff(tmp_path):
    sup, clock, spawned = _supervisor(tmp_path)
    sup.start_frontend()
    for n in sup.plan.nodes:
        sup.start_node(n)
    decode = sup.procs["decode-0"]
    decode.exit(9)
    assert sup.turn() is None and "decode-0" in sup.restart_at and sup.procs["decode-0"] is decode
    clock.advance(0.5)
    assert sup.turn() is None and sup.procs["decode-0"] is decode  # 1 s not over yet
    clock.advance(0.6)
    assert sup.turn() is None and sup.procs["decode-0"] is not decode  # started again
    sup.procs["decode-0"].exit(9)
    sup.turn()
    assert sup.restart_at["decode-0"] == pytest.approx(clock.now + 2)  # then 2 s


def test_without_restarts_or_without_the_frontend_the_cluster_stops(tmp_path):
    sup, _, _ = _supervisor(tmp_path, "--no-restart-nodes")
    sup.start_frontend()
    for n in sup.plan.nodes:
        sup.start_node(n)
    sup.procs["prefill-0"].exit(1)
    assert sup.turn() == 1
    sup, _, _ = _supervisor(tmp_path)
    sup.start_frontend()
    for n in sup.plan.nodes:
        sup.start_node(n)
    sup.frontend.exit(0)
    assert sup.turn() == 1


def test_readiness_is_every_node_registered_or_a_clear_reason(tmp_path):
    sup, clock, _ = _supervisor(tmp_path, "--num-decode", "2")
    sup.start_frontend()
    for n in sup.plan.nodes:
        sup.start_node(n)
    (tmp_path / "decode-0").touch()  # decode-1 and prefill-0 never register
    assert sup.wait_ready(30) == "not ready after 30s; stopping" and clock.now >= 1030
    for n in sup.plan.nodes:
        (tmp_path / n.name).touch()
    assert sup.wait_ready(30) is None
    asked = _supervisor(tmp_path, ready=lambda plan, pid: False)[
        0
    ]  # the frontend does not have them
    asked.start_frontend()
    assert asked.wait_ready(5).startswith("not ready")
    dying, _, _ = _supervisor(tmp_path / "x")
    (tmp_path / "x").mkdir()
    dying.start_frontend()
    for n in dying.plan.nodes:
        dying.start_node(n)
    dying.procs["decode-0"].exit(2)
    assert "decode-0 (pid" in dying.wait_ready(
        30
    ) and "exited with code 2 during start-up" in dying.wait_ready(30)


def test_stop_drains_the_frontend_first_and_kills_what_does_not_stop(tmp_path):
    sup, clock, spawned = _supervisor(tmp_path, "--drain-timeout", "5", stubborn=("prefill_node",))
    sup.start_frontend()
    for n in sup.plan.nodes:
        sup.start_node(n)
    t0 = clock.now
    sup.stop(5.0)
    frontend, decode, prefill = sup.frontend, sup.procs["decode-0"], sup.procs["prefill-0"]
    assert frontend.signals == [signal.SIGTERM] and decode.signals == [signal.SIGTERM]
    assert prefill.signals == [signal.SIGTERM, signal.SIGKILL]  # it ignored SIGTERM for the grace
    assert clock.now - t0 >= 10 and all(p.poll() is not None for p in spawned)


def test_core_tables_of_launchers_gone_are_swept_and_ours_removed_at_exit():
    gone = 2**22 + 1  # past the kernel's largest pid: runs nowhere
    dead, live = (
        Path(f"/dev/shm/pdserve-cores-{gone}-7100"),
        Path(f"/dev/shm/pdserve-cores-{os.getpid()}-7101"),
    )
    for f in (dead, live):
        f.write_bytes(b"\0" * 64)
    try:
        leftovers.remove_leftovers()
        assert not dead.exists() and live.exists()  # another launcher's, still running: kept
        plan = _plan("--base-port", "7101")
        assert set(plan.core_pools.values()) == {
            f"{live.name}:4:2"
        }  # 1 prefill + 1 decode on 4 cores
        leftovers.remove_core_tables(plan)
        assert not live.exists()
    finally:
        dead.unlink(missing_ok=True)
        live.unlink(missing_ok=True)
