"""The CPU's bf16 matmul paths (kernels/cpu_linear.py): each one this CPU can run against a
float64 reference, the tiles' layout read back as an embedding, a tied model keeping one
copy, and what the CPU has read from /proc/cpuinfo and said in words."""

import importlib
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from kernels import portable
from kernels.cpu_features import CpuFeatures

HAS_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
cpu_linear = importlib.import_module("kernels.cpu_linear") if HAS_CC else None
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler: the portable ops serve")

# The paths, and whether this CPU runs each: the tiles' layout through the dot product (few
# rows) or the tiles; oneDNN's layout; the checkpoint's, widened in C (fp32 sums, x unrounded).
PATHS = ["dot", "tiles", "onednn", "widened"]


def _can_run(path: str) -> bool:
    return {
        "dot": cpu_linear.HAS_DOT,
        "tiles": cpu_linear.IS_TILED,
        "onednn": portable.IS_BF16_NATIVE,
        "widened": True,
    }[path]


@needs_cc
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 33, 70])
def test_each_bf16_linear_path_this_cpu_runs_equals_a_float64_reference(
    path, num_rows, monkeypatch
):
    """x [M, K] fp32 by a bf16 weight, with a bias, on one thread and two. The bf16 paths
    round x to bf16 as oneDNN's matmul does: the reference rounds it too; the widened path
    keeps x in fp32. Sums are fp32: a relative error of a few 1e-6; oneDNN also hands its
    output (and takes the bias) in bf16: within one bf16 rounding of the largest output."""
    if not _can_run(path):
        pytest.skip(f"this CPU cannot run the {path} path ({cpu_linear.FEATURES.describe()})")
    if path == "tiles":
        monkeypatch.setattr(cpu_linear, "DOT_MAX_ROWS", 0)
    elif path == "dot" and cpu_linear.IS_TILED and num_rows > cpu_linear.DOT_MAX_ROWS:
        pytest.skip("more rows than the dot-product path takes where there are tiles")
    elif path == "widened":
        monkeypatch.setattr(cpu_linear, "IS_BF16_NATIVE", False)
    g = torch.Generator().manual_seed(num_rows)
    # N: 5 pairs of 16 (column blocks in passes of 3 and a part); K: 5 tiles
    weight = torch.randn(160, 160, generator=g).bfloat16()
    x, bias = torch.randn(num_rows, 160, generator=g), torch.randn(160, generator=g)
    if path in ("dot", "tiles"):
        packed = cpu_linear.pack_linear_weight(weight)
        assert cpu_linear.is_tiled(packed) and packed.shape == (10, 80, 16, 2)
    elif path == "onednn":
        packed = portable.pack_linear_weight(weight)
        assert packed.is_mkldnn
    else:
        packed = weight
    xr = x if path == "widened" else x.bfloat16()
    want = xr.double() @ weight.double().T + bias.double()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = cpu_linear.linear(x, packed, bias)
            assert got.dtype == torch.float32 and got.shape == want.shape
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err < (2**-8 if path == "onednn" else 1e-5), (path, threads, err)
    finally:
        torch.set_num_threads(before)


@needs_cc
def test_a_weight_the_tiles_cannot_take_keeps_another_layout():
    """Columns not in pairs of 16 blocks, or inputs not in whole tiles: not the tiles'
    layout, and still the right product."""
    for shape in ((48, 64), (64, 48)):
        weight = torch.randn(*shape).bfloat16()
        packed = cpu_linear.pack_linear_weight(weight)
        assert not cpu_linear.is_tiled(packed)
        x = torch.randn(3, shape[1])
        want = x.bfloat16().double() @ weight.double().T
        assert torch.allclose(cpu_linear.linear(x, packed).double(), want, rtol=1e-2, atol=1e-2)


@needs_cc
def test_the_tiles_layout_reads_back_as_an_embedding():
    """A tied table packed once is also the embedding: its rows come back exactly."""
    if not cpu_linear.IS_PACKED:
        pytest.skip("this CPU has neither AMX tiles nor bf16 dot products: none is packed")
    table = torch.randn(160, 64).bfloat16()
    packed = cpu_linear.pack_linear_weight(table, is_embedding=True)
    assert cpu_linear.is_tiled(packed)
    ids = torch.tensor([[0, 15, 16, 159], [31, 1, 77, 0]])
    assert torch.equal(cpu_linear.embedding(ids, packed), F.embedding(ids, table))
    for bad in (-1, 160):  # as F.embedding: no row from the end, none past it
        with pytest.raises(IndexError):
            cpu_linear.embedding(torch.tensor([3, bad]), packed)


