"""The CPU's fp32 matmuls (kernels/cpu_linear_fp32.py): oneDNN's packed and per-call paths and
torch's, each against a float64 reference on any x86 CPU with oneDNN; the rule that chooses
oneDNN by what the CPU is; and the backend taking it only where that rule says so."""

import importlib
import os
import shutil

import pytest
import torch

from kernels import cpu_linear_fp32 as fp32
from kernels import portable
from kernels.cpu_features import CpuFeatures

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)
HAS_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))


def _reference(x, weight, bias):
    return x.double() @ weight.double().T + (0 if bias is None else bias.double())


@needs_onednn
@pytest.mark.parametrize("num_rows", [1, 3, 15, 16, 17, 70, 430])
@pytest.mark.parametrize("size", ["small", "large", "large tied"])
def test_each_fp32_path_equals_a_float64_reference(num_rows, size, monkeypatch):
    """A small weight stays as it is (oneDNN from 16 rows, torch's below); a large one is
    packed once, or, tied to the embedding, stays as it is and goes through oneDNN too;
    rows padded to oneDNN's counts (17, 70, 430) come back as many as asked; with a bias
    and without, on 1 thread and 2. Sums are fp32: a relative error of a few 1e-6 at
    K = 1,024."""
    n, k = (160, 96) if size == "small" else (1024, 1024)
    g = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(n, k, generator=g)
    x, bias = torch.randn(num_rows, k, generator=g), torch.randn(n, generator=g)
    packed = weight if size == "large tied" else fp32.pack(weight)
    assert packed.is_mkldnn == (size == "large")
    if size != "small" or num_rows >= fp32.ONEDNN_MIN_ROWS:  # oneDNN's, never torch's
        monkeypatch.setattr(fp32, "F", None)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for b in (bias, None):
                got = fp32.linear(x, packed, b)
                want = _reference(x, weight, b)
                assert got.dtype == torch.float32 and got.shape == want.shape
                err = ((got.double() - want).abs().max() / want.abs().max()).item()
                assert err < 1e-5, (size, num_rows, threads, b is None, err)
    finally:
        torch.set_num_threads(before)


def test_rows_are_padded_to_few_counts_and_never_by_more_than_an_eighth():
    """oneDNN makes a primitive per shape and keeps 1,024: a prefill's many token counts
    meet few of them."""
    counts = {fp32.padded_rows(n) for n in range(16, 4096)}
    assert len(counts) <= 8 * 8 + 1  # 8 an octave from 16, and 4,096 itself
    for n in range(16, 4096):
        assert n <= fp32.padded_rows(n) <= n + n // 8
    assert [fp32.padded_rows(n) for n in (16, 17, 32, 33, 430)] == [16, 18, 32, 36, 448]


@needs_onednn
def test_a_strided_large_weight_is_not_copied_on_every_call(monkeypatch):
    """oneDNN would copy a plain weight it cannot read row-major: a large one goes to
    torch's linear instead."""
    weight = torch.randn(1024, 1024)
    called = []
    monkeypatch.setattr(
        fp32.torch.ops.mkldnn, "_linear_pointwise", lambda *a: called.append(a) or None
    )
    x = torch.randn(20, 1024)
    got = fp32.linear(x, weight.t(), None)
    assert not called
    assert torch.allclose(got.double(), x.double() @ weight.double(), rtol=1e-5, atol=1e-3)


@needs_onednn
def test_no_rows_give_no_rows():
    weight = torch.randn(1024, 1024)
    for w in (weight, fp32.pack(weight), torch.randn(64, 32)):
        assert fp32.linear(torch.randn(0, w.shape[1]), w, None).shape == (0, w.shape[0])


