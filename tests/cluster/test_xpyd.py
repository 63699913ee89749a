"""KV transfer through running nodes, for every backend, and xPyD: any prefill node
hands off to any decode node. Also what the decode node does with a handoff that
never commits, a frame that does not fit, and a commit that does not match."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from common import transfer
from common.base.request import SamplingParams
from common.wire.channel import Channel, open_context
from common.wire.protocol import (
    HandoffAck,
    KVCommit,
    KVHello,
    KVRelease,
    KVReserve,
    KVReserved,
    KVTransfer,
    KVWelcome,
)
from frontend.client import AsyncClient, Client
from tests.cluster_util import Cluster, Processes, free_base_port, start_streams, wait_for
from tests.conftest import clear_prompts

pytestmark = pytest.mark.cluster  # every test here starts processes

NEW_TOKENS = 16


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(0, 400, size=int(rng.randint(1, 90))).tolist() for _ in range(2 * n)]


def _assert_transformers_tokens(endpoint: str, model, candidates: list[list[int]]) -> None:
    """Half the candidates (the unambiguous ones) at once through the cluster; each one's
    greedy tokens equal transformers'."""
    prompts, expected = clear_prompts(model, candidates, NEW_TOKENS, len(candidates) // 2)

    async def run():
        async with AsyncClient(endpoint) as client:
            return await asyncio.gather(
                *[
                    client.complete(prompt_token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True)
                    for p in prompts
                ]
            )

    for i, (r, ref) in enumerate(zip(asyncio.run(run()), expected)):
        assert r.error is None and r.token_ids == ref, f"request {i}: {r.error}"


needs_nixl = pytest.mark.skipif(
    transfer.backend("nixl").why_unusable(torch.device("cpu")) is not None,
    reason=str(transfer.backend("nixl").why_unusable(torch.device("cpu"))),
)


def _all_free(stats: dict) -> bool:
    return all(
        s["num_free_blocks"] == s["num_usable_blocks"] and not s.get("num_reserved_blocks")
        for s in stats.values()
        if s.get("is_alive")
    )


@pytest.mark.parametrize("backend", ["ipc", pytest.param("nixl", marks=needs_nixl), "tcp", "dist"])
def test_each_backend_gives_transformers_tokens(tiny_model, tmp_path, backend):
    """Layer by layer (--kv-layerwise on): whole writes are what every other test runs. Passes
    of 32 tokens: a prompt longer than that is pushed chunk by chunk."""
    c = Cluster(
        tiny_model,
        tmp_path / "cluster.log",
        "--kv-transfer",
        backend,
        "--kv-layerwise",
        "on",
        "--token-budget",
        "32",
    )
    try:
        _assert_transformers_tokens(c.endpoint, tiny_model, _prompts(12, seed=3))
        # NOTE: node figures come from heartbeats, up to one beat old: wait for all 12 writes.
        wait_for(
            lambda: (
                (s := c.stats()["prefill-0"])["kv_links"] == {"decode-0": backend}
                and s["kv_writes"].get(backend, {}).get("num_transfers", 0) >= 12
            ),
            10,
            f"the prefill node to report its 12 {backend} writes",
        )
        assert (
            c.stats()["prefill-0"]["pass_token_budget"] == 32
        )  # prompts of up to 89 tokens: chunked
        writes = c.stats()["prefill-0"]["kv_writes"][backend]
        # dist has no layer-wise form: its writes go whole at the pass's end
        assert (writes["num_layerwise"] > 0) == (backend != "dist"), writes
        assert (writes["num_chunked"] > 0) == (backend != "dist"), writes  # over several passes
        wait_for(lambda: _all_free(c.stats()), 10, "every block free")
    finally:
        c.stop()


def test_two_prefill_two_decode_nodes_serve_64_requests_exactly(tiny_model, tmp_path):
    c = Cluster(tiny_model, tmp_path / "cluster.log", "--num-prefill", "2", "--num-decode", "2")
    try:
        _assert_transformers_tokens(c.endpoint, tiny_model, _prompts(64, seed=4))
        stats = c.stats()
        assert set(stats) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
        for name in stats:  # routing spread the load over every node
            assert stats[name]["num_routed"] >= 8, (name, stats[name]["num_routed"])
        # Every prefill node handed off to both decode nodes over ipc (heartbeat figures: wait).
        wait_for(
            lambda: all(
                c.stats()[p].get("kv_links") == {"decode-0": "ipc", "decode-1": "ipc"}
                for p in ("prefill-0", "prefill-1")
            ),
            10,
            "both prefill nodes' links",
        )
        wait_for(lambda: _all_free(c.stats()), 10, "every block free")
        # --stats: every node on a line, and the routes taken, which add up to the requests.
        out = subprocess.run(
            [sys.executable, "-m", "frontend.cli", "--endpoint", c.endpoint, "--stats"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split()[:2] == ["node", "role"]
        assert sorted(line.split()[0] for line in lines[1:5]) == sorted(stats)
        routes = dict(re.findall(r"(prefill-\d -> decode-\d): (\d+)", out.stdout))
        assert len(routes) >= 2 and sum(map(int, routes.values())) == 64
    finally:
        c.stop()


def test_with_migration_off_killing_one_decode_node_of_two_fails_only_its_requests(
    tiny_model, tmp_path
):
    base = free_base_port(4)
    p = Processes(tiny_model, base, tmp_path, frontend=["--max-migrations", "0"])
    try:
        for role in ("frontend", "prefill", "decode"):
            p.start(role)
        p.start("decode", name="decode-1", kv=f"tcp://127.0.0.1:{base + 3}")
        with Client(p.clients) as c:
            c.wait_ready(120, num_nodes=3)

        async def run():
            async with AsyncClient(p.clients, idle_timeout_s=20) as client:
                tasks = await start_streams(client, 8, 900)
                routed = {n: s["num_routed"] for n, s in (await client.stats()).nodes.items()}
                os.kill(p.procs["decode"].pid, signal.SIGKILL)
                done, pending = await asyncio.wait(tasks, timeout=8)
                after = await client.complete("still served", max_tokens=5, ignore_eos=True)
                for t in pending:
                    t.cancel()
                return routed, [t.result()[0][-1] for t in done], after

        routed, ended, after = asyncio.run(run())
        assert routed["decode-0"] == 4 and routed["decode-1"] == 4
        errors = [r for r in ended if r.finish_reason == "error"]
        assert len(errors) == 4 and all("decode-0" in r.error for r in errors)
        assert all(r.finish_reason == "length" for r in ended if r not in errors)
        assert after.error is None and len(after.token_ids) == 5
    finally:
        p.stop()


class FakePrefill:
    """A prefill node's side of the KV link, by hand."""

    def __init__(self, kv_endpoint: str, identity: str = "fake-prefill/1"):
        self.ctx = open_context()
        self.ch = Channel(self.ctx, False, kv_endpoint, tag=identity)

    def ask(self, msg, reply_type):
        self.ch.send(msg)
        while True:
            assert self.ch.has_message(10), f"no {reply_type.__name__}"
            _, got = self.ch.recv()
            if isinstance(got, reply_type):
                return got

    def commit(
        self,
        rid: str,
        grant: KVReserved,
        shape: list[int],
        prompt_len: int = 40,
        max_tokens: int = 8,
        is_written: bool = True,
        stamps: dict | None = None,
    ) -> HandoffAck:
        """Write the grant's blocks (zeros, one tcp frame of every layer) and commit, with
        their checksums (the decode nodes of the tests verify)."""
        if is_written:
            self.ch.send(
                KVTransfer(
                    rid,
                    grant.reservation,
                    "tcp",
                    {"first_layer": 0},
                    torch.zeros(shape[0], 2, len(grant.block_ids), *shape[3:]),
                )
            )
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sums = [0] * len(grant.block_ids) if grant.block_ids else None  # of zeros (--kv-verify)
        return self.ask(
            KVCommit(
                rid,
                prompt_len,
                1,
                params,
                stamps or {},
                "tcp",
                [1] * prompt_len,
                grant.reservation,
                shape[0],
                sums,
            ),
            HandoffAck,
        )

    def close(self):
        self.ch.close()
        self.ctx.term()


def _decode_stats(endpoint):
    with Client(endpoint) as c:
        return c.stats().nodes["decode-0"]


def test_requests_that_do_not_fit_wait_in_line_and_are_granted_unasked(tiny_model, tmp_path):
    """19 blocks of 16 tokens. A request that does not fit now waits its turn, and so
    does everything after it (first come, first served), and the blocks come without
    asking again once they free up."""
    p = Processes(
        tiny_model,
        free_base_port(),
        tmp_path,
        decode=["--kv-cache-memory", "160KiB", "--reservation-lease", "3"],
    )
    fake = other = None
    try:
        for role in ("frontend", "decode"):
            p.start(role)
        with Client(p.clients) as c:  # its figures are read through the frontend below
            wait_for(lambda: "decode-0" in c.stats(60).nodes, 120, "the decode node to register")
        fake = FakePrefill(p.kv)
        fake.ask(KVHello("fake-prefill"), KVWelcome)
        a = fake.ask(KVReserve("a", 200, 8), KVReserved)  # 13 blocks
        assert len(a.block_ids) == 13
        b = fake.ask(KVReserve("b", 100, 8), KVReserved)  # 7 more do not fit
        assert b.block_ids is None and b.is_queued and b.is_retryable and b.lease_s == 3.0
        c = fake.ask(KVReserve("c", 16, 8), KVReserved)  # would fit, but b is first
        assert c.block_ids is None and c.is_queued and "wait for blocks first" in c.reason
        d = fake.ask(KVReserve("d", 16, 8), KVReserved)
        assert d.is_queued
        fake.ch.send(KVRelease("d"))  # gives up its place
        other = FakePrefill(p.kv, "another-prefill/1")
        taken = other.ask(KVReserve("b", 100, 8), KVReserved)  # b is someone else's
        assert taken.block_ids is None and not taken.is_retryable
        again = fake.ask(KVReserve("b", 100, 8), KVReserved)  # keeps its place
        assert again.is_queued and again.block_ids is None

        fake.ch.send(KVRelease("a", a.reservation))
        grants = []
        while len(grants) < 2:
            assert fake.ch.has_message(10), "no grant"
            _, got = fake.ch.recv()
            if isinstance(got, KVReserved):
                grants.append(got)
        assert [g.request_id for g in grants] == ["b", "c"]
        assert all(g.is_queued and g.lease_s == 3.0 for g in grants)
        assert len(grants[0].block_ids) == 7 and len(grants[1].block_ids) == 1  # prompt blocks
        assert not fake.ch.has_message(1)  # d left the line: no grant
        stats = wait_for(
            lambda: (s := _decode_stats(p.clients)).get("num_granted") == 2 and s, 5, "stats"
        )
        assert stats["num_asking"] == 0 and stats["num_reservations"] == 2
        # Never committed: the lease frees them, and the line holds nothing.
        wait_for(
            lambda: (s := _decode_stats(p.clients))["num_free_blocks"] == s["num_usable_blocks"],
            10,
            "the leases to free the grants",
        )
    finally:
        for f in (fake, other):
            if f is not None:
                f.close()
        p.stop()


def test_uncommitted_reservations_and_bad_writes_free_their_blocks(tiny_model, tmp_path):
    p = Processes(tiny_model, free_base_port(), tmp_path, decode=["--reservation-lease", "3"])
    fake = None
    try:
        for role in ("frontend", "prefill", "decode"):
            p.start(role)
        with Client(p.clients) as c:
            c.wait_ready(120)
        free = wait_for(lambda: _decode_stats(p.clients).get("num_free_blocks"), 5, "decode stats")
        fake = FakePrefill(p.kv)
        welcome = fake.ask(KVHello("fake-prefill"), KVWelcome)
        assert list(welcome.backends) == ["ipc", "tcp"] and welcome.backends["ipc"]["shm_name"]

        # Reserved, never committed: freed when the lease ends.
        r = fake.ask(KVReserve("never", 40, 8), KVReserved)
        assert len(r.block_ids) == 3
        # Stats come from heartbeats (every 0.5 s): see the blocks held, then given back.
        wait_for(lambda: _decode_stats(p.clients)["num_free_blocks"] == free - 3, 2, "blocks held")
        wait_for(
            lambda: (
                _decode_stats(p.clients)["num_free_blocks"] == free
                and _decode_stats(p.clients)["num_reserved_blocks"] == 0
            ),
            10,
            "the lease to free it",
        )
        late = fake.commit("never", r, welcome.cache_shape, is_written=False)
        assert not late.is_accepted and "no reservation" in late.reason
        assert _decode_stats(p.clients)["num_expired_reservations"] == 1

        # Renewed by the same KVReserve: the same blocks, held past the lease.
        r = fake.ask(KVReserve("renewed", 40, 8), KVReserved)
        assert r.lease_s == 3.0
        end = time.monotonic() + 4.5
        while time.monotonic() < end:
            time.sleep(1)
            again = fake.ask(KVReserve("renewed", 40, 8), KVReserved)
            assert again.block_ids == r.block_ids and again.lease_s == 3.0
        ack = fake.commit("renewed", r, welcome.cache_shape)
        assert ack.is_accepted
        assert _decode_stats(p.clients)["num_expired_reservations"] == 1

        # Released by the prefill side.
        gone = fake.ask(KVReserve("gone", 40, 8), KVReserved)
        fake.ch.send(KVRelease("gone", gone.reservation))
        wait_for(lambda: _decode_stats(p.clients)["num_free_blocks"] == free, 5, "the release")

        # A frame of the wrong shape or dtype: the commit is refused with the reason.
        shape = welcome.cache_shape
        for name, bad in (
            ("dtype", torch.zeros(shape[0], 2, 3, *shape[3:], dtype=torch.float16)),
            ("shape", torch.zeros(shape[0], 2, 4, *shape[3:], dtype=torch.float32)),
        ):
            g = fake.ask(KVReserve(name, 40, 8), KVReserved)
            fake.ch.send(KVTransfer(name, g.reservation, "tcp", {"first_layer": 0}, bad))
            ack = fake.commit(name, g, shape, is_written=False)
            assert not ack.is_accepted and "does not fit" in ack.reason
        # A commit whose KV did not all arrive (one layer of two: refused when its lease ends,
        # as the rest could still be on the way), or that names another grant.
        for name, grant_of in (
            ("half", lambda g: g.reservation),
            ("stale", lambda g: "0123456789ab"),
        ):
            g = fake.ask(KVReserve(name, 40, 8), KVReserved)
            fake.ch.send(
                KVTransfer(
                    name, g.reservation, "tcp", {"first_layer": 0}, torch.zeros(1, 2, 3, *shape[3:])
                )
            )
            ack = fake.ask(
                KVCommit(
                    name,
                    40,
                    1,
                    SamplingParams(max_tokens=8),
                    {},
                    "tcp",
                    [1] * 40,
                    grant_of(g),
                    shape[0],
                ),
                HandoffAck,
            )
            assert not ack.is_accepted and ack.is_retryable, ack
            assert ("did not all arrive" if name == "half" else "another grant") in ack.reason
        # A commit that asks for more than was reserved.
        g = fake.ask(KVReserve("greedy", 40, 8), KVReserved)
        ack = fake.commit("greedy", g, shape, max_tokens=500)
        assert not ack.is_accepted and "does not match the reservation" in ack.reason
        wait_for(
            lambda: (
                _decode_stats(p.clients)["num_free_blocks"] == free
                and _decode_stats(p.clients)["num_reserved_blocks"] == 0
            ),
            5,
            "every block back",
        )
        # Someone else's reservation cannot be released or committed.
        other = FakePrefill(p.kv, "another-prefill/1")
        try:
            g = fake.ask(KVReserve("mine", 40, 8), KVReserved)
            other.ch.send(KVRelease("mine"))
            ack = other.commit("mine", g, shape)
            assert not ack.is_accepted
            ack = fake.commit("mine", g, shape)
            assert ack.is_accepted  # still reserved for its owner
            again = fake.commit("mine", g, shape, is_written=False)
            assert (
                again.is_accepted
            )  # the same commit again (its link was made again): the same answer
        finally:
            other.close()
        # The cluster still serves.
        with Client(p.clients) as c:
            r = c.complete("after all that", max_tokens=4, ignore_eos=True)
            assert r.error is None and len(r.token_ids) == 4
    finally:
        if fake:
            fake.close()
        p.stop()
