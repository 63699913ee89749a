"""What an operator reads: every log line names its process, idle processes stay quiet,
the frontend's periodic line, the HTTP access log, each response's server-side phases,
a drain that says what happens, the launcher's checks before it starts anything, and a
client with nothing to do. In this process; the same seen in a cluster's log:
tests/cluster/test_operator_cluster.py."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import pytest

from common.base import log as pdlog
from common.base.log import get_logger


@pytest.fixture
def stderr(capsys):
    """What pdserve's loggers write (to whatever sys.stderr is when a line is logged)."""
    yield capsys
    if hasattr(pdlog, "set_name"):
        pdlog.set_name(None)


def _lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def _messages(capsys) -> list[str]:
    """Each logged line's message: past its time, name and level."""
    return _messages_of(_lines(capsys))


def _messages_of(lines: list[str]) -> list[str]:
    return [m[1] for line in lines if (m := re.match(r"\d\S+ \S+ +[A-Z]+ (.*)", line))]


def test_every_line_names_its_process_and_the_part_that_spoke(stderr):
    """Defect: lines carried the role, so two decode nodes' lines could not be told apart."""
    from common.base.log import set_name

    set_name("decode-1")
    get_logger("decode").info("16 tok/s")
    get_logger("transfer").info("a write")
    set_name("frontend")
    get_logger("frontend").info("serving")
    names = [line.split()[1] for line in _lines(stderr)]
    assert names == ["decode-1", "decode-1/transfer", "frontend"]


def test_a_message_is_one_line_whatever_text_a_client_put_in_it(stderr):
    """Review: a field's name a client chose reached the frontend's log in an error
    ("x\n<a line of its own> holds more than N items"). Every message is one line, its
    controls written escaped; a traceback follows it behind a bar, so an exception's text
    that quotes a client's cannot pass for a line of its own either."""
    set_name = pdlog.set_name
    set_name("frontend")
    log = get_logger("frontend")
    log.info("rejected request %s: %s", "r1", "x\n12:00:00.000 frontend  ERROR forged\u2028")
    try:
        raise ValueError("bad name 'y\n12:00:00.000 frontend  ERROR forged'")
    except ValueError:
        log.exception("a fault\r")
    lines = _lines(stderr)
    assert lines[0].endswith("rejected request r1: x\\n12:00:00.000 frontend  ERROR forged\\u2028")
    assert lines[1].endswith("ERROR a fault\\r")
    assert lines[2] == "| Traceback (most recent call last):"
    assert lines[-2:] == ["| ValueError: bad name 'y", "| 12:00:00.000 frontend  ERROR forged'"]
    assert len(_messages_of(lines)) == 2  # the two logged, no third


def test_a_nodes_periodic_line_is_due_each_interval_and_said_while_busy():
    """The first look is due at once (0 s elapsed), then one each interval, its seconds those
    since the last; an idle node says one line as it goes idle, then none."""
    from common.runtime.report_line import PeriodicLine

    now, said = [100.0], []
    line = PeriodicLine(SimpleNamespace(info=lambda fmt, s: said.append(s)), 10.0, lambda: now[0])
    looks = []
    for t, is_busy in ((100, True), (105, True), (110, True), (125, False), (130, False)):
        now[0] = t
        if (elapsed := line.due_s()) is not None:
            looks.append(elapsed)
            line.say(is_busy, f"at {t}")
    assert looks == [0.0, 10.0, 15.0] and said == ["at 100", "at 110", "at 125"]