@needs_onednn
def test_a_strided_input_or_bias_reads_as_its_values():
    """A slice of columns (strided rows) and a bias of every other value, through oneDNN
    with a plain weight and a packed one (oneDNN itself reads a bias as contiguous)."""
    x = torch.randn(40, 1100)[:, 8:1032]
    for weight in (torch.randn(64, 1024), torch.randn(1024, 1024)):
        bias = torch.randn(2 * weight.shape[0])[::2]
        got = fp32.linear(x, fp32.pack(weight), bias)
        want = _reference(x, weight, bias)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-3)


@needs_onednn
def test_only_large_fp32_cpu_matrices_are_packed_and_plain_fp32_ones_taken():
    big = torch.randn(1024, 1024)
    assert fp32.pack(big).is_mkldnn
    for other in (big.bfloat16(), torch.randn(1023, 1024), torch.randn(1 << 20)):
        assert fp32.pack(other) is other
    x = torch.randn(4, 1024)
    assert fp32.is_served(x, big)
    assert fp32.is_served(x, fp32.pack(big))
    for xs, w in ((x.bfloat16(), big), (x, big.bfloat16()), (x[None], big)):
        assert not fp32.is_served(xs, w)


@pytest.mark.parametrize(
    "vendor, flags, want",
    [
        ("AuthenticAMD", "avx2 fma avx512f avx512_bf16", True),
        ("AuthenticAMD", "avx2 fma", False),
        ("GenuineIntel", "avx2 fma avx512f amx_bf16 amx_tile", False),
        ("HygonGenuine", "avx2 fma avx512f", True),
    ],
)
def test_onednn_serves_fp32_where_the_cpu_has_avx512_and_is_not_intels(vendor, flags, want):
    text = f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: X\nflags\t\t: {flags}\n"
    f = CpuFeatures.read(text)
    assert f.vendor == vendor
    assert fp32.is_onednn_faster(f) == (want and torch.backends.mkldnn.is_available())


@pytest.mark.skipif(not HAS_CC, reason="no C compiler: the portable ops serve")
def test_the_backend_takes_the_fp32_path_only_where_the_rule_says(monkeypatch):
    """Through kernels.linear and pack_linear_weight: the packed layout and the ready line's
    words where the rule holds on this CPU; as they were where it does not (forced off)."""
    import kernels

    cpu_linear = importlib.import_module("kernels.cpu_linear")
    weight = torch.randn(1024, 1024)
    x = torch.randn(20, 1024)
    want = _reference(x, weight, None)
    for rule in sorted({cpu_linear.IS_ONEDNN_FP32, False}):
        monkeypatch.setattr(cpu_linear, "IS_ONEDNN_FP32", rule)
        packed = kernels.pack_linear_weight(weight)
        assert packed.is_mkldnn == rule
        assert kernels.pack_linear_weight(weight, is_embedding=True) is weight
        # a bf16 weight the dot products' layout does not take keeps the way it had
        odd = torch.randn(100, 64).bfloat16()
        assert kernels.pack_linear_weight(odd).is_mkldnn == portable.IS_BF16_NATIVE
        got = kernels.linear(x, packed)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-3)
        assert ("fp32 matmul: oneDNN" in kernels.describe("cpu")) == rule


@needs_onednn
def test_a_verify_steps_rows_take_the_library_of_its_sequences_plain_step(monkeypatch):
    """A small weight's rows go to torch's linear below ONEDNN_MIN_ROWS, to oneDNN from it:
    a verify step of 4 sequences (20 rows) takes torch's, as their plain step of 4 rows
    does (num_seqs); 20 rows of 20 sequences take oneDNN's."""
    weight = torch.randn(64, 32)
    called = []
    onednn = fp32.onednn_linear
    monkeypatch.setattr(fp32, "onednn_linear", lambda *a: called.append(a) or onednn(*a))
    x = torch.randn(20, 32)
    want = x.double() @ weight.double().t()
    for num_seqs, is_onednn in ((4, False), (None, True), (20, True)):
        called.clear()
        got = fp32.linear(x, weight, None, num_seqs)
        assert bool(called) == is_onednn
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
