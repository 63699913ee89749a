"""pdserve on Ray (launch/ray/cluster.py, launch/ray/members.py): a Ray cluster over three
simulated hosts (launch/tools/netns.py; `ray start` in each, as Ray documents), and
`start_cluster.sh --ray` driving it from host a."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.cluster_util import ROOT, wait_for
from tests.conftest import clear_prompts

RAY_CLI = os.path.join(os.path.dirname(sys.executable), "ray")
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # A machine whose raylet is gone counts as dead after about 3 s (Ray's default: 15 s+).
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_initial_delay_ms": "1000",
}


@pytest.mark.cluster
def test_the_single_machine_path_never_imports_ray():
    code = (
        "import sys, launch.start_cluster, launch.cli, frontend.__main__, prefill_node.__main__, "
        "decode_node.__main__; print('ray' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


@pytest.mark.cluster
def test_serve_ray_without_ray_installed_says_so_in_one_line(tmp_path):
    (tmp_path / "ray.py").write_text(
        "raise ImportError('no ray here')\n"
    )  # shadows an installed one
    out = subprocess.run(
        ["bash", str(ROOT / "launch/start_cluster.sh"), "--ray", "--no-http"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"},
    )
    assert out.returncode == 2 and "--ray needs Ray" in out.stderr, out.stderr[-2000:]


def _env() -> dict:
    return {**os.environ, **RAY_ENV, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}


def _ray(hosts, name: str, ray_dir, *args: str, hide: str = "") -> None:
    """`ray start` on host name; hide: a directory that host's Ray (and all it starts)
    sees empty (a tmpfs over it, in that host's mount namespace alone)."""
    over = ["sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@"', hide] if hide else []
    out = hosts.run(
        name,
        [
            *over,
            RAY_CLI,
            "start",
            "--node-ip-address",
            hosts.addr(name),
            "--num-cpus",
            "2",
            "--object-store-memory",
            "80000000",
            "--temp-dir",
            str(ray_dir / name),
            "--disable-usage-stats",
            *args,
        ],
        timeout_s=180,
        cwd=ROOT,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]


def _client(hosts, endpoint: str, *args: str, timeout_s: float = 180) -> dict:
    out = hosts.run(
        "a",
        [sys.executable, "-m", "tests.netns_client", endpoint, *args],
        timeout_s=timeout_s,
        cwd=ROOT,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _placed(log_path) -> dict[str, str]:
    """name -> hostname, from the ready line."""
    text = log_path.read_text(errors="replace")
    line = next(x for x in text.splitlines() if "ready in" in x)
    return dict(re.findall(r"([a-z]+(?:-\d+)?) on (host-[abc]) \(", line))


def _where(hosts, head: str) -> dict:
    """name -> hostname of every member now, asked of the controller from a fresh driver."""
    code = (
        "import json, ray; ray.init(address=%r, namespace='pdserve', log_to_driver=False); "
        "w = ray.get(ray.get_actor('pdserve:5600').where.remote()); "
        "print(json.dumps({n: (x or {}).get('hostname') for n, x in w.items()}))" % head
    )
    out = hosts.run("a", [sys.executable, "-c", code], timeout_s=120, cwd=ROOT, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _pdserve_pids() -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", r"-m (frontend|prefill_node|decode_node) "], capture_output=True, text=True
    )
    return [int(p) for p in out.stdout.split()]


@pytest.mark.hosts
@pytest.mark.cluster
def test_serve_on_ray_over_three_hosts_restarts_scales_and_stops_clean(
    tiny_model, tmp_path, monkeypatch
):
    """`start_cluster.sh --ray` on host a of a three-host Ray cluster: the frontend and a
    prefill node on one host, a decode node on each other host; exact tokens. Host b's
    every process killed mid-stream: its requests move and finish exactly, Ray starts its
    decode node again on a host still up, and follow-ups are exact. `pdserve scale` up
    and down under load: no request fails. SIGINT: no actor, process or key is left."""
    pytest.importorskip("ray")
    from launch.tools import netns as netns_util

    why = netns_util.why_not()
    if why:
        pytest.skip(why)
    assert not _pdserve_pids(), "another cluster runs here"
    monkeypatch.setenv(
        "PDSERVE_HOME", str(tmp_path / "home")
    )  # where members keep the model they fetch
    candidates = [[(13 * i + j) % 500 + 1 for j in range(6 + i)] for i in range(16)]
    prompts, expected = clear_prompts(tiny_model, candidates, 12, 8)
    # NOTE: Ray's sockets live under its temp dir, and a socket's path is at most 107 bytes.
    ray_dir = Path(tempfile.mkdtemp(prefix="pdsray-"))
    with netns_util.Hosts(["a", "b", "c"]) as hosts, contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, ray_dir, True)
        head = f"{hosts.addr('a')}:6379"
        started = time.monotonic()
        _ray(hosts, "a", ray_dir, "--head", "--port", "6379", "--include-dashboard=false")
        for name in (
            "b",
            "c",
        ):  # the model is on host a alone: the others fetch it (--ray-ship-model)
            _ray(hosts, name, ray_dir, "--address", head, hide=str(tiny_model))
        ray_up_s = time.monotonic() - started
        # Starts that cannot succeed fail in one line: the model not on a decode node's host, and
        # a node that exits at once (Ray would start it for ever).
        for extra, why in (
            (["--decode-arg", "--no-such-flag"], "decode-0: the model directory "),
            (
                ["--ray-ship-model", "--decode-arg", "--no-such-flag"],
                "decode-0 exited 3 times while starting",
            ),
        ):
            out = hosts.run(
                "a",
                [
                    "bash",
                    str(ROOT / "launch/start_cluster.sh"),
                    "--ray",
                    head,
                    "--model",
                    str(tiny_model),
                    "--no-http",
                    *extra,
                ],
                timeout_s=180,
                cwd=ROOT,
                env=_env(),
            )
            assert out.returncode == 1 and out.stdout == "", out.stderr[-3000:]
            assert f"[pdserve] not ready: {why}" in out.stderr, out.stderr[-3000:]
            wait_for(lambda: not _pdserve_pids(), 30, "nothing left of the failed start")
        log = tmp_path / "driver.log"
        started = time.monotonic()
        driver = hosts.popen(
            "a",
            [
                "bash",
                str(ROOT / "launch/start_cluster.sh"),
                "--ray",
                head,
                "--model",
                str(tiny_model),
                "--ray-ship-model",
                "--num-prefill",
                "1",
                "--num-decode",
                "2",
                "--no-http",
                "--kv-cache-memory",
                "8MiB",
                "--kv-transfer",
                "tcp",
                "--ready-timeout",
                "240",
            ],
            stdout=subprocess.PIPE,
            stderr=open(log, "wb"),
            cwd=ROOT,
            env=_env(),
        )
        line = driver.stdout.readline().decode().strip()
        assert line.startswith("PDSERVE_ENDPOINT=tcp://198.18.0."), log.read_text()[-4000:]
        print(
            f"ray up in {ray_up_s:.1f}s; pdserve ready on it in {time.monotonic() - started:.1f}s"
        )
        endpoint = line.split("=", 1)[1]
        # NOTE: an actor's lines reach the driver's log through Ray's log monitor, on its own
        # time: one may come after the driver has said it is ready.
        wait_for(
            lambda: (
                len(
                    re.findall(
                        r"decode-\d: the model copied to .* \(\d+\.\d MiB fetched", log.read_text()
                    )
                )
                == 2
            ),
            30,
            "both decode nodes' model copies logged",
        )
        placed = _placed(log)
        assert placed["frontend"] == placed["prefill-0"] == "host-a", placed  # the Ray head
        assert {placed["decode-0"], placed["decode-1"], placed["frontend"]} == {
            "host-a",
            "host-b",
            "host-c",
        }, placed

        results = _client(hosts, endpoint, "complete", json.dumps(prompts), "12")["results"]
        assert [r["tokens"] for r in results] == expected and all(
            r["error"] is None for r in results
        )
        stats = _client(hosts, endpoint, "stats")  # each process says its own host too
        assert {n: s["host"] for n, s in stats["nodes"].items()} == {
            n: placed[n] for n in stats["nodes"]
        }
        assert stats["frontend"]["host"] == "host-a"

        # decode-0's host gone: every process in its namespace killed (Ray's too) mid-stream.
        lost = placed["decode-0"].removeprefix("host-")
        streams = hosts.popen(
            "a",
            [
                sys.executable,
                "-m",
                "tests.netns_client",
                endpoint,
                "streams",
                json.dumps([[i + 1] * 9 for i in range(8)]),
                "400",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=_env(),
        )
        assert json.loads(streams.stdout.readline())["started"]
        pids = subprocess.run(
            ["ip", "netns", "pids", hosts.ns(lost)], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)
        out, err = streams.communicate(timeout=180)
        rows = json.loads(out.strip().splitlines()[-1])["results"]
        assert all(r["reason"] == "length" and len(r["tokens"]) == 400 for r in rows), rows
        assert sum(r["num_migrations"] for r in rows) >= 1
        wait_for(
            lambda: (_where(hosts, head).get("decode-0") or f"host-{lost}") != f"host-{lost}",
            120,
            "decode-0 started again on a host still up",
            1,
        )
        wait_for(
            lambda: _client(hosts, endpoint, "stats")["nodes"].get("decode-0", {}).get("is_alive"),
            120,
            "decode-0 registered again",
            1,
        )
        results = _client(hosts, endpoint, "complete", json.dumps(prompts), "12")["results"]
        assert [r["tokens"] for r in results] == expected

        # A cluster no `serve --ray` placed: said in one line.
        out = hosts.run(
            "a",
            [
                sys.executable,
                "-m",
                "launch.cli",
                "scale",
                "--endpoint",
                "tcp://198.18.0.1:5990",
                "--ray",
                head,
                "--num-prefill",
                "1",
                "--num-decode",
                "1",
            ],
            timeout_s=120,
            cwd=ROOT,
            env=_env(),
        )
        assert (
            out.returncode == 1
            and "no cluster placed by pdserve serve --ray at tcp://198.18.0.1:5990" in out.stderr
        ), out.stderr[-3000:]

        # Scale past what Ray has room for (one CPU is free now, on the hosts left): the node
        # that fits is added, the next is refused in one line.
        out = hosts.run(
            "a",
            [
                sys.executable,
                "-m",
                "launch.cli",
                "scale",
                "--endpoint",
                endpoint,
                "--ray",
                head,
                "--num-prefill",
                "1",
                "--num-decode",
                "4",
                "--timeout",
                "5",
            ],
            timeout_s=120,
            cwd=ROOT,
            env=_env(),
        )
        assert out.returncode == 1 and "Ray found no room for decode-3" in out.stderr, out.stderr[
            -3000:
        ]
        assert "added so far: decode-2\n" in out.stderr, out.stderr[-3000:]

        # The lost host back (a machine joins), then scale up and down under load: nothing fails.
        _ray(hosts, lost, ray_dir, "--address", head, hide=str(tiny_model))
        load = hosts.popen(
            "a",
            [
                sys.executable,
                "-m",
                "tests.netns_client",
                endpoint,
                "streams",
                json.dumps([[i + 2] * 7 for i in range(6)]),
                "600",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=_env(),
        )
        assert json.loads(load.stdout.readline())["started"]
        for counts in (("1", "4"), ("1", "1")):
            out = hosts.run(
                "a",
                [
                    sys.executable,
                    "-m",
                    "launch.cli",
                    "scale",
                    "--endpoint",
                    endpoint,
                    "--ray",
                    head,
                    "--num-prefill",
                    counts[0],
                    "--num-decode",
                    counts[1],
                    "--timeout",
                    "150",
                ],
                timeout_s=300,
                cwd=ROOT,
                env=_env(),
            )
            assert out.returncode == 0, out.stderr[-3000:]
        out, err = load.communicate(timeout=240)
        rows = json.loads(out.strip().splitlines()[-1])["results"]
        assert all(r["error"] is None and len(r["tokens"]) == 600 for r in rows), rows
        nodes = _client(hosts, endpoint, "stats")["nodes"]
        alive = sorted(
            n for n, s in nodes.items() if s.get("is_alive") and not s.get("is_draining")
        )
        assert alive == ["decode-0", "prefill-0"], nodes.keys()
        results = _client(hosts, endpoint, "complete", json.dumps(prompts), "12")["results"]
        assert [r["tokens"] for r in results] == expected

        driver.send_signal(signal.SIGINT)
        assert driver.wait(120) == 128 + signal.SIGINT, log.read_text()[-3000:]
        wait_for(lambda: not _pdserve_pids(), 30, "every pdserve process gone")
        # Nothing of ours is left on Ray: every CPU free, every placement group removed,
        # the controller's name gone.
        code = (
            "import json, time, ray\n"
            "ray.init(address=%r, namespace='pdserve', log_to_driver=False)\n"
            "for _ in range(60):\n"
            "    free = ray.available_resources().get('CPU')\n"
            "    total = ray.cluster_resources().get('CPU')\n"
            "    if free == total: break\n"
            "    time.sleep(0.5)\n"
            "groups = [g['state'] for g in ray.util.placement_group_table().values()]\n"
            "try:\n    ray.get_actor('pdserve:5600'); named = True\n"
            "except ValueError:\n    named = False\n"
            "print(json.dumps([free, total, groups, named]))" % head
        )
        out = hosts.run("a", [sys.executable, "-c", code], timeout_s=120, cwd=ROOT, env=_env())
        assert out.returncode == 0, out.stderr[-3000:]
        free, total, groups, named = json.loads(out.stdout.strip().splitlines()[-1])
        assert free == total == 6 and set(groups) <= {"REMOVED"} and not named, (
            free,
            total,
            groups,
            named,
        )
        for name in ("c", "b", "a"):
            hosts.run(name, [RAY_CLI, "stop", "--force"], cwd=ROOT, env=_env())
    assert not netns_util.leftover_namespaces()