def test_an_idle_process_says_one_line_as_it_becomes_idle_then_nothing():
    """Defect: every node logged a zero line every 10 s while idle."""
    from common.base.log import IdleQuiet
    from common.runtime import report_line

    quiet = IdleQuiet()
    said = [quiet.says(busy) for busy in (False, False, True, True, False, False, False, True)]
    assert said == [False, False, True, True, True, False, False, True]
    idle = {
        "num_running": 0,
        "num_queued": 0,
        "num_preempted": 0,
        "num_preemptions": 0,
        "num_free_blocks": 100,
        "num_usable_blocks": 100,
        "num_reserved_blocks": 0,
    }
    is_busy, line = report_line.decode(idle, 0, 0, 10.0)
    assert not is_busy and line.endswith("| idle now") and "free blocks 100/100" in line
    is_busy, line = report_line.decode({**idle, "num_running": 3}, 160, 10, 10.0)
    assert is_busy and line.startswith("16 tok/s, 16.0 avg batch | running 3")
    is_busy, _ = report_line.prefill(
        {
            "num_waiting": 0,
            "num_unreserved": 0,
            "num_prefilling": 0,
            "num_pending_handoffs": 0,
            "num_free_blocks": 5,
            "num_usable_blocks": 5,
        },
        0,
        10.0,
    )
    assert not is_busy


def _node(name, role, pid=1, **stats):
    return SimpleNamespace(
        name=name, role=role, is_alive=True, stats=stats, ready=SimpleNamespace(pid=pid)
    )


def test_the_frontend_says_one_periodic_line_like_vllms(stderr):
    """Defect: no line with the request rate, running and waiting, KV usage and the
    prefix-cache hit rate; and nothing but silence once idle."""
    from frontend.activity import ActivityLog

    prefill = _node(
        "prefill-0",
        "prefill",
        num_prefill_tokens=0,
        num_prefix_hit_tokens=0,
        num_prefix_prompt_tokens=0,
    )
    decode = _node(
        "decode-0", "decode", num_decode_rows=0, num_usable_blocks=200, num_available_blocks=150
    )
    fe = SimpleNamespace(
        nodes={"prefill-0": prefill, "decode-0": decode},
        num_served=0,
        requests={"a": 1, "b": 2, "c": 3},
        admission=SimpleNamespace(num_waiting=1),
    )
    act = ActivityLog(fe, 10.0)
    act.tick(0.0)
    fe.num_served = 20
    prefill.stats.update(
        num_prefill_tokens=5000, num_prefix_hit_tokens=1000, num_prefix_prompt_tokens=4000
    )
    # 700 rows stepped, 100 drafts accepted in verify steps: 800 tokens made
    decode.stats.update(num_decode_rows=700, num_accepted_tokens=100)
    act.tick(5.0)  # not an interval yet
    act.tick(10.0)
    assert _messages(stderr) == [
        "2.00 req/s | running 2, waiting 1 | prompt 500 tok/s, generation 80 tok/s | KV cache "
        "25.0% used | prefix-cache hit rate 25.0%"
    ]
    fe.requests, fe.admission.num_waiting = {}, 0
    for now in (20.0, 30.0, 40.0):
        act.tick(now)
    lines = _messages(stderr)
    assert len(lines) == 1 and lines[0].endswith("| idle now")
    decode.ready.pid = 2  # restarted: counts from its start
    decode.stats.update(num_decode_rows=80, num_accepted_tokens=20)
    fe.num_served = 21
    act.tick(50.0)
    assert "generation 10 tok/s" in _messages(stderr)[-1]
    # a heartbeat without one of the keys leaves it as it was: no restart read, no spike
    del decode.stats["num_accepted_tokens"]
    decode.stats["num_decode_rows"] = 180
    fe.num_served = 22
    act.tick(60.0)
    assert "generation 10 tok/s" in _messages(stderr)[-1]
    decode.stats.update(num_decode_rows=280, num_accepted_tokens=20)
    fe.num_served = 23
    act.tick(70.0)
    assert "generation 10 tok/s" in _messages(stderr)[-1]


def test_the_access_log_says_each_request_and_can_be_turned_off(stderr):
    """Defect: no access log for HTTP requests."""
    from frontend.access_log import AccessLog, log, set_access_log

    request = SimpleNamespace(
        remote="127.0.0.1", method="POST", version=(1, 1), raw_path="/v1/completions?x=\x1b[2J\n"
    )
    access = AccessLog(log, "")
    try:
        assert access.enabled
        access.log(request, SimpleNamespace(status=200), 0.0123)
        set_access_log(False)
        assert not access.enabled
    finally:
        set_access_log(True)
    assert _messages(stderr) == ['127.0.0.1 "POST /v1/completions?x=?[2J? HTTP/1.1" 200 12.3 ms']


