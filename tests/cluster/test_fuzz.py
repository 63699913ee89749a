"""Generated hostile messages: the codec turns every one into a message or a
ProtocolError, and 10,000 of them into each of a running cluster's three sockets
leave every process alive, serving the same tokens, with every block free and
memory bounded."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import zmq

from frontend.client import Client
from tests.cluster_util import Processes, free_base_port, wait_for
from tests.fuzz_messages import message

NUM_PER_SOCKET = 10_000
PROMPT = [11, 22, 33, 44, 55]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _stats(endpoint: str):
    with Client(endpoint) as c:
        return c.stats()


def _figures(endpoint: str) -> tuple:
    s = _stats(endpoint)
    return (
        s.frontend["num_bad_client_messages"],
        s.frontend["num_bad_node_messages"],
        s.nodes.get("decode-0", {}).get("num_bad_messages"),
    )


def _flood(endpoint: str, seed: int, identities: list[bytes | None]) -> None:
    ctx = zmq.Context()
    socks = []
    for identity in identities:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        if identity:
            s.setsockopt(zmq.IDENTITY, identity)
        s.connect(endpoint)
        socks.append(s)
    rng = random.Random(seed)
    for i in range(NUM_PER_SOCKET):
        s = socks[i % len(socks)]
        s.send_multipart(message(rng))
        while s.poll(0):  # keep replies from piling up
            s.recv_multipart()
        if i % 500 == 0:
            time.sleep(0.01)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        for s in socks:
            while s.poll(0):
                s.recv_multipart()
        time.sleep(0.05)
    ctx.destroy(linger=0)


@pytest.mark.cluster
def test_ten_thousand_hostile_messages_per_socket(tiny_model, tmp_path):
    p = Processes(
        tiny_model,
        free_base_port(),
        tmp_path,
        frontend=["--forget-after", "1"],
        decode=["--reservation-lease", "2"],
    )
    try:
        for role in ("frontend", "prefill", "decode"):
            p.start(role)
        with Client(p.clients) as c:
            c.wait_ready(120, num_nodes=2)
            before = c.complete(prompt_token_ids=PROMPT, max_tokens=8, ignore_eos=True)
            assert before.error is None
        rss = {role: _rss_mb(proc.pid) for role, proc in p.procs.items()}
        wait_for(
            lambda: all("num_free_blocks" in s for s in _stats(p.clients).nodes.values()),
            10,
            "the nodes' first heartbeats",
        )
        names = set(_stats(p.clients).nodes)

        _flood(p.clients, 10, [None, b"client-a"])
        _flood(p.nodes, 11, [None, b"fuzz", b"decode-0/1", b"prefill-0/1/heartbeat", b"ghost/7"])
        _flood(p.kv, 12, [None, b"prefill-0", b"fuzz"])

        # Every hostile message has been read: the counters of what was dropped stand still.
        last = None
        deadline = time.monotonic() + 60
        while (now := _figures(p.clients)) != last and time.monotonic() < deadline:
            last = now
            time.sleep(1.5)
        assert all(x and x > 1000 for x in now), now  # they were read, and counted
        assert all(proc.poll() is None for proc in p.procs.values())
        wait_for(
            lambda: set(_stats(p.clients).nodes) == {"prefill-0", "decode-0"},
            30,
            "the fake nodes to be forgotten",
        )
        with Client(p.clients) as c:
            after = c.complete(prompt_token_ids=PROMPT, max_tokens=8, ignore_eos=True)
        assert after.error is None and after.token_ids == before.token_ids

        def blocks_back():
            # NOTE: against the node's whole pool, not a sample taken earlier: a
            # heartbeat sent while the first request still held blocks would make
            # such a sample too low for good.
            nodes = _stats(p.clients).nodes
            return all(
                nodes[n]["num_free_blocks"] == nodes[n]["num_usable_blocks"]
                and not nodes[n].get("num_reserved_blocks")
                for n in names
            )

        wait_for(blocks_back, 30, "every block free")
        for role, proc in p.procs.items():
            grown = _rss_mb(proc.pid) - rss[role]
            assert grown < 20, f"{role} grew by {grown:.1f} MB"
    finally:
        p.stop()
