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


@needs_cc
def test_a_build_directory_not_this_users_is_refused_and_closed_to_others(tmp_path, monkeypatch):
    """A library found in the build directory is loaded and run, and the default one is a
    predictable name under /tmp: another user's directory is refused (the portable ops then
    serve), one of ours others may write to is closed to them, and a library others could
    have written is built again, not loaded."""
    import os
    import stat

    from kernels import cpu_build, options

    ours = cpu_build.build(options.current[0].build_dir)  # built already: found, not built
    d = tmp_path / "kernels"
    d.mkdir()
    os.chmod(d, 0o777)
    planted = d / ours.name
    tampered = ours.read_bytes() + b"others' bytes"
    planted.write_bytes(tampered)
    os.chmod(planted, 0o666)
    assert cpu_build.build(d) == planted  # built again, in place of the one others could write
    assert stat.S_IMODE(d.stat().st_mode) == 0o755
    assert stat.S_IMODE(planted.stat().st_mode) == 0o755 and planted.read_bytes() != tampered
    planted.unlink()
    planted.symlink_to(ours)  # a link, even to a library of ours: built again in its place
    assert cpu_build.build(d) == planted and not planted.is_symlink()
    os.chmod(planted, 0o775)  # opened and checked as it is loaded: refused, not loaded
    with pytest.raises(ImportError, match="not this user's alone"):
        cpu_build._open_trusted(planted)
    with monkeypatch.context() as m:  # any filesystem or compiler error: the portable ops
        m.setenv("CC", str(tmp_path / "no-such-cc"))
        with pytest.raises(ImportError, match="could not be built"):
            cpu_build.build(d)
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with pytest.raises(ImportError, match="another user"):
        cpu_build.build(d)


def _verify_float64(q, k, v, tables, seq_lens, scale, num_queries):
    """Each query by hand: query j of row i over the first seq_lens[i] - (Q - 1 - j)."""
    rows = []
    for i, n in enumerate(seq_lens.tolist()):
        for j in range(num_queries):
            lens = torch.tensor([n - (num_queries - 1 - j)], dtype=torch.int32)
            one = q[i * num_queries + j][None].double()
            rows.append(portable.decode_attention(one, k.double(), v.double(), tables[i : i + 1],
                                                  lens, scale)[0])  # fmt: skip
    return torch.stack(rows)


@needs_cc
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float32, 64)])
@pytest.mark.parametrize("num_queries", [1, 3, 5])
def test_a_verify_steps_queries_each_read_their_own_tokens_equal_float64(
    dtype, head_dim, num_queries
):
    """A verify step's rows: each row's KV read once for its Q queries (Q times the heads),
    query j masked to the row's first n - (Q - 1 - j) tokens; over 1 and 2 threads."""
    lens = [n + num_queries - 1 for n in (1, 8, 16, 17, 300)]
    k, v, tables = _paged_cache(lens, 2, head_dim, 16, dtype, seed=num_queries)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(lens) * num_queries, 6, head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = _verify_float64(q, k, v, tables, seq_lens, 0.1, num_queries)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        got = cpu.verify_attention(q, k, v, tables, seq_lens, 0.1, num_queries)
        assert (got.double() - want).abs().max() < 2e-6
    # the portable spread (other devices' way) computes in the cache's dtype: bf16 rounds
    qc = q.to(dtype)
    spread = portable.verify_attention(qc, k, v, tables, seq_lens, 0.1, num_queries)
    want = _verify_float64(qc, k, v, tables, seq_lens, 0.1, num_queries)
    assert (spread.double() - want).abs().max() < (2e-5 if dtype == torch.float32 else 2e-2)
