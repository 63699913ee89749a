"""An 8-bit KV cache through the nodes: a prefill and a decode node started with the same
--kv-cache-dtype answer as transformers whose cache applies the same loss (fp32, token for
token), over each KV transfer (tcp layer by layer, ipc, dist; nixl where it is installed),
a prompt asked again from the prefill node's prefix cache (its 8-bit blocks) alike, with
every block back after; a pair whose caches differ refuses the handoff with an error
that names both formats, and the frontend answers every request."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from frontend.client import AsyncClient, Client
from tests.cluster_util import Processes, free_base_port, wait_for
from tests.conftest import clear_prompts
from tests.kv_quant_ref import QuantizedReferenceCache
from tests.unit.test_handoff import needs_nixl

pytestmark = pytest.mark.cluster

NEW_TOKENS = 16
CASES = [
    ("int8", ("--kv-transfer", "tcp", "--kv-layerwise", "on")),
    ("int8", ("--kv-transfer", "ipc")),
    ("int8", ("--kv-transfer", "dist")),
    pytest.param("int8", ("--kv-transfer", "nixl"), marks=needs_nixl),
    ("fp8", ("--kv-transfer", "ipc")),
]


def _candidates(n: int) -> list[list[int]]:
    rng = np.random.RandomState(11)
    return [rng.randint(1, 500, size=int(rng.randint(20, 70))).tolist() for _ in range(n)]


def _free(clients: str) -> bool:
    with Client(clients) as c:
        return all(
            "num_free_blocks" in s  # once its heartbeat has told them
            and s["num_free_blocks"] == s["num_usable_blocks"]
            and not s.get("num_reserved_blocks")
            for s in c.stats().nodes.values()
        )


def _prefix_hits(clients: str) -> int:
    with Client(clients) as c:
        return c.stats().nodes["prefill-0"].get("num_prefix_hit_tokens", 0)


def _start(procs: Processes) -> None:
    for role in ("frontend", "prefill", "decode"):
        procs.start(role)
    with Client(procs.clients) as c:
        c.wait_ready(120)


def _ask(procs: Processes, prompts: list[list[int]]) -> list:
    async def run():
        async with AsyncClient(procs.clients) as client:
            return await asyncio.gather(
                *[
                    client.complete(prompt_token_ids=p, max_tokens=NEW_TOKENS, ignore_eos=True)
                    for p in prompts
                ]
            )

    return asyncio.run(run())


@pytest.mark.parametrize(
    "kv_format,transfer",
    CASES,
    ids=["int8-tcp-layerwise", "int8-ipc", "int8-dist", "int8-nixl", "fp8-ipc"],
)
def test_8bit_kv_crosses_the_handoff_and_answers_as_the_reference(
    tiny_model, tmp_path, kv_format, transfer
):
    prompts, expected = clear_prompts(
        tiny_model,
        _candidates(12),
        NEW_TOKENS,
        6,
        make_cache=lambda: QuantizedReferenceCache(kv_format),
    )
    args = ["--kv-cache-dtype", kv_format, *transfer]
    procs = Processes(tiny_model, free_base_port(), tmp_path, prefill=args, decode=args)
    try:
        _start(procs)
        for again in (False, True):  # asked again: the prompts' full blocks from the cache
            for i, (r, ref) in enumerate(zip(_ask(procs, prompts), expected)):
                assert r.error is None, r.error
                assert r.token_ids == ref, f"request {i} diverged (asked again: {again})"
        wait_for(lambda: _prefix_hits(procs.clients) > 0, 10, "the prefill node's prefix hits")
        wait_for(lambda: _free(procs.clients), 10, "every block back")
        for role in ("prefill", "decode"):  # each says its format when ready
            assert f"tokens in {kv_format})" in (tmp_path / f"{role}.log").read_text()
    finally:
        procs.stop()


def test_nodes_whose_caches_differ_refuse_the_handoff_by_name(tiny_model, tmp_path):
    procs = Processes(
        tiny_model,
        free_base_port(),
        tmp_path,
        prefill=["--kv-transfer", "tcp"],
        decode=["--kv-cache-dtype", "int8", "--kv-transfer", "tcp"],
    )
    try:
        _start(procs)
        results = _ask(procs, _candidates(3))
        for r in results:
            assert r.finish_reason == "error", r.token_ids
            assert "int8 (8-bit KV" in r.error and "float32" in r.error, r.error
        wait_for(lambda: _free(procs.clients), 10, "every block back")
    finally:
        procs.stop()
