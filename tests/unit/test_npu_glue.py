"""The Ascend backend's glue, on the CPU: a stand-in torch_npu whose ops follow
their documented semantics checks that kernels/npu.py passes the right tensors
(and the worker's host lengths) and gets the portable results. It cannot show
that the real ops behave so; that needs Ascend hardware."""

import sys
import types

import pytest
import torch

from kernels import portable


def _fake_torch_npu():
    calls = {"paged": [], "cache": 0, "fia": 0}

    def reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
        assert slot_indices.dtype == torch.int32 and key.is_contiguous()
        calls["cache"] += 1
        portable.write_kv(key_cache, value_cache, key, value, slot_indices)

    def paged_attention(
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        num_heads,
        scale_value,
        block_table,
        context_lens,
        out,
    ):
        assert context_lens.device.type == "cpu" and num_kv_heads == key_cache.shape[2]
        calls["paged"].append(context_lens.tolist())
        out.copy_(
            portable.decode_attention(
                query, key_cache, value_cache, block_table, context_lens, scale_value
            )
        )

    def fused_infer_attention_score(
        q,
        k,
        v,
        num_heads,
        num_key_value_heads,
        input_layout,
        scale,
        atten_mask,
        sparse_mode,
        actual_seq_lengths,
        actual_seq_lengths_kv,
    ):
        assert (
            input_layout == "TND"
            and sparse_mode == 3
            and actual_seq_lengths == actual_seq_lengths_kv
        )
        calls["fia"] += 1
        out, start = torch.empty_like(q), 0
        for end in actual_seq_lengths:
            n = end - start
            kc = k[start:end].view(1, n, num_key_value_heads, -1)
            vc = v[start:end].view(1, n, num_key_value_heads, -1)
            out[start:end] = portable.prefill_attention(
                q[start:end], kc, vc, torch.zeros(1, 1, dtype=torch.int32), [n], [0], scale
            )
            start = end
        return out, None

    mod = types.ModuleType("torch_npu")
    mod._npu_reshape_and_cache = reshape_and_cache
    mod._npu_paged_attention = paged_attention
    mod.npu_fused_infer_attention_score = fused_infer_attention_score
    return mod, calls


@pytest.fixture
def npu(monkeypatch):
    mod, calls = _fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    sys.modules.pop("kernels.npu", None)
    import kernels.npu as npu_ops

    yield npu_ops, calls
    sys.modules.pop("kernels.npu", None)


def test_npu_ops_match_portable(npu):
    ops, calls = npu
    torch.manual_seed(0)
    hq, hk, d, bs = 8, 2, 16, 4
    kc, vc = torch.zeros(2, 20, bs, hk, d).unbind(0)
    rk, rv = kc.clone(), vc.clone()
    lens = [5, 9]
    k, v = torch.randn(2, sum(lens), hk, d).unbind(0)
    tables = torch.tensor([[3, 7, 0], [1, 2, 9]], dtype=torch.int32)
    slots = torch.cat(
        [
            tables[i, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
            for i, n in enumerate(lens)
        ]
    )
    ops.write_kv(kc, vc, k, v, slots)
    portable.write_kv(rk, rv, k, v, slots)
    assert torch.equal(kc, rk) and calls["cache"] == 1
    q = torch.randn(sum(lens), hq, d)
    got = ops.prefill_attention(q, kc, vc, tables, lens, [0, 0], d**-0.5)
    ref = portable.prefill_attention(q, kc, vc, tables, lens, [0, 0], d**-0.5)
    assert torch.allclose(got, ref, atol=1e-5) and calls["fia"] == 1
    qd = torch.randn(2, hq, d)
    seq = torch.tensor(lens, dtype=torch.int32)
    got = ops.decode_attention(qd, kc, vc, tables, seq, d**-0.5, host_seq_lens=seq.clone())
    assert torch.allclose(
        got, portable.decode_attention(qd, kc, vc, tables, seq, d**-0.5), atol=1e-5
    )


def test_worker_hands_its_host_lengths_to_the_npu_kernels(npu, tiny_model, monkeypatch):
    """The decode kernels get the host mirror, equal to the device lengths, every step."""
    import kernels
    from common.base.config import WorkerConfig
    from common.base.request import SamplingParams
    from common.engine.worker import DeviceWorker
    from kernels import backends
    from launch.tools.offline import generate

    ops, calls = npu
    merged = backends._merge(ops)
    monkeypatch.setattr(kernels, "backend_for", lambda t: merged)
    prompts = [[1, 2, 3], list(range(4, 24))]
    params = [SamplingParams(max_tokens=6, ignore_eos=True)] * 2
    with DeviceWorker(WorkerConfig(model=str(tiny_model), kv_cache_memory=2**20)) as w:
        out = generate(w, prompts, params)
    monkeypatch.undo()
    with DeviceWorker(WorkerConfig(model=str(tiny_model), kv_cache_memory=2**20)) as w:
        ref = generate(w, prompts, params)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in ref]
    # Each layer of each decode step saw lengths prompt+1, prompt+2, ... from the host mirror.
    layers = w.spec.num_layers
    assert len(calls["paged"]) == 5 * layers
    assert [calls["paged"][step * layers] for step in range(5)] == [
        [4 + s, 21 + s] for s in range(5)
    ]