def test_an_embedding_is_never_packed_where_its_rows_cannot_be_read():
    """oneDNN's layout cannot be indexed: a tied table stays as it is on the portable path."""
    table = torch.randn(64, 32).bfloat16()
    assert portable.pack_linear_weight(table, is_embedding=True) is table


@needs_cc
def test_a_tied_bf16_model_keeps_one_copy_of_its_table(make_model):
    from common.base.config import WorkerConfig
    from common.engine.worker import DeviceWorker

    model = make_model(
        hidden_size=64, intermediate_size=128, heads=4, kv_heads=2, head_dim=16, layers=1
    )
    cfg = WorkerConfig(model=str(model), device="cpu", dtype="bfloat16", kv_cache_memory=2**22)
    with DeviceWorker(cfg) as worker:
        w = worker.weights
        assert w.embed is w.lm_head
        assert cpu_linear.is_tiled(w.lm_head) == cpu_linear.IS_PACKED


def test_cpu_features_are_read_from_cpuinfo():
    text = (
        "processor\t: 0\nmodel name\t: Some CPU 9000\n"
        "flags\t\t: fpu sse avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    f = CpuFeatures.read(text)
    assert (f.model, f.is_avx2, f.is_avx512, f.is_avx512_bf16, f.is_amx_bf16) == (
        "Some CPU 9000",
        True,
        True,
        True,
        True,
    )
    assert f.describe() == "AVX-512 BF16, AMX-BF16"
    old = CpuFeatures.read("model name : Old\nflags : fpu sse avx2 fma\n")
    assert (old.is_avx512, old.is_amx_bf16, old.describe()) == (False, False, "AVX2")
    assert CpuFeatures.read("").describe() == "no AVX2"


@needs_cc
def test_the_ready_line_names_the_cpu_and_its_matmul_path():
    import kernels

    said = kernels.describe("cpu")
    assert cpu_linear.FEATURES.model in said and cpu_linear.FEATURES.describe() in said
    want = (
        "AMX tiles"
        if cpu_linear.IS_TILED
        else "dot products"
        if cpu_linear.HAS_DOT
        else "oneDNN"
        if portable.IS_BF16_NATIVE
        else "C"
    )
    assert want in said


@needs_cc
@pytest.mark.parametrize("num_rows", [5, 1100])
def test_the_tiles_input_is_rounded_as_torch_rounds_and_padded_with_zeros(num_rows):
    """The tiles' bf16 input is made in one C pass (torch's conversion and pad were two
    parallel regions a call): the same bits as torch's x.to(bfloat16), NaN, infinities,
    the largest finite and subnormals included, the padding rows zero; on 1 thread and 2
    (1,100 x 1,024 floats: split by rows)."""
    x = torch.randn(num_rows, 1024, generator=torch.Generator().manual_seed(num_rows)) * 3
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, 1e-40, -0.0])
    padded = -(-num_rows // 16) * 16 + 16
    want = x.to(torch.bfloat16).view(torch.int16)
    for threads in (1, 2):
        out = torch.full((padded, 1024), 7.0, dtype=torch.bfloat16)
        cpu_linear._LIB.elementwise["to_bf16_rows"](
            x.data_ptr(), x.stride(0), out.data_ptr(), num_rows, 1024, padded, threads
        )
        assert torch.equal(out[:num_rows].view(torch.int16), want), threads
        assert not out[num_rows:].view(torch.int16).any(), threads


@needs_cc
@pytest.mark.parametrize("num_seqs", [1, 2, 4, 5])
def test_a_verify_steps_rows_equal_its_sequences_plain_step_bit_for_bit(num_seqs):
    """A verify step of 4 drafts has 5 rows a sequence: each sequence's rows must come out
    as its row in a plain step of num_seqs rows, bit for bit, or greedy tokens with
    speculation could differ from plain decoding's. Where there are tiles, the dot product
    and the tiles sum a row in different orders (found: one bf16 request's tokens differed
    at batch 1), so the path is chosen by the sequences, not the rows."""
    if not cpu_linear.IS_PACKED:
        pytest.skip(f"no bf16 dot products or tiles here ({cpu_linear.FEATURES.describe()})")
    g = torch.Generator().manual_seed(num_seqs)
    weight = cpu_linear.pack_linear_weight((torch.randn(256, 1024, generator=g) * 0.05).bfloat16())
    x = torch.randn(num_seqs * 5, 1024, generator=g)
    plain_rows = x[::5].contiguous()  # each sequence's next input: its first row
    plain = cpu_linear.linear(plain_rows, weight)
    verify = cpu_linear.linear(x, weight, None, num_seqs)
    assert torch.equal(verify[::5], plain)
    # every row as it would be alone among num_seqs rows: the second rows as a plain step
    assert torch.equal(verify[1::5], cpu_linear.linear(x[1::5].contiguous(), weight))
