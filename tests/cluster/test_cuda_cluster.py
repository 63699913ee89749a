"""A cluster on CUDA against transformers: fp32 greedy tokens over each KV link, the
decode node graphed (the worker's graphs and kernels: tests/unit/test_cuda.py). Skipped
where no CUDA device is present."""

import numpy as np
import pytest
import torch

from tests.conftest import hf_greedy
from tests.unit.test_cuda import SHAPE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _nixl_on_cuda() -> str | None:
    from common import transfer

    return transfer.backend("nixl").why_unusable(torch.device("cuda"))


@pytest.mark.parametrize(
    "kv_transfer,expected",
    [
        ("auto", "ipc"),
        ("tcp", "tcp"),
        pytest.param(
            "nixl",
            "nixl",
            marks=pytest.mark.skipif(
                torch.cuda.is_available() and _nixl_on_cuda() is not None,
                reason=f"nixl: {_nixl_on_cuda()}",
            ),
        ),
    ],
)
@pytest.mark.cluster
def test_cluster_on_gpu_fp32_matches_transformers(make_model, tmp_path, kv_transfer, expected):
    import asyncio

    from frontend.client import AsyncClient
    from tests.cluster_util import Cluster, wait_for

    model = make_model(**SHAPE)
    c = Cluster(
        model,
        tmp_path / "gpu-cluster.log",
        "--prefill-device",
        "cuda:0",
        "--decode-device",
        "cuda:0",
        "--dtype",
        "float32",
        "--kv-transfer",
        kv_transfer,
    )
    try:
        rng = np.random.RandomState(5)
        prompts = [rng.randint(0, 400, size=int(rng.randint(1, 200))).tolist() for _ in range(32)]

        async def run():
            async with AsyncClient(c.endpoint) as client:
                return await asyncio.gather(
                    *[
                        client.complete(prompt_token_ids=p, max_tokens=32, ignore_eos=True)
                        for p in prompts
                    ]
                )

        results = asyncio.run(run())
        for r, ref in zip(results, hf_greedy(model, prompts, 32)):
            assert r.token_ids == ref, r.error
        # Heartbeat figures are up to one beat old: wait for them rather than sample once.
        wait_for(
            lambda: c.stats()["prefill-0"].get("kv_links") == {"decode-0": expected}, 10, "the link"
        )
        stats = c.stats()
        assert stats["decode-0"]["is_graphed"] and stats["decode-0"]["max_decode_batch"] > 1
    finally:
        c.stop()
