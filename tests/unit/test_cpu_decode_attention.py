"""The CPU decode attention over a bf16 cache with 128-dim heads (every Qwen3 size), which
runs kernels/cpu_decode_avx512.c where the build has AVX-512: against float64 on the same
inputs, at block and read-ahead edges, for groups of 1, 2 and 5 query heads, and split
over threads."""

import pytest
import torch

from kernels import portable
from tests.unit.test_cpu_kernels import _paged_cache, cpu, equal_on_1_2_3_threads, needs_cc

# lengths at and around the block (16) and the read-ahead (8) edges, and one long row
LENS = [1, 7, 8, 9, 15, 16, 17, 33, 300]


@needs_cc
@pytest.mark.parametrize("hq,hk", [(16, 8), (5, 1), (8, 8)])
def test_bf16_cache_128_dim_heads_equal_float64(hq, hk):
    k, v, tables = _paged_cache(LENS, hk, 128, 16, torch.bfloat16, seed=hq)
    q = torch.randn(len(LENS), hq, 128, generator=torch.Generator().manual_seed(hk))
    seq_lens = torch.tensor(LENS, dtype=torch.int32)
    got = cpu.decode_attention(q, k, v, tables, seq_lens, 128**-0.5)
    want = portable.decode_attention(q.double(), k.double(), v.double(), tables, seq_lens,
                                     128**-0.5)  # fmt: skip
    # NOTE: the inputs are the same values: only fp32 sums against float64 ones differ
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() < 2e-6


@needs_cc
@pytest.mark.parametrize("lens", [LENS, [300]])  # rows over threads; one row's heads
def test_bf16_cache_128_dim_heads_split_over_threads_equal_one_thread(lens):
    k, v, tables = _paged_cache(lens, 8, 128, 16, torch.bfloat16, seed=5)
    q, seq_lens = torch.randn(len(lens), 16, 128), torch.tensor(lens, dtype=torch.int32)
    equal_on_1_2_3_threads(lambda: cpu.decode_attention(q, k, v, tables, seq_lens, 0.1))


def test_the_512_bit_preference_is_asked_only_of_a_cpu_with_avx512(monkeypatch):
    """-mprefer-vector-width is an x86 option: gcc on Arm refuses it, and every C kernel
    would have fallen back to torch's ops there."""
    from kernels import cpu_build

    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "Features\t: fp asimd evtstrm aes")
    assert cpu_build.flags() == cpu_build.FLAGS
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags\t\t: fpu sse2 avx2 avx512f")
    assert cpu_build.flags() == cpu_build.FLAGS + cpu_build.AVX512_FLAGS


@needs_cc
def test_the_avx512_kernel_is_built_where_the_cpu_has_avx512():
    import ctypes

    from kernels import cpu_build, options

    lib = ctypes.CDLL(str(cpu_build.build(options.current[0].build_dir)))  # the one loaded
    has = ctypes.c_int.in_dll(lib, "pdserve_has_attend_bf16_d128").value
    assert has == ("avx512f" in cpu_build._cpu_flags().split())
