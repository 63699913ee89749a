"""The CPU backend's one-pass row ops (RMSNorm, RMSNorm with the residual add, per-head
RMSNorm with the rotary embedding, SiLU and multiply) against the portable ops, and split
over threads by rows at a prompt's size."""

import pytest
import torch

from kernels import portable
from tests.unit.test_cpu_kernels import cpu, equal_on_1_2_3_threads, needs_cc, qkv_views


@needs_cc
def test_norms_rope_and_activation_equal_the_portable_ops():
    t = 37
    qkv = torch.randn(t, 4 * 32 + 2 * 2 * 32)  # q and k are strided views into it, as in the model
    q, k = qkv[:, :128].view(t, 4, 32), qkv[:, 128:192].view(t, 2, 32)
    qw, kw = torch.randn(32), torch.randn(32)
    table = portable.rotary_cos_sin(512, 32, 1e6)
    pos = torch.randint(0, 512, (t,))
    for got, want in zip(
        cpu.qk_norm_rope(q, k, qw, kw, table, pos, 1e-6),
        portable.qk_norm_rope(q, k, qw, kw, table, pos, 1e-6),
    ):
        assert torch.allclose(got, want, atol=1e-5)
    x, res, w = torch.randn(t, 96), torch.randn(t, 96), torch.randn(96)
    assert torch.allclose(cpu.rms_norm(x, w, 1e-6), portable.rms_norm(x, w, 1e-6), atol=1e-5)
    for got, want in zip(cpu.add_rms_norm(x, res, w, 1e-6), portable.add_rms_norm(x, res, w, 1e-6)):
        assert torch.allclose(got, want, atol=1e-5)
    gate_up = torch.randn(t, 2 * 48) * 4
    assert torch.allclose(cpu.silu_mul(gate_up), portable.silu_mul(gate_up), atol=1e-5)
    # other dtypes are the portable op's, exactly
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(cpu.rms_norm(xb, wb, 1e-6), portable.rms_norm(xb, wb, 1e-6))


@needs_cc
def test_a_prompts_norms_rope_and_activation_split_over_threads_equal_the_portable_ops():
    """At a prompt's size (ROW_SPLIT_MIN_FLOATS and more) the one-pass ops split their
    rows over torch's threads: the same bits on 1, 2 and 3, and the portable ops' values."""
    t = 700
    assert t * 96 >= cpu.ROW_SPLIT_MIN_FLOATS
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # split at this size (where the build has OpenMP), not below it
        assert cpu._row_threads(t * 96) == (2 if cpu._LIB.has_openmp else 1)
        assert cpu._row_threads(cpu.ROW_SPLIT_MIN_FLOATS - 1) == 1
    finally:
        torch.set_num_threads(before)
    qkv = torch.randn(t, 4 * 32 + 2 * 2 * 32)
    q, k = qkv[:, :128].view(t, 4, 32), qkv[:, 128:192].view(t, 2, 32)
    qw, kw = torch.randn(32), torch.randn(32)
    table, pos = portable.rotary_cos_sin(1024, 32, 1e6), torch.randint(0, 1024, (t,))
    got = equal_on_1_2_3_threads(lambda: cpu.qk_norm_rope(q, k, qw, kw, table, pos, 1e-6)[0])
    want = portable.qk_norm_rope(q, k, qw, kw, table, pos, 1e-6)[0]
    assert torch.allclose(got, want, atol=1e-5)
    x, res, w = torch.randn(t, 96), torch.randn(t, 96), torch.randn(96)
    got = equal_on_1_2_3_threads(lambda: torch.cat(cpu.add_rms_norm(x, res, w, 1e-6)))
    assert torch.allclose(got, torch.cat(portable.add_rms_norm(x, res, w, 1e-6)), atol=1e-5)
    got = equal_on_1_2_3_threads(lambda: cpu.rms_norm(x, w, 1e-6))
    assert torch.allclose(got, portable.rms_norm(x, w, 1e-6), atol=1e-5)
    gate_up = torch.randn(t, 2 * 96) * 4
    got = equal_on_1_2_3_threads(lambda: cpu.silu_mul(gate_up))
    assert torch.allclose(got, portable.silu_mul(gate_up), atol=1e-5)


