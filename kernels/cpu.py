"""CPU ops beyond the portable ones, in C: paged decode and prefill attention
(cpu_attention.c), and fp32 norms, rotary embedding (written into an fp32 or bf16 cache)
and the gated activation in one pass each (cpu_rows.c), the decode step's bookkeeping
(kernels/cpu_steps.py);
matmuls with bf16 weights (kernels/cpu_linear.py).

The C files are built and loaded by kernels/cpu_build.py; importing this module raises
ImportError (and kernels/backends.py keeps the portable op) where they cannot be built.
Everything the kernels read stays where the worker put it: the cache is read
in place through the block tables, never gathered; except a long prompt chunk's
attention (kernels/cpu_long_chunk.py: on AMX tiles over K and V packed once a call, or where
torch's fused kernel computes it faster over its gathered KV: TORCH_MIN_QUERY_LEN).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from kernels import cpu_long_chunk as long_chunk
from kernels import kv_quant, options, portable
from kernels.cpu_build import load
from kernels.cpu_linear import (  # noqa: F401
    FEATURES,
    HAS_BF16_UNITS,
    describe,
    embedding,
    linear,
    pack_linear_weight,
)
from kernels.cpu_steps import advance_step, compute_slot_mapping, prompt_lookup  # noqa: F401
from kernels.cpu_threads import run_split

_long_chunk = long_chunk.attend  # NOTE: by this name, so a test can count the chunks it takes
MIN_ROWS_PER_THREAD = 8
PREFILL_HEAD_DIM_MULTIPLE = 16  # the prefill kernel's register tile (DB in the C file)
# From this many query tokens a chunk's attention is torch's (its fused CPU kernel, over the
# chunk's KV gathered from the cache), where torch's is the faster: without AVX-512 (even
# with the C kernel at 256 tokens, 1.7x its rate at 2,048, one thread, AVX2;
# launch/bench/attention.py). Below it, and at every length on AVX-512, the C kernel, which
# takes many short chunks in one call (AMD EPYC with AVX512-BF16, 2 threads: 1.4-2.3x
# torch's rate in fp32 from 256 to 2,048 tokens, 1.9-3.7x its bf16 from 256 to 4,096 at
# Qwen3-0.6B's heads; a Xeon with AMX, an fp32 cache: 18.0 against 24.4 ms at 1,024 tokens
# at those heads, 0.59 against 1.09 at 430 at the tiny model's on one thread). NOTE: the C
# kernel splits a chunk by KV head: a long chunk on more threads than its KV heads goes to
# torch's (split by queries). Where the tiles serve a chunk (a bf16 cache on a CPU with
# AMX), they take it from long_chunk.TILES_MIN_QUERY_LEN queries instead; a bf16 cache whose
# head size they do not take goes to torch's from TORCH_QUERY_LEN there (its bf16 kernel runs
# on the tiles: 13.3-13.9 against the C kernel's 25.3-25.8 ms at 1,024 tokens, 16 / 8 heads
# of 80, one thread).
TORCH_QUERY_LEN = 256
TORCH_MIN_QUERY_LEN = TORCH_QUERY_LEN if not FEATURES.is_avx512 else 1 << 62
_LIB = load(options.current[0].build_dir)
_FNS, _PREFILL, _ELEMENTWISE = _LIB.decode, _LIB.prefill, _LIB.elementwise
# NOTE: a one-pass op is split over torch's threads by rows from this many floats (a
# prompt's); below it (a decode step's few rows) waking the threads costs more than it saves
ROW_SPLIT_MIN_FLOATS = 1 << 16


def _row_threads(num_floats: int) -> int:
    return torch.get_num_threads() if _LIB.has_openmp and num_floats >= ROW_SPLIT_MIN_FLOATS else 1


# decode and verify attention read an 8-bit cache's rows in place (kernels/kv_quant.py)
reads_8bit_kv = True


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, host_seq_lens=None):
    """As portable.decode_attention: q [B, Hq, D] over the paged cache -> [B, Hq, D]."""
    fn = _FNS.get(k_cache.dtype)
    if fn is None or not _is_cache_ok(k_cache, v_cache) or q.device.type != "cpu":
        k_cache, v_cache, block_tables = kv_quant.dense(k_cache, v_cache, block_tables, q.dtype)
        return portable.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return _decode(fn, q, k_cache, v_cache, block_tables, seq_lens, scale, 1)


def verify_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale, num_queries, host_seq_lens=None
):
    """As portable.verify_attention, each row's KV read once for all its queries: its Q
    queries ride as Q times the heads ([B, Hk, G, Q, D]), each masked to its own tokens."""
    fn = _FNS.get(k_cache.dtype)
    if fn is None or not _is_cache_ok(k_cache, v_cache) or q.device.type != "cpu":
        k_cache, v_cache, block_tables = kv_quant.dense(k_cache, v_cache, block_tables, q.dtype)
        return portable.verify_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, num_queries
        )
    nq, num_heads, head_dim = q.shape
    b, num_kv_heads = nq // num_queries, k_cache.shape[2]
    # [B, Q, Hk, G, D] -> [B, Hk, G, Q, D]: a KV head's queries together, a query's heads apart
    spread = q.view(b, num_queries, num_kv_heads, -1, head_dim).permute(0, 2, 3, 1, 4)
    rows = spread.reshape(b, num_heads * num_queries, head_dim)
    out = _decode(fn, rows, k_cache, v_cache, block_tables, seq_lens, scale, num_queries)
    out = out.view(b, num_kv_heads, -1, num_queries, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(nq, num_heads, head_dim)


def _decode(fn, q, k_cache, v_cache, block_tables, seq_lens, scale, num_queries):
    """The C decode attention over q [B, Hq', D] (Hq' = Hq * num_queries)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    qf = q.float().contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    tables = _int32_rows(block_tables)
    lens = seq_lens.to(torch.int32).contiguous()
    row = num_heads * head_dim

    def run(b0: int, b1: int, num_threads: int = 1) -> int:
        return fn(
            qf.data_ptr() + 4 * b0 * row,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr() + 4 * b0 * tables.stride(0),
            tables.stride(0),
            lens.data_ptr() + 4 * b0,
            out.data_ptr() + 4 * b0 * row,
            b1 - b0,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            k_cache.stride(0),
            k_cache.stride(1),
            scale,
            num_threads,
            num_queries,
        )

    if _LIB.has_openmp:  # the kernel deals (sequence, KV head) items out to its threads
        if run(0, num_seqs, torch.get_num_threads()):
            raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    else:
        run_split(run, num_seqs, num_seqs // MIN_ROWS_PER_THREAD)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def _int32_rows(block_tables: torch.Tensor) -> torch.Tensor:
    tables = block_tables.to(torch.int32)
    return tables if tables.stride(-1) == 1 else tables.contiguous()


def _is_cache_ok(k_cache, v_cache) -> bool:
    """A layout the C kernels read in place: [blocks, block_size, Hk, D], each token's row whole."""
    return (
        k_cache.device.type == "cpu"
        and k_cache.stride(-1) == 1
        and k_cache.stride(-2) == k_cache.shape[-1]
        and v_cache.stride() == k_cache.stride()
    )


def prefill_attention(
    q, k_cache, v_cache, block_tables, query_lens, context_lens, scale, meta=None
):
    """As portable.prefill_attention: causal attention of packed chunks [T, Hq, D] over
    their cached KV, read in place. Work is split by (chunk, KV head) over the threads.
    A chunk of long_chunk.TILES_MIN_QUERY_LEN queries or more goes to the tiles where they
    serve (kernels/cpu_long_chunk.py), else one of TORCH_MIN_QUERY_LEN or more (of
    TORCH_QUERY_LEN where the rule below says) to torch's fused kernel."""
    fn = _PREFILL.get(k_cache.dtype)
    if (
        fn is None
        or not _is_cache_ok(k_cache, v_cache)
        or q.device.type != "cpu"
        or q.shape[-1] % PREFILL_HEAD_DIM_MULTIPLE
    ):
        return portable.prefill_attention(
            q, k_cache, v_cache, block_tables, query_lens, context_lens, scale, meta
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    qf = q.float().contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    row_starts = [0, *accumulate(query_lens)]
    long_len = TORCH_MIN_QUERY_LEN
    if long_chunk.is_tiled(q, k_cache):
        long_len = long_chunk.TILES_MIN_QUERY_LEN
    elif (
        torch.get_num_threads() > num_kv_heads  # NOTE: C splits a chunk by KV head at most
        or (k_cache.dtype == torch.bfloat16 and FEATURES.is_amx_bf16)  # torch's bf16 on tiles
    ):
        long_len = min(long_len, TORCH_QUERY_LEN)
    short = [i for i, n in enumerate(query_lens) if n < long_len]
    # NOTE: a bf16 cache on a CPU with bf16 units: torch's kernel runs in bf16, as
    # transformers' bf16 attention does (3.9x its fp32 rate at 1,024 tokens, Xeon with AMX,
    # timed in process), and the KV is not widened for it
    long_dtype = torch.bfloat16 if k_cache.dtype == torch.bfloat16 and HAS_BF16_UNITS else qf.dtype
    for i, n in enumerate(query_lens):
        if n >= long_len:
            a = row_starts[i]
            _long_chunk(
                qf[a : a + n],
                k_cache,
                v_cache,
                block_tables[i],
                context_lens[i],
                scale,
                long_dtype,
                out[a : a + n],
            )
    if not short:
        return out if q.dtype == torch.float32 else out.to(q.dtype)
    tables = _int32_rows(block_tables)
    if meta is None or meta.dtype != torch.int32 or not meta.is_contiguous():
        meta = torch.tensor([row_starts[:-1], query_lens, context_lens], dtype=torch.int32)
    if len(short) < len(query_lens):  # NOTE: the C kernel writes each chunk's rows at its start
        tables, meta = tables[short].contiguous(), meta[:, short].contiguous()
    starts, q_lens, ctx_lens = meta

    def run(w0: int, w1: int) -> int:
        return fn(
            qf.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            starts.data_ptr(),
            q_lens.data_ptr(),
            ctx_lens.data_ptr(),
            out.data_ptr(),
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            k_cache.stride(0),
            k_cache.stride(1),
            scale,
            w0,
            w1,
        )

    num_items = meta.shape[1] * num_kv_heads
    run_split(run, num_items, num_items)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def _rows_ok(x: torch.Tensor) -> bool:
    """fp32 on the CPU, last dimension contiguous, rows evenly strided: what the C ops read."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.stride(-1) == 1
        and (x.dim() == 2 or x.is_contiguous() or x[0].is_contiguous())
    )


def rms_norm(x, weight, eps):
    """As portable.rms_norm, in one pass (fp32; other dtypes: the portable op)."""
    if not (_rows_ok(x) and x.dim() == 2 and weight.dtype == torch.float32):
        return portable.rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    _ELEMENTWISE["rms_norm"](
        x.data_ptr(),
        x.stride(0),
        None,
        0,
        weight.data_ptr(),
        out.data_ptr(),
        None,
        x.shape[0],
        x.shape[1],
        eps,
        _row_threads(x.numel()),
    )
    return out


def add_rms_norm(x, residual, weight, eps):
    """As portable.add_rms_norm: (rms_norm(x + residual), x + residual), in one pass."""
    if not (
        _rows_ok(x)
        and _rows_ok(residual)
        and x.dim() == 2
        and x.shape == residual.shape
        and weight.dtype == torch.float32
    ):
        return portable.add_rms_norm(x, residual, weight, eps)
    out, summed = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    _ELEMENTWISE["rms_norm"](
        x.data_ptr(),
        x.stride(0),
        residual.data_ptr(),
        residual.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        summed.data_ptr(),
        x.shape[0],
        x.shape[1],
        eps,
        _row_threads(x.numel()),
    )
    return out, summed


def _norm_rope(x, weight, cos_sin, positions, eps, out=None, slots=None):
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype)
    failed = _ELEMENTWISE["norm_rope_bf16" if out.dtype == torch.bfloat16 else "norm_rope"](
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        cos_sin.data_ptr(),
        positions.data_ptr(),
        out.data_ptr(),
        None if slots is None else slots.data_ptr(),
        0 if slots is None else out.numel() // (x.shape[1] * x.shape[2]),
        x.shape[0],
        x.shape[1],
        x.shape[2],
        eps,
        _row_threads(x.shape[0] * x.shape[1] * x.shape[2]),
    )
    if failed:
        raise IndexError("a KV slot is outside the cache")
    return out


def _is_rope_ok(q, k, q_weight, cos_sin, positions) -> bool:
    return (
        _rows_ok(q)
        and _rows_ok(k)
        and q.stride(1) == q.shape[2]
        and k.stride(1) == k.shape[2]
        and cos_sin.dtype == torch.float32
        and cos_sin.is_contiguous()
        and positions.is_contiguous()
        and q_weight.dtype == torch.float32
    )


def qk_norm_rope(q, k, q_weight, k_weight, cos_sin, positions, eps):
    """As portable.qk_norm_rope: per-head RMSNorm and the rotation in one pass per tensor."""
    positions = positions.to(torch.int64)
    if not _is_rope_ok(q, k, q_weight, cos_sin, positions):
        return portable.qk_norm_rope(q, k, q_weight, k_weight, cos_sin, positions, eps)
    return _norm_rope(q, q_weight, cos_sin, positions, eps), _norm_rope(
        k, k_weight, cos_sin, positions, eps
    )


def qk_norm_rope_write_kv(
    q, k, v, q_weight, k_weight, cos_sin, positions, eps, k_cache, v_cache, slot_mapping
):
    """As portable.qk_norm_rope_write_kv; into an fp32 or bf16 cache, the rotated k and v
    are written straight to their slots (no [T, Hk, D] intermediate, no index copy; in bf16
    rounded once, as the portable op rounds)."""
    positions = positions.to(torch.int64)
    if not (
        k_cache.dtype in (torch.float32, torch.bfloat16)
        and v_cache.shape == k_cache.shape  # NOTE: else k written, then v refused
        and v_cache.dtype == k_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and _rows_ok(v)
        and v.stride(1) == v.shape[2]
        and k_cache.shape[-2:] == k.shape[1:] == v.shape[1:]  # a token's row: [Hk, D]
        and _is_rope_ok(q, k, q_weight, cos_sin, positions)
    ):
        q, k = qk_norm_rope(q, k, q_weight, k_weight, cos_sin, positions, eps)
        portable.write_kv(k_cache, v_cache, k, v, slot_mapping)
        return q
    _norm_rope(k, k_weight, cos_sin, positions, eps, k_cache, slot_mapping)
    row = v.shape[1] * v.shape[2]
    failed = _ELEMENTWISE[
        "scatter_rows_bf16" if v_cache.dtype == torch.bfloat16 else "scatter_rows"
    ](
        v.data_ptr(),
        v.stride(0),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        v_cache.numel() // row,
        v.shape[0],
        row,
    )
    if failed:
        raise IndexError("a KV slot is outside the cache")
    return _norm_rope(q, q_weight, cos_sin, positions, eps)


def silu_mul(gate_up):
    """As portable.silu_mul, in one pass."""
    if not (_rows_ok(gate_up) and gate_up.dim() == 2):
        return portable.silu_mul(gate_up)
    size = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], size), dtype=gate_up.dtype)
    _ELEMENTWISE["silu_mul"](
        gate_up.data_ptr(),
        gate_up.stride(0),
        out.data_ptr(),
        gate_up.shape[0],
        size,
        _row_threads(out.numel()),
    )
    return out
