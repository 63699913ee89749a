"""The nixl backend against a decode process of its own: a decode process that dies fails
the next write with NIXL's reason, and one that freezes leaves a write that cancelling ends
(the backends in one process: tests/unit/test_handoff.py)."""

import time

import pytest
import torch

from common import transfer
from common.wire import protocol
from tests.unit.test_handoff import _wire, needs_nixl

NIXL_DECODE = """
import base64, json, sys, time, torch
from common import transfer
cache = torch.zeros(2, 2, 9, 4, 1, 8)
r = transfer.backend("nixl").open_receiver(transfer.LocalCache(cache, "127.0.0.1"))
d = r.describe()
print(json.dumps({**d, "metadata": base64.b64encode(d["metadata"]).decode()}), flush=True)
while True:
    r.progress()
    time.sleep(0.001)
"""


def _poll_until(writer, timeout_s: float = 20.0) -> list:
    deadline, out = time.monotonic() + timeout_s, []
    while not out and time.monotonic() < deadline:
        out = writer.poll()
    return out


@pytest.mark.cluster
@needs_nixl
def test_a_nixl_write_to_a_dead_decode_process_fails_at_once_and_only_it(tmp_path):
    """A decode process that dies fails the next write with NIXL's reason (the handoff
    then fails as retryable and frees its blocks); writes past their window never start."""
    import base64
    import json
    import subprocess
    import sys

    from tests.cluster_util import ROOT

    child = subprocess.Popen(
        [sys.executable, "-c", NIXL_DECODE],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        d = json.loads(child.stdout.readline())
        d["metadata"] = base64.b64decode(d["metadata"])
        welcome = protocol.KVWelcome("e", "x/y", "cpu", [2, 2, 9, 4, 1, 8], "float32", {"nixl": d})
        sent = []
        writer = transfer.open_writer(
            "nixl", _wire(welcome), torch.randn(2, 2, 9, 4, 1, 8), lambda m: sent.append(m) or True
        )
        writer.write("late", "g", [1], [5], within_s=0)
        assert _poll_until(writer) == [
            ("late", "it did not complete before its reservation could end")
        ]
        writer.write("a", "g", [1, 2], [3, 4], within_s=30)
        assert _poll_until(writer) == [("a", None)]
        assert [(m.request_id, m.backend, m.header) for m in sent] == [
            ("a", "nixl", {"agent": writer.agent.name})
        ]
        child.kill()
        child.wait()
        writer.write("b", "g", [1, 2], [3, 4], within_s=30)
        ((rid, error),) = _poll_until(writer, 5)
        assert rid == "b" and "NIXL" in error
        with pytest.raises(
            transfer.TransferError, match="cannot connect to the decode node's NIXL agent"
        ):
            writer.write("c", "g", [1], [5], within_s=30)
        writer.close()
    finally:
        child.kill()
        child.wait()


NIXL_FROZEN_DECODE = NIXL_DECODE.replace(
    "torch.zeros(2, 2, 9, 4, 1, 8)", "torch.zeros(2, 2, 64, 256, 8, 64)"
)


@pytest.mark.cluster
@needs_nixl
def test_a_nixl_write_to_a_frozen_decode_process_stops_when_cancelled(monkeypatch):
    """A peer gone silent (SIGSTOP; over tcp, as across hosts) leaves a large write under
    way; cancelling it ends it at the next poll, and once the peer is back a new write
    connects again and lands."""
    import base64
    import json
    import os
    import signal
    import subprocess
    import sys

    from tests.cluster_util import ROOT

    monkeypatch.setenv("UCX_TLS", "tcp")
    shape = [2, 2, 64, 256, 8, 64]  # 64 KiB blocks: a 59-block write outlasts the socket buffers
    child = subprocess.Popen(
        [sys.executable, "-c", NIXL_FROZEN_DECODE],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        d = json.loads(child.stdout.readline())
        d["metadata"] = base64.b64decode(d["metadata"])
        welcome = protocol.KVWelcome("e", "x/y", "cpu", shape, "float32", {"nixl": d})
        writer = transfer.open_writer("nixl", _wire(welcome), torch.randn(*shape), lambda m: True)
        writer.write("a", "g", [1, 2], [3, 4], within_s=30)
        assert _poll_until(writer) == [("a", None)]
        child.send_signal(signal.SIGSTOP)
        ids = list(range(1, 60))
        writer.write("b", "g", ids, ids, within_s=30)
        assert _poll_until(writer, 2) == []  # under way, going nowhere
        writer.cancel("b")
        assert writer.poll() == [("b", "cancelled")]
        child.send_signal(signal.SIGCONT)
        writer.write("c", "g", [1, 2], [3, 4], within_s=30)
        assert _poll_until(writer) == [("c", None)]
        writer.close()
    finally:
        child.kill()
        child.wait()
