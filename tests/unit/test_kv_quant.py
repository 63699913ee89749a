"""An 8-bit KV cache (--kv-cache-dtype int8 | fp8): its rows hold values and scale as the
format says (against the reference's quantize-dequantize, tests/kv_quant_ref.py), a budget
holds as many more blocks as its rows are smaller, and a worker's greedy tokens equal
transformers' own Qwen3 whose cache applies the same loss (fp32), through prefill, plain
decode steps and verify steps alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.base.config import WorkerConfig
from common.base.request import SamplingParams
from common.base.speculative import SpeculativeConfig
from common.engine.worker import DeviceWorker
from kernels import kv_quant
from launch.tools.offline import generate
from tests.conftest import clear_prompts
from tests.kv_quant_ref import QuantizedReferenceCache, quantize_dequantize

NEW_TOKENS = 24


@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
def test_rows_hold_the_values_and_scale_the_format_defines(kv_format):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 128) * torch.logspace(-3, 2, 5)[:, None, None]
    x[2, 1] = 0.0  # a row of zeros: scale 1, values 0
    rows = kv_quant.quantize(x, kv_quant.FORMATS[kv_format])
    assert rows.shape == (5, 3, 128 + kv_quant.SCALE_BYTES)
    assert torch.equal(kv_quant.dequantize(rows, torch.float32), quantize_dequantize(x, kv_format))
    scales = rows.view(torch.uint8)[..., 128:].contiguous().view(torch.float32)[..., 0]
    amax = x.abs().amax(-1)
    expected = torch.where(amax > 0, amax / {"int8": 127.0, "fp8": 448.0}[kv_format], 1.0)
    assert torch.equal(scales, expected)
    error = (kv_quant.dequantize(rows, torch.float32) - x).abs().amax(-1) / amax.clamp(min=1e-30)
    assert float(error.max()) <= (0.5 / 127 if kv_format == "int8" else 1 / 16) * 1.0001


def test_a_budget_holds_as_many_more_blocks_as_rows_are_smaller(tiny_model):
    def blocks(kv_format: str, dtype: str) -> tuple[int, int]:
        cfg = WorkerConfig(
            model=str(tiny_model), kv_cache_memory=8 * 2**20, dtype=dtype, kv_cache_dtype=kv_format
        )
        with DeviceWorker(cfg) as w:
            return w.num_kv_blocks, w.block_bytes()

    full, full_bytes = blocks("auto", "bfloat16")
    for kv_format in ("int8", "fp8"):
        num, num_bytes = blocks(kv_format, "bfloat16")
        # head_dim 16: rows of 16 + 4 bytes against 32 (bf16); Qwen3's 128: 132 against 256
        assert num_bytes * 32 == full_bytes * 20
        assert num == 8 * 2**20 // num_bytes and num > 1.5 * full


@pytest.fixture(scope="module")
def candidates(tiny_model):
    rng = np.random.RandomState(5)
    return [rng.randint(1, 500, size=int(rng.randint(5, 60))).tolist() for _ in range(16)]


@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
def test_greedy_tokens_equal_transformers_with_the_same_loss(tiny_model, candidates, kv_format):
    """Six prompts at once, prefilled together and decoded in one batch: plain steps, and
    verify steps (every step verifies as many drafts as the rows have room for)."""
    prompts, expected = clear_prompts(
        tiny_model,
        candidates,
        NEW_TOKENS,
        6,
        min_gap=1e-3,
        make_cache=lambda: QuantizedReferenceCache(kv_format),
    )
    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts)
    for spec in (SpeculativeConfig(), SpeculativeConfig("ngram", 3)):
        cfg = WorkerConfig(
            model=str(tiny_model),
            kv_cache_memory=8 * 2**20,
            max_batch_size=8,
            kv_cache_dtype=kv_format,
            speculative=spec,
        )
        with DeviceWorker(cfg) as w:
            out = generate(w, prompts, params)
            assert [o["token_ids"] for o in out] == expected, spec.method
            if spec.is_on:
                assert w.decode.stats()["num_verify_steps"] > 0
