"""An 8-bit KV cache (--kv-cache-dtype int8 | fp8): its rows hold values and scale as the
format says (against the reference's quantize-dequantize, tests/kv_quant_ref.py), a budget
holds as many more blocks as its rows are smaller, and a worker's greedy tokens equal
transformers' own Qwen3 whose cache applies the same loss (fp32), through prefill, plain
decode steps and verify steps alike; the CPU's decode and verify attention read 8-bit rows
in place as float64 reads them dequantized."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from common.base.config import WorkerConfig
from common.base.request import SamplingParams
from common.base.speculative import SpeculativeConfig
from common.engine.worker import DeviceWorker
from kernels import kv_quant, portable
from launch.tools.offline import generate
from tests.conftest import clear_prompts
from tests.kv_quant_ref import QuantizedReferenceCache, quantize_dequantize
from tests.unit.test_cpu_kernels import _paged_cache, cpu, needs_cc

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
    for spec in (SpeculativeConfig("off"), SpeculativeConfig("ngram", 3)):
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
            if spec.is_on:  # drafts accepted (rows advanced by several) and rolled back
                stats = w.decode.stats()
                assert stats["num_verify_steps"] > 0
                assert 0 < stats["num_accepted_tokens"] < stats["num_drafted_tokens"]


@needs_cc
@pytest.mark.parametrize("kv_format", ["int8", "fp8"])
@pytest.mark.parametrize("num_queries", [1, 3])
def test_the_cpu_kernel_reads_8bit_rows_in_place_as_float64_over_dequantized(
    kv_format, num_queries
):
    """Decode (one query a row) and verify (three) attention over 8-bit rows, read in place
    by cpu_attention.c, against float64 over the same rows dequantized; over 1 and 2
    threads, at block edges and one long row, 128-dim heads and groups of 3."""
    lens = [n + num_queries - 1 for n in (1, 15, 16, 17, 300)]
    k, v, tables = _paged_cache(lens, 2, 128, 16, torch.float32, seed=num_queries)
    k, v = (kv_quant.quantize(x, kv_quant.FORMATS[kv_format]) for x in (k, v))
    q = torch.randn(len(lens) * num_queries, 6, 128, generator=torch.Generator().manual_seed(3))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kd, vd = (kv_quant.dequantize(x, torch.float64) for x in (k, v))
    want = portable.verify_attention(q.double(), kd, vd, tables, seq_lens, 0.1, num_queries)
    assert k.dtype in cpu._FNS  # the C kernel's, not the dense copy's way
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            if num_queries == 1:
                got = cpu.decode_attention(q, k, v, tables, seq_lens, 0.1)
            else:
                got = cpu.verify_attention(q, k, v, tables, seq_lens, 0.1, num_queries)
            assert got.dtype == torch.float32 and (got.double() - want).abs().max() < 2e-6
    finally:
        torch.set_num_threads(before)


@needs_cc
def test_the_cpu_kernel_reads_every_e4m3_value_as_torch_does():
    """A row of one token attends to itself alone: its output is its V row, dequantized.
    Every e4m3 code but the two NaNs (the quantizer clamps to 448), subnormals included."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    v = torch.zeros(3, 16, 1, 128 + kv_quant.SCALE_BYTES, dtype=torch.uint8)  # 3 blocks
    for i, row in enumerate(codes.view(2, 127)):  # block 1 + i's first token: scale 2
        v[1 + i, 0, 0, :127] = row
        v[1 + i, 0, 0, 128:] = torch.tensor([2.0]).view(torch.uint8)
    k = v.clone()
    tables = torch.tensor([[1], [2]], dtype=torch.int32)
    q = torch.randn(2, 1, 128)
    out = cpu.decode_attention(q, k, v, tables, torch.tensor([1, 1], dtype=torch.int32), 0.1)
    want = codes.view(2, 127).view(torch.float8_e4m3fn).float() * 2.0
    assert torch.equal(out[:, 0, :127], want)


def test_the_benchmark_sets_each_format_against_the_models_dtype(tiny_model, capsys):
    from launch.bench import kv

    argv = ["--model", str(tiny_model), "--batch", "2", "--context-len", "40", "--steps", "3"]
    assert kv.main([*argv, "--prefill-len", "8", "--kv-cache-memory", "4MiB"]) == 0
    out = capsys.readouterr()
    records = {r["kv_cache_dtype"]: r for r in map(json.loads, out.out.splitlines())}
    assert sorted(records) == ["auto", "fp8", "int8"]
    full = records["auto"]
    for r in records.values():
        assert r["peer"].startswith("--kv-cache-dtype auto") and r["tpot_ms"] > 0
        assert r["capacity_vs_auto"] == round(r["sequences_held"] / full["sequences_held"], 2)
    # head_dim 16 in fp32: rows of 16 + 4 bytes against 64
    assert records["int8"]["kv_bytes_per_token"] * 64 == full["kv_bytes_per_token"] * 20
    assert records["int8"]["capacity_vs_auto"] > 3 and "seqs held" in out.err
    # against the model's dtype's own greedy tokens: itself exactly; 8 bits close by
    assert full["greedy_agreement"] == 1.0 and full["max_logprob_diff"] == 0.0
    for r in (records["int8"], records["fp8"]):
        assert 0 < r["greedy_agreement"] <= 1 and 0 < r["max_logprob_diff"] < 1
    # int8 on the wire from the model's dtype's cache: rows of 16 + 4 bytes against 64
    assert full["wire_int8_bytes_vs_auto"] == round(20 / 64, 3)
    assert full["wire_int8_quantize_ms"] > 0 and full["wire_int8_quantize_vs_prefill"] > 0
    assert kv.main([*argv, "--formats", "int8"]) == 2  # nothing to set it against


def test_decode_graphs_are_captured_over_an_8bit_cache_only_where_read_in_place(monkeypatch):
    """A backend that reads an 8-bit cache through dequantized blocks (torch.unique reads
    the device back) cannot be captured: its decode steps run eager."""
    import types

    import kernels
    from common.engine import graphs

    platform = types.SimpleNamespace(can_capture_graphs=True)
    int8 = torch.zeros(1, 2, 2, 16, 1, 20, dtype=torch.int8)
    bf16 = torch.zeros(1, 2, 2, 16, 1, 16, dtype=torch.bfloat16)
    for reads_in_place in (False, True):
        ops = types.SimpleNamespace(decode_attention=lambda *a: None)
        if reads_in_place:
            ops.reads_8bit_kv = True
        monkeypatch.setattr(kernels, "backend_for", lambda t, ops=ops: ops)
        assert graphs.wants_graphs(platform, True, int8) == reads_in_place
        assert graphs.wants_graphs(platform, True, bf16)