def test_a_whole_response_says_where_its_time_went():
    """Defect: clients (AIPerf, GuideLLM) could not see the server's phases of a request."""
    from frontend.server_timing import headers, with_decode

    t = {
        "queue_ms": 0.5,
        "prefill_ms": 31.25,
        "kv_transfer_ms": 2.0,
        "decode_admission_ms": 0.1,
        "ttft_ms": 40.0,
        "total_ms": 140.0,
        "path": "disaggregated",
    }
    assert headers(t) == {
        "Server-Timing": "queue;dur=0.500, prefill;dur=31.250, "
        "kv_transfer;dur=2.000, decode_admission;dur=0.100, "
        "decode;dur=100.000, total;dur=140.000"
    }
    assert with_decode(t)["decode_ms"] == 100.0 and headers(None) == {}
    assert headers({"queue_ms": "x", "total_ms": True}) == {}


def test_a_drain_of_the_only_decode_node_says_its_requests_finish_there():
    """Defect: draining the only decode node said "0 requests moving to other nodes"
    while its streams went on there."""
    from frontend.cli import drain_summary
    from frontend.migrate import Migrations

    class Link:
        async def send(self, msg, to):
            pass

    node = SimpleNamespace(
        name="decode-0", role="decode", is_alive=True, is_draining=False, identity=b"d"
    )
    reqs = {
        str(i): SimpleNamespace(decode_node="decode-0", num_migrations=0, output_ids=[1])
        for i in range(3)
    }
    cfg = SimpleNamespace(
        client_endpoint="tcp://127.0.0.1:5600", is_client_auth=False, max_migrations=3
    )
    fe = SimpleNamespace(
        cfg=cfg,
        nodes={"decode-0": node},
        requests=reqs,
        node_link=Link(),
        wake_dispatch=lambda: None,
    )
    reply, _ = asyncio.run(Migrations(fe).on_drain_request("decode-0"))
    assert (reply.num_moved, reply.num_staying, reply.has_peer) == (0, 3, False)
    assert drain_summary(reply) == (
        "draining decode-0: 0 requests moving to other nodes, 3 finishing there (no other live "
        "node of its role: new requests are refused until one is ready); it stops once empty"
    )


def test_a_client_with_nothing_to_do_says_so(capsys):
    """Defect: `pdserve client` with neither --prompt nor --stats exited 0, silently."""
    from frontend import cli

    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2 and "nothing to do: give --prompt" in capsys.readouterr().err


# ---- the launcher checks before it starts anything ------------------------------------


