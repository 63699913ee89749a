"""Each portable op against a plain dense reference."""

import math

import pytest
import torch

from kernels import portable

torch.manual_seed(0)


def test_rms_norm_matches_formula():
    x, w = torch.randn(5, 32), torch.randn(32)
    ref = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(portable.rms_norm(x, w, 1e-6), ref, atol=1e-6)
    out, res = portable.add_rms_norm(x, x * 2, w, 1e-6)
    assert torch.allclose(res, 3 * x) and torch.allclose(out, portable.rms_norm(3 * x, w, 1e-6))


def test_qk_norm_rope_matches_complex_rotation():
    d, theta = 16, 10000.0
    q, k = torch.randn(6, 4, d), torch.randn(6, 2, d)
    qw, kw = torch.randn(d), torch.randn(d)
    pos = torch.tensor([0, 1, 5, 9, 31, 2])
    table = portable.rotary_cos_sin(64, d, theta)
    q_out, k_out = portable.qk_norm_rope(q, k, qw, kw, table, pos, 1e-6)

    def ref(x, w):
        x = portable.rms_norm(x, w, 1e-6)
        half = d // 2
        freqs = pos[:, None].double() / theta ** (torch.arange(half).double() * 2 / d)
        rot = torch.polar(torch.ones_like(freqs), freqs)[:, None, :]
        z = torch.complex(x[..., :half].double(), x[..., half:].double()) * rot
        return torch.cat([z.real, z.imag], -1).float()

    assert torch.allclose(q_out, ref(q, qw), atol=1e-4)
    assert torch.allclose(k_out, ref(k, kw), atol=1e-4)


def test_write_kv_by_slot_mapping():
    k_cache, v_cache = torch.zeros(4, 8, 2, 3), torch.zeros(4, 8, 2, 3)
    k, v = torch.randn(5, 2, 3), torch.randn(5, 2, 3)
    slots = torch.tensor([9, 0, 31, 17, 8])
    portable.write_kv(k_cache, v_cache, k, v, slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s // 8, s % 8], k[i]) and torch.equal(
            v_cache[s // 8, s % 8], v[i]
        )
    assert k_cache.abs().sum(-1).sum(-1).count_nonzero() == 5


def _paged(seqs_kv, block_size, num_blocks, perm_seed=0):
    """Scatter dense per-sequence K/V into shuffled blocks. -> caches, block_tables."""
    hk, d = seqs_kv[0][0].shape[1:]
    k_cache, v_cache = (
        torch.zeros(num_blocks, block_size, hk, d),
        torch.zeros(num_blocks, block_size, hk, d),
    )
    free = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(perm_seed)) + 1
    width = max(math.ceil(k.shape[0] / block_size) for k, _ in seqs_kv)
    tables = torch.zeros(len(seqs_kv), width, dtype=torch.int32)
    used = 0
    for i, (k, v) in enumerate(seqs_kv):
        n = math.ceil(k.shape[0] / block_size)
        blocks = free[used : used + n]
        used += n
        tables[i, :n] = blocks.int()
        slots = (
            blocks[torch.arange(k.shape[0]) // block_size] * block_size
            + torch.arange(k.shape[0]) % block_size
        )
        portable.write_kv(k_cache, v_cache, k, v, slots)
    return k_cache, v_cache, tables


def _dense_attention(q, k, v, causal_offset):
    """q [Q, Hq, D], k/v [S, Hk, D]; query i sees keys <= causal_offset + i."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), k.double()) / math.sqrt(q.shape[-1])
    allowed = (
        torch.arange(k.shape[0])[None, :] <= (causal_offset + torch.arange(q.shape[0]))[:, None]
    )
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2)])
def test_prefill_attention_varlen_with_context(hq, hk):
    d, bs = 16, 4
    totals, ctxs = [1, 7, 8, 13], [0, 3, 0, 9]
    kv = [(torch.randn(t, hk, d), torch.randn(t, hk, d)) for t in totals]
    k_cache, v_cache, tables = _paged(kv, bs, 32)
    qs = [torch.randn(t - c, hq, d) for t, c in zip(totals, ctxs)]
    out = portable.prefill_attention(
        torch.cat(qs), k_cache, v_cache, tables, [q.shape[0] for q in qs], ctxs, d**-0.5
    )
    refs = torch.cat([_dense_attention(q, k, v, c) for q, (k, v), c in zip(qs, kv, ctxs)])
    assert torch.allclose(out, refs, atol=1e-5)


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2)])
def test_decode_attention_paged(hq, hk):
    d, bs = 16, 4
    lens = [1, 4, 5, 17]
    kv = [(torch.randn(n, hk, d), torch.randn(n, hk, d)) for n in lens]
    k_cache, v_cache, tables = _paged(kv, bs, 32, perm_seed=1)
    q = torch.randn(len(lens), hq, d)
    out = portable.decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), d**-0.5
    )
    for i, ((k, v), n) in enumerate(zip(kv, lens)):
        assert torch.allclose(out[i], _dense_attention(q[i : i + 1], k, v, n - 1)[0], atol=1e-5)


def test_slot_mapping_and_step_advance():
    tables = torch.tensor([[3, 7, 0], [5, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 1], dtype=torch.int32)
    slots = torch.zeros(2, dtype=torch.int64)
    portable.compute_slot_mapping(seq_lens, tables, 4, slots)
    assert slots.tolist() == [7 * 4 + 1, 5 * 4 + 0]
    ids = torch.tensor([1, 2])
    inc = torch.tensor([1, 0], dtype=torch.int32)
    history = torch.zeros(3, 8, dtype=torch.int32)
    portable.advance_step(ids, torch.tensor([8, 9]), seq_lens, inc, history)
    assert ids.tolist() == [8, 9] and seq_lens.tolist() == [7, 1]
    # each row's token at its length before the step (a padding row's too); the rest kept
    assert history[0].tolist() == [0] * 6 + [8, 0] and history[1].tolist() == [0, 9] + [0] * 6
    assert not history[2].any()


@pytest.mark.parametrize("is_packed", [False, True])
def test_a_bf16_linear_under_fp32_activations_takes_an_fp32_bias(is_packed):
    """Defect: a host keeps a bias in the activations' fp32 (qwen3.set_activation_dtype), and
    the portable bf16 linear handed it to torch beside the bf16 weight, which refuses mixed
    dtypes: a bf16 model with attention bias could not run where no faster linear served.
    Packed (oneDNN's layout, where the CPU has bf16 units) or not, it runs and matches."""
    if is_packed and not portable.IS_BF16_NATIVE:
        pytest.skip("this CPU's oneDNN has no bf16: nothing is packed here")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=g).bfloat16()
    x, bias = torch.randn(5, 32, generator=g), torch.randn(48, generator=g)
    w = portable.pack_linear_weight(weight) if is_packed else weight
    assert w.is_mkldnn == is_packed
    out = portable.linear(x, w, bias)
    ref = x.double() @ weight.double().T + bias.double()
    assert out.dtype == torch.float32 and torch.allclose(out.double(), ref, rtol=0.05, atol=0.1)
