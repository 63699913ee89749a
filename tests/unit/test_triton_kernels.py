"""The Triton kernels against the portable ops on random inputs, fp32 and bf16.
On a CUDA machine they run on the GPU; elsewhere, where Triton is installed, under
Triton's interpreter on the CPU; without Triton they are skipped (CI runs the
portable path)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton_cuda = pytest.importorskip("kernels.triton_cuda", reason="Triton is not installed")
from kernels import portable  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _close(a, b, dtype):
    err = (a.float() - b.float()).abs().max().item()
    scale = b.float().abs().max().item() + 1e-6
    assert err / scale < TOL[dtype], f"relative error {err / scale:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_add(dtype):
    x, r = torch.randn(2, 7, 96, device=DEV).to(dtype).unbind(0)
    w = torch.randn(96, device=DEV).to(dtype)
    _close(triton_cuda.rms_norm(x, w, 1e-6), portable.rms_norm(x, w, 1e-6), dtype)
    out, res = triton_cuda.add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_res = portable.add_rms_norm(x, r, w, 1e-6)
    _close(out, ref_out, dtype)
    assert torch.equal(res, ref_res)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_on_strided_views(dtype):
    hq, hk, d, t = 4, 2, 32, 9
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEV).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    qw, kw = torch.randn(d, device=DEV).to(dtype), torch.randn(d, device=DEV).to(dtype)
    table = portable.rotary_cos_sin(64, d, 1e6, DEV)
    pos = torch.randint(0, 64, (t,), device=DEV)
    got = triton_cuda.qk_norm_rope(q, k, qw, kw, table, pos, 1e-6)
    ref = portable.qk_norm_rope(q, k, qw, kw, table, pos, 1e-6)
    _close(got[0], ref[0], dtype)
    _close(got[1], ref[1], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_write_kv_fused(dtype):
    hq, hk, d, t = 4, 2, 32, 6
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEV).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    qw, kw = torch.randn(d, device=DEV).to(dtype), torch.randn(d, device=DEV).to(dtype)
    table = portable.rotary_cos_sin(64, d, 1e6, DEV)
    pos = torch.randint(0, 64, (t,), device=DEV)
    slots = torch.tensor([5, 0, 17, 3, 30, 9], device=DEV)
    caches = [torch.zeros(4, 8, hk, d, device=DEV, dtype=dtype) for _ in range(4)]
    got_q = triton_cuda.qk_norm_rope_write_kv(
        q, k, v, qw, kw, table, pos, 1e-6, caches[0], caches[1], slots
    )
    ref_q = portable.qk_norm_rope_write_kv(
        q, k, v, qw, kw, table, pos, 1e-6, caches[2], caches[3], slots
    )
    _close(got_q, ref_q, dtype)
    _close(caches[0], caches[2], dtype)
    assert torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv(dtype):
    kc, vc = torch.zeros(2, 6, 4, 2, 16, device=DEV, dtype=dtype).unbind(0)
    k, v = torch.randn(2, 5, 2, 16, device=DEV).to(dtype).unbind(0)
    slots = torch.tensor([3, 0, 23, 9, 12], device=DEV)
    rk, rv = kc.clone(), vc.clone()
    triton_cuda.write_kv(kc, vc, k, v, slots)
    portable.write_kv(rk, rv, k, v, slots)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,batch", [(4, 4, 1), (8, 2, 3), (16, 2, 40)])
def test_paged_decode_attention(dtype, hq, hk, batch):
    d, bs, nb = 32, 16, 64
    kc = torch.randn(nb, bs, hk, d, device=DEV).to(dtype)
    vc = torch.randn(nb, bs, hk, d, device=DEV).to(dtype)
    width = 12
    tables = torch.randint(1, nb, (batch, width), device=DEV, dtype=torch.int32)
    seq_lens = torch.randint(1, width * bs + 1, (batch,), device=DEV, dtype=torch.int32)
    seq_lens[0] = width * bs  # one full-width sequence, split over many programs
    q = torch.randn(batch, hq, d, device=DEV).to(dtype)
    got = triton_cuda.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5)
    ref = portable.decode_attention(q, kc, vc, tables, seq_lens, d**-0.5)
    _close(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_with_and_without_context(dtype):
    hq, hk, d, bs = 8, 2, 32, 16
    kc = torch.randn(40, bs, hk, d, device=DEV).to(dtype)
    vc = torch.randn(40, bs, hk, d, device=DEV).to(dtype)
    tables = torch.randperm(39, device=DEV)[:18].view(2, 9).int() + 1
    qlens, ctx = [37, 70], [0, 30]
    q = torch.randn(sum(qlens), hq, d, device=DEV).to(dtype)
    meta = torch.tensor([[0, qlens[0]], qlens, ctx], dtype=torch.int32, device=DEV)
    got = triton_cuda.prefill_attention(q, kc, vc, tables, qlens, ctx, d**-0.5, meta)
    ref = portable.prefill_attention(q, kc, vc, tables, qlens, ctx, d**-0.5)
    _close(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    x = torch.randn(5, 2 * 1500, device=DEV).to(dtype)
    _close(triton_cuda.silu_mul(x), portable.silu_mul(x), dtype)