@needs_cc
def test_rope_written_into_a_bf16_cache_rounds_as_the_portable_op(monkeypatch):
    """Into a bf16 cache the C op writes the rotated k and v itself, each value rounded once
    to nearest even: v's rows are the portable op's bits, k's within one bf16 step of them
    (the rotation's fp32 sums may differ in their last bit), and q is the fp32 op's."""
    t, nb, bs = 29, 7, 16
    q, k, v = qkv_views(t, scale=3)
    qw, kw = torch.randn(32), torch.randn(32)
    table, pos = portable.rotary_cos_sin(512, 32, 1e6), torch.randint(0, 512, (t,))
    slots = torch.randperm(nb * bs)[:t]
    caches = [[torch.zeros(nb, bs, 2, 32, dtype=torch.bfloat16) for _ in "kv"] for _ in "ab"]
    with monkeypatch.context() as m:  # the C op's own write, not the portable fallback's
        m.setattr(cpu.portable, "write_kv", None)
        got_q = cpu.qk_norm_rope_write_kv(q, k, v, qw, kw, table, pos, 1e-6, *caches[0], slots)
    want_q = portable.qk_norm_rope_write_kv(q, k, v, qw, kw, table, pos, 1e-6, *caches[1], slots)
    assert got_q.dtype == torch.float32 and torch.allclose(got_q, want_q, atol=1e-5)
    assert torch.equal(caches[0][1], caches[1][1])
    got_k, want_k = caches[0][0].float(), caches[1][0].float()
    assert torch.allclose(got_k, want_k, rtol=2**-7, atol=1e-6)
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots] = True
    assert (got_k.view(nb * bs, -1)[~written] == 0).all()  # no slot but its own is touched
    assert (got_k == want_k).float().mean() > 0.95  # rounded as torch rounds, not truncated
    # a NaN is written as the portable op writes one (NaN), not as a number: one whose
    # payload is in its low bits only, which rounding alone would turn into inf
    v[0, 0, 0] = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)[0]
    cpu.qk_norm_rope_write_kv(q, k, v, qw, kw, table, pos, 1e-6, *caches[0], slots)
    assert caches[0][1].view(nb * bs, 2, 32)[slots[0], 0, 0].isnan()


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kv_slot_outside_the_cache_is_refused_with_nothing_written(dtype):
    """torch's index copy refused a slot past the cache; the C write checks it too, before
    any row is written, rather than writing past the cache's end."""
    t, nb, bs = 5, 3, 16
    q, k, v = qkv_views(t)
    qw, kw = torch.randn(32), torch.randn(32)
    table, pos = portable.rotary_cos_sin(64, 32, 1e6), torch.arange(t)
    k_cache, v_cache = (torch.zeros(nb, bs, 2, 32, dtype=dtype) for _ in "kv")
    for bad in (nb * bs, -1):
        slots = torch.tensor([0, 1, 2, bad, 3])
        with pytest.raises(IndexError, match="outside the cache"):
            cpu.qk_norm_rope_write_kv(q, k, v, qw, kw, table, pos, 1e-6, k_cache, v_cache, slots)
        assert not k_cache.any() and not v_cache.any()


@needs_cc
def test_a_cache_whose_token_row_is_not_the_heads_takes_the_portable_write():
    """The C write puts token t's [Hk, D] row at slot * Hk * D: a cache laid out otherwise
    ([1, 64] rows for k's [2, 32] here) would be written at the wrong places without a
    word. It goes to the portable write, which refuses the shapes."""
    t = 3
    q, k, v = qkv_views(t)
    qw, kw = torch.randn(32), torch.randn(32)
    table, pos = portable.rotary_cos_sin(64, 32, 1e6), torch.arange(t)
    k_cache, v_cache = (torch.zeros(2, 16, 1, 64) for _ in "kv")
    with pytest.raises(RuntimeError):
        cpu.qk_norm_rope_write_kv(
            q, k, v, qw, kw, table, pos, 1e-6, k_cache, v_cache, torch.tensor([0, 1, 2])
        )
