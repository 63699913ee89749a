"""A prompt chunk's attention on AMX tiles (kernels/cpu_attention_tiles.c through
kernels/cpu_long_chunk.py) against float64 on the same bf16 inputs, beside torch's kernel
on the same chunk; the fallback where the tiles refuse. Runs where the CPU has AMX-BF16."""

import importlib
import os
import shutil

import pytest
import torch

HAS_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
long_chunk = importlib.import_module("kernels.cpu_long_chunk") if HAS_CC else None
needs_tiles = pytest.mark.skipif(
    not (HAS_CC and long_chunk.IS_TILED), reason="this CPU (or process) has no AMX-BF16 tiles"
)


def _chunk(n, context_len, num_heads, num_kv_heads, head_dim, seed, block_size=16):
    """q [n, Hq, D] fp32 as a strided view (the model's q is a slice of its projection), a
    shuffled paged bf16 cache holding context and chunk, and its block table."""
    g = torch.Generator().manual_seed(seed)
    total = context_len + n
    num_blocks = -(-total // block_size)
    shape = (num_blocks + 3, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g).bfloat16()
    v = torch.randn(shape, generator=g).bfloat16()
    table = torch.randperm(num_blocks + 3, generator=g)[:num_blocks].int()
    wide = torch.randn(n, num_heads + 2, head_dim, generator=g) * 2
    return wide[:, :num_heads], k, v, table


def _float64(q, k_cache, v_cache, table, context_len, scale):
    """The chunk's causal attention in float64 on q rounded to bf16 (as both kernels round it)."""
    total = context_len + q.shape[0]
    k = k_cache[table.long()].flatten(0, 1)[:total].double()
    v = v_cache[table.long()].flatten(0, 1)[:total].double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.bfloat16().double(), k) * scale
    allowed = torch.arange(total)[None, :] <= torch.arange(context_len, total)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@needs_tiles
@pytest.mark.parametrize(
    "n,context_len,heads,block_size",
    [
        (16, 0, (4, 2, 32), 16),
        (33, 50, (16, 8, 128), 16),  # a block of 32 rows and one row beyond it
        (100, 0, (6, 2, 64), 16),
        (257, 300, (16, 8, 128), 16),  # keys not a multiple of 32, over a context
        (1024, 0, (16, 8, 128), 16),
        (40, 23, (3, 3, 256), 5),  # a KV head a query head, the widest head, odd blocks
        (70, 1, (8, 1, 96), 32),  # one KV head for eight
    ],
)
def test_tiles_attention_is_nearer_float64_than_torchs(n, context_len, heads, block_size):
    q, k, v, table = _chunk(n, context_len, *heads, seed=n + context_len, block_size=block_size)
    scale = heads[2] ** -0.5
    want = _float64(q, k, v, table, context_len, scale)
    out = torch.full(q.shape, float("nan"))
    before = torch.get_num_threads()
    try:
        got = []
        for threads in (1, 2, 3):  # each block of rows is one thread's: the same bits
            torch.set_num_threads(threads)
            path = long_chunk.attend(q, k, v, table, context_len, scale, torch.bfloat16, out)
            assert path == "tiles"
            got.append(out.clone())
        assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
    finally:
        torch.set_num_threads(before)
    error = (got[0].double() - want).abs()
    theirs = (long_chunk._torch_chunk(q, k, v, table, context_len, scale, torch.bfloat16)).double()
    their_error = (theirs - want).abs()
    # P is rounded to bf16 on both; torch's output is bf16 too, the tiles' fp32
    assert error.max() < 1e-2 and error.mean() <= their_error.mean()


@needs_tiles
def test_a_head_size_off_the_tiles_or_a_refusal_goes_to_torchs_kernel(monkeypatch):
    q, k, v, table = _chunk(40, 8, 4, 2, 48, seed=1)  # 48: not whole tiles of features
    out = torch.empty(q.shape)
    path = long_chunk.attend(q, k, v, table, 8, 0.1, torch.bfloat16, out)
    assert path == "torch"
    assert torch.allclose(out.double(), _float64(q, k, v, table, 8, 0.1), atol=2e-2)
    # the kernel refusing (no scratch): the same chunk through torch's, still right
    q, k, v, table = _chunk(40, 8, 4, 2, 64, seed=2)
    lib = long_chunk._LIB._replace(prefill_tiles=lambda *args: -1)
    monkeypatch.setattr(long_chunk, "_LIB", lib)
    path = long_chunk.attend(q, k, v, table, 8, 0.1, torch.bfloat16, out := torch.empty(q.shape))
    assert path == "torch"
    assert torch.allclose(out.double(), _float64(q, k, v, table, 8, 0.1), atol=2e-2)