def test_the_launcher_refuses_a_bad_model_in_one_line_before_any_process(
    monkeypatch, capsys, tmp_path
):
    """Defect: a wrong --model started every process, each printing the same error."""
    from launch import start_cluster

    monkeypatch.setattr(start_cluster, "Supervisor", None)  # nothing may be started
    assert start_cluster.main(["--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"start_cluster: no model directory at {tmp_path / 'missing'}: give --model a "
        f"directory holding config.json and the weights"
    ]


def test_the_launcher_refuses_a_cluster_this_host_cannot_hold(monkeypatch, tiny_model):
    """Defect: nothing checked the host's memory before the nodes loaded the model."""
    from launch.cluster import memory_check, preflight
    from launch.cluster import plan as cluster_plan

    a = cluster_plan.parse(
        ["--model", str(tiny_model), "--num-decode", "2", "--kv-cache-memory", "3GiB"]
    )
    plan = cluster_plan.make_plan(a, 2, tiny_model.parent)
    monkeypatch.setattr(memory_check, "available_bytes", lambda: 8 * memory_check.GIB)
    why = preflight.memory_refusal(plan)
    assert why.startswith("3 cpu node(s) of") and "needs ~9.0 GiB" in why
    assert "8.0 GiB is available" in why
    assert "--kv-cache-memory" in why
    monkeypatch.setattr(memory_check, "available_bytes", lambda: 10 * memory_check.GIB)
    assert preflight.memory_refusal(plan) is None


def test_the_launcher_warns_of_a_cluster_that_cannot_serve(tiny_model):
    """Defect: --num-decode 0 reported ready, with nothing able to decode, and no warning."""
    from launch.cluster import plan as cluster_plan
    from launch.cluster import preflight

    def warnings(*args):
        a = cluster_plan.parse(["--model", str(tiny_model), *args])
        return preflight.role_warnings(cluster_plan.make_plan(a, 2, tiny_model.parent))

    assert warnings() == []
    (line,) = warnings("--num-decode", "0")
    assert line.startswith("no decode node (--num-decode 0): every request is refused until one")
    assert len(warnings("--num-decode", "0", "--num-prefill", "0")) == 2
    assert warnings("--num-decode", "0", "--join", "tcp://10.0.0.1:5601", "--no-keys") == []


def test_the_launcher_passes_no_access_log_on(tmp_path):
    """Defect: no way to turn the (new) access log off from the launcher."""
    from launch.cluster import plan as cluster_plan

    cases = (([], False), (["--no-access-log"], True), (["--no-access-log", "--access-log"], False))
    for args, is_off in cases:
        plan = cluster_plan.make_plan(cluster_plan.parse(["--model", "m", *args]), 2, tmp_path)
        assert ("--no-access-log" in cluster_plan.frontend_argv(plan)) == is_off, args


def test_a_kv_link_made_again_warns_only_when_it_cut_a_handoff_under_way(stderr):
    """Defect: an ordinary drain logged a WARNING about a KV link "made again": the
    drained node came back, and the asks in flight were simply asked again."""
    from common.handoff.links import say_reset
    from common.handoff.states import Stage

    asking, reserved = SimpleNamespace(stage=Stage.ASKING), SimpleNamespace(stage=Stage.RESERVED)
    say_reset("the KV link to decode-0 was made again", "asking again for", [], False)
    say_reset("the KV link to decode-0 was made again", "asking again for", [asking], False)
    say_reset("the KV link's data connection to d was made again", "checking", [reserved], True)
    assert [line.split()[2] for line in _lines(stderr)] == ["INFO"] * 3
    say_reset(
        "the KV link to decode-0 was made again", "asking again for", [asking, reserved], False
    )
    (line,) = _lines(stderr)
    assert " WARNING " in line and "(1 under way); if this recurs, check the network" in line


def test_loading_a_checkpoint_says_each_shard_as_it_is_read(stderr, make_model):
    """Defect: nothing was printed while a model loaded (a 14B model would be silent up to
    the launcher's ready timeout)."""
    import torch

    from common.base.model_spec import load_spec
    from common.engine.loader import load_weights

    model = make_model(max_shard_size="100KB")
    num_shards = len(list(model.glob("*.safetensors")))
    _lines(stderr)  # what making it wrote
    load_weights(model, load_spec(model), torch.device("cpu"), torch.float32)
    lines = _messages(stderr)
    assert num_shards > 1 and len(lines) == num_shards + 1, lines
    assert all(
        re.fullmatch(
            rf"read weights {i + 1}/{num_shards} \(\S+\.safetensors\): "
            rf"[\d.]+ [MG]B in [\d.]+s",
            line,
        )
        for i, line in enumerate(lines[:-1])
    )
    assert re.fullmatch(r"weights on cpu in float32: [\d.]+s in all", lines[-1])


def test_stats_show_a_speculating_decode_nodes_accepted_drafts():
    from common.wire.client import StatsReply
    from frontend.cli import format_stats

    spec = {"num_drafted_tokens": 40, "num_accepted_tokens": 25, "mean_accepted_len": 2.25}
    nodes = {
        "decode-0": {"role": "decode", "is_alive": True, **spec},
        "prefill-0": {"role": "prefill", "is_alive": True},
    }
    lines = format_stats(StatsReply(True, nodes)).splitlines()
    assert "drafts accepted" in lines[0]
    row = next(line for line in lines if line.startswith("decode-0"))
    assert row.endswith("25/40 (2.25 a step)")
    assert "a step" not in next(line for line in lines if line.startswith("prefill-0"))
