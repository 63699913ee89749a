"""The CPU backend (kernels/cpu.py, C) against the portable ops it must equal, the
prefill lanes against one lane, and --cpus read (the flags and the kernels in processes of
their own: tests/cluster/test_cpu_kernels_processes.py)."""

import importlib
import os
import shutil
from unittest import mock

import pytest
import torch

from kernels import portable
from kernels.backends import backend_for

HAS_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
# NOTE: where a compiler is, a kernel that fails to build fails here, not skips.
cpu = importlib.import_module("kernels.cpu") if HAS_CC else None
cpu_linear = importlib.import_module("kernels.cpu_linear") if HAS_CC else None
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler: the portable ops serve")


def _paged_cache(lens, num_kv_heads, head_dim, block_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    width = max((n + block_size - 1) // block_size for n in lens)
    num_blocks = len(lens) * width + 1
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    # shuffled blocks: a sequence's blocks are nowhere near each other
    tables = (
        (torch.randperm(num_blocks - 1, generator=g)[: len(lens) * width] + 1)
        .int()
        .view(len(lens), width)
    )
    return k, v, tables


def equal_on_1_2_3_threads(call) -> torch.Tensor:
    """call()'s result on one torch thread, checked equal, bit for bit, on two and three."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = call()
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(one, call()), f"{threads} threads"
    finally:
        torch.set_num_threads(before)
    return one


def qkv_views(t: int, scale: float = 1.0):
    """q [t, 4, 32], k and v [t, 2, 32]: strided views into one [t, 256] projection, as the
    model's are."""
    qkv = torch.randn(t, 4 * 32 + 2 * 2 * 32) * scale
    return qkv[:, :128].view(t, 4, 32), qkv[:, 128:192].view(t, 2, 32), qkv[:, 192:].view(t, 2, 32)


@needs_cc
def test_the_cpu_backend_is_the_c_one_where_a_compiler_is():
    """CI has a compiler: the exactness tests then run through the C ops, not a silent fallback."""
    ops = backend_for(torch.zeros(1))
    assert ops.decode_attention is cpu.decode_attention and ops.qk_norm_rope is cpu.qk_norm_rope
    assert ops.prefill_attention is cpu.prefill_attention


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d", [(4, 2, 32), (8, 8, 16), (6, 1, 64)])
def test_decode_attention_equals_the_portable_op(dtype, hq, hk, d):
    lens = [1, 5, 16, 17, 33, 200]
    k, v, tables = _paged_cache(lens, hk, d, 16, dtype, seed=hq * d)
    q = torch.randn(len(lens), hq, d).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = portable.decode_attention(q, k, v, tables, seq_lens, d**-0.5)
    got = cpu.decode_attention(q, k, v, tables, seq_lens, d**-0.5)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 2e-2)
    # and against float64 on the same (rounded) inputs: the kernel's sums are fp32
    want64 = portable.decode_attention(
        q.double(), k.double(), v.double(), tables, seq_lens, d**-0.5
    )
    assert torch.allclose(got.double(), want64, atol=1e-5 if dtype == torch.float32 else 1e-2)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d", [(4, 2, 32), (8, 8, 16), (6, 1, 64), (3, 3, 128)])
def test_prefill_attention_equals_the_portable_op(dtype, hq, hk, d):
    # chunks with and without a cached context; odd query counts pair a vector with itself
    query_lens, context_lens = [37, 1, 100, 3, 64], [0, 50, 17, 0, 33]
    k, v, tables = _paged_cache(
        [a + b for a, b in zip(query_lens, context_lens)], hk, d, 16, dtype, seed=hq + d
    )
    q = torch.randn(sum(query_lens), hq, d).to(dtype)
    want = portable.prefill_attention(q, k, v, tables, query_lens, context_lens, d**-0.5)
    got = cpu.prefill_attention(q, k, v, tables, query_lens, context_lens, d**-0.5)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 2e-2)


def _naive_prefill_attention(q, k_cache, v_cache, tables, query_lens, context_lens, scale):
    """In float64, chunk by chunk: each query sees its context and its chunk up to itself."""
    out, start, bs = [], 0, k_cache.shape[1]
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        total = ctx + n
        blocks = tables[i, : (total + bs - 1) // bs].long()
        k = k_cache[blocks].flatten(0, 1)[:total].double()  # [total, Hk, D]
        v = v_cache[blocks].flatten(0, 1)[:total].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        qi = q[start : start + n].double()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        allowed = torch.arange(total)[None, :] <= torch.arange(ctx, total)[:, None]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += n
    return torch.cat(out)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_chunks_beside_short_ones_equal_the_naive_attention(dtype, monkeypatch):
    """Chunks from cpu.TORCH_MIN_QUERY_LEN queries (from the tiles' own length where they serve)
    go to the long-chunk path, the others to the C one in one call: each chunk's rows land in
    place, with and without a cached context. (Set here: a CPU where the C kernel is the
    faster at every length sends none to torch.)"""
    monkeypatch.setattr(cpu, "TORCH_MIN_QUERY_LEN", cpu.TORCH_QUERY_LEN)
    n = cpu.TORCH_QUERY_LEN
    to_torch, reference = [], cpu._long_chunk  # torch's kernel: each chunk's query count
    monkeypatch.setattr(
        cpu, "_long_chunk", lambda *a, **k: to_torch.append([len(a[0])]) or reference(*a, **k)
    )
    query_lens, context_lens = [5, n, 40, n + 37, 1], [11, 0, 0, 70, 300]
    k, v, tables = _paged_cache(
        [a + b for a, b in zip(query_lens, context_lens)], 2, 32, 16, dtype, seed=3
    )
    q = torch.randn(sum(query_lens), 4, 32).to(dtype)
    want = _naive_prefill_attention(q, k, v, tables, query_lens, context_lens, 32**-0.5)
    for lens in (query_lens, query_lens[1:2]):  # a mix, and a lone long chunk
        i = query_lens.index(lens[0])
        a = sum(query_lens[:i])
        rows = slice(a, a + sum(lens))
        got = cpu.prefill_attention(
            q[rows],
            k,
            v,
            tables[i : i + len(lens)],
            lens,
            context_lens[i : i + len(lens)],
            32**-0.5,
        )
        assert got.dtype == dtype
        assert torch.allclose(
            got.double(), want[rows], atol=1e-5 if dtype == torch.float32 else 2e-2
        )
    # the long chunks, one by one (where the tiles serve, from their shorter length)
    long_len = cpu.long_chunk.TILES_MIN_QUERY_LEN if cpu.long_chunk.is_tiled(q, k) else n
    assert to_torch == [[m] for m in query_lens + [n] if m >= long_len]


@needs_cc
def test_a_lone_long_chunk_on_more_threads_than_kv_heads_goes_to_torch(monkeypatch):
    """Where the C kernel takes every length (an fp32 cache on AVX-512), a long chunk on more
    threads than its KV heads still goes to torch's kernel: the C one splits a chunk by KV
    head and would leave threads idle (beside short chunks too, which end at once)."""
    monkeypatch.setattr(cpu, "TORCH_MIN_QUERY_LEN", 1 << 62)
    to_torch, reference = [], cpu._long_chunk  # torch's kernel: each chunk's query count
    monkeypatch.setattr(
        cpu, "_long_chunk", lambda *a, **k: to_torch.append([len(a[0])]) or reference(*a, **k)
    )
    n = cpu.TORCH_QUERY_LEN
    lens = [n, 1, 1, 1]  # a long chunk beside short ones, which end at once
    k, v, tables = _paged_cache(lens, 2, 32, 16, torch.float32, seed=4)
    q = torch.randn(sum(lens), 4, 32)
    zeros = [0] * len(lens)
    want = _naive_prefill_attention(q, k, v, tables, lens, zeros, 32**-0.5)
    before = torch.get_num_threads()
    try:
        for threads, sent in ((2, []), (3, [[n]])):
            torch.set_num_threads(threads)
            to_torch.clear()
            got = cpu.prefill_attention(q, k, v, tables, lens, zeros, 32**-0.5)
            assert to_torch == sent and torch.allclose(got.double(), want, atol=1e-5)
    finally:
        torch.set_num_threads(before)


@needs_cc
def test_prefill_attention_split_over_threads_equals_one_thread_and_odd_heads_fall_back():
    query_lens, context_lens = [70, 5, 40], [0, 20, 0]
    k, v, tables = _paged_cache(
        [a + b for a, b in zip(query_lens, context_lens)], 2, 32, 16, torch.float32, seed=5
    )
    q = torch.randn(sum(query_lens), 4, 32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.prefill_attention(q, k, v, tables, query_lens, context_lens, 0.2)
        torch.set_num_threads(2)  # (chunk, KV head) items split over two threads
        two = cpu.prefill_attention(q, k, v, tables, query_lens, context_lens, 0.2)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    # a head size off the kernel's tile: the portable op serves, with the same result
    k8, v8, q8 = k[..., :8].contiguous(), v[..., :8].contiguous(), q[..., :8].contiguous()
    assert torch.allclose(
        cpu.prefill_attention(q8, k8, v8, tables, query_lens, context_lens, 0.3),
        portable.prefill_attention(q8, k8, v8, tables, query_lens, context_lens, 0.3),
    )


@needs_cc
@pytest.mark.parametrize(
    "lens,hk",
    [
        (list(range(1, 130, 4)), 2),  # 33 rows: the sequences split over the threads
        ([200], 4),  # one sequence: its KV heads split over the threads
        ([3, 70], 3),  # fewer sequences than threads, heads that do not divide evenly
    ],
)
def test_decode_attention_split_over_threads_equals_one_thread(lens, hk):
    k, v, tables = _paged_cache(lens, hk, 32, 16, torch.float32, seed=3)
    q, seq_lens = torch.randn(len(lens), 2 * hk, 32), torch.tensor(lens, dtype=torch.int32)
    one = equal_on_1_2_3_threads(lambda: cpu.decode_attention(q, k, v, tables, seq_lens, 0.2))
    want = portable.decode_attention(q, k, v, tables, seq_lens, 0.2)
    assert torch.allclose(one, want, atol=1e-5)


@needs_cc
def test_rope_written_into_the_cache_and_slot_mapping_equal_the_portable_ops():
    t, nb, bs = 23, 9, 16
    q, k, v = qkv_views(t)
    qw, kw = torch.randn(32), torch.randn(32)
    table = portable.rotary_cos_sin(512, 32, 1e6)
    pos = torch.randint(0, 512, (t,))
    slots = torch.randperm(nb * bs)[:t]  # scattered, as a batch's current tokens are
    caches = [(torch.zeros(nb, bs, 2, 32), torch.zeros(nb, bs, 2, 32)) for _ in range(2)]
    got_q = cpu.qk_norm_rope_write_kv(q, k, v, qw, kw, table, pos, 1e-6, *caches[0], slots)
    want_q = portable.qk_norm_rope_write_kv(q, k, v, qw, kw, table, pos, 1e-6, *caches[1], slots)
    assert torch.allclose(got_q, want_q, atol=1e-5)
    assert torch.allclose(caches[0][0], caches[1][0], atol=1e-5)
    assert torch.equal(caches[0][1], caches[1][1])

    tables = torch.randint(0, 1000, (6, 4), dtype=torch.int32)
    # lengths at block edges, past the table (clamped) and a padding row of length 0
    lens = torch.tensor([1, 16, 17, 64, 70, 0], dtype=torch.int32)
    got, want = torch.empty(6, dtype=torch.int64), torch.empty(6, dtype=torch.int64)
    cpu.compute_slot_mapping(lens, tables, bs, got)
    portable.compute_slot_mapping(lens, tables, bs, want)
    assert torch.equal(got, want)
    ops = backend_for(lens)
    assert ops.compute_slot_mapping is cpu.compute_slot_mapping

    # the step's advance, a drafter's history written as it goes: one C call, as portable
    sampled = torch.randint(0, 1 << 20, (6,))
    inc = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.int32)
    history = [torch.randint(0, 9, (8, 80), dtype=torch.int32) for _ in range(2)]
    history[1].copy_(history[0])
    states = [(torch.zeros(6, dtype=torch.int64), lens.clone()) for _ in range(2)]
    reference = portable.advance_step
    with mock.patch.object(portable, "advance_step", side_effect=AssertionError("not C")):
        cpu.advance_step(states[0][0], sampled, states[0][1], inc, history[0])
    reference(states[1][0], sampled, states[1][1], inc, history[1])
    assert all(torch.equal(a, b) for a, b in zip(states[0], states[1]))
    assert torch.equal(history[0], history[1]) and history[0][3, 64] == sampled[3]
    assert states[0][1].tolist() == (lens + inc).tolist()
    cpu.advance_step(states[0][0], sampled, states[0][1], inc)  # no history: the same advance
    assert states[0][1].tolist() == (lens + 2 * inc).tolist()
    assert ops.advance_step is cpu.advance_step


def test_prefill_lanes_equal_one_lane(tiny_model):
    """A pass split over two lanes (threads) writes the same KV and samples the same tokens."""
    from common.base.config import WorkerConfig
    from common.base.request import SamplingParams
    from common.engine.worker import DeviceWorker, PrefillChunk

    g = torch.Generator().manual_seed(0)
    lens = [40, 7, 23, 64, 1]
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in lens]

    def run(num_threads: int):
        before = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            with DeviceWorker(WorkerConfig(model=str(tiny_model), max_model_len=256)) as w:
                chunks, start = [], 1
                for p in prompts:
                    n = (len(p) + w.block_size - 1) // w.block_size
                    chunks.append(
                        PrefillChunk(p, 0, list(range(start, start + n)), SamplingParams())
                    )
                    start += n
                tokens, logits = w.prefill(chunks, return_logits=True)
                return (
                    (w.lanes.num_lanes if w.lanes else 1),
                    tokens,
                    logits,
                    w.export_blocks(list(range(1, start))),
                )
        finally:
            torch.set_num_threads(before)

    lanes1, tokens1, logits1, kv1 = run(1)
    lanes2, tokens2, logits2, kv2 = run(2)
    assert (lanes1, lanes2) == (1, 2)
    assert tokens1 == tokens2
    assert torch.allclose(logits1, logits2, atol=1e-4) and torch.allclose(kv1, kv2, atol=1e-5)


def test_parse_cpus():
    from common.runtime.process import parse_cpus

    assert parse_cpus("0-2,5") == {0, 1, 2, 5} and parse_cpus("3") == {3}
    assert parse_cpus(" 1 - 3, 5") == {1, 2, 3, 5} and parse_cpus("1-") == {1}
    with pytest.raises(ValueError, match="--cpus takes core numbers .*'a' is not a CPU number"):
        parse_cpus("a")
    with pytest.raises(ValueError, match="the range 3-1 names no CPU"):
        parse_cpus("3-1,5")
    with pytest.raises(ValueError, match="at most 8192 CPUs"):
        parse_cpus("0-9000")


@needs_cc
@pytest.mark.parametrize("num_rows", [1, 2, 3, 8, 33, 200])
def test_bf16_weight_linear_equals_the_fp32_matmul_on_one_thread_and_two(num_rows, monkeypatch):
    """x [M, K] fp32 by a bf16 weight: the C kernel (small M) and the widened fp32 matmul
    (large M) equal x @ W.float()^T, whatever the columns' tail and the threads. (A host with
    bf16 matrix instructions takes torch's bf16 matmul instead: told here it has none.)"""
    monkeypatch.setattr(cpu_linear, "IS_BF16_NATIVE", False)
    g = torch.Generator().manual_seed(num_rows)
    before = torch.get_num_threads()
    try:
        for size in (136, 131):  # K a multiple of the 8-wide vectors, and not
            w = torch.randn(
                8 * 37 + 5, size, generator=g
            ).bfloat16()  # N: not a multiple of the tiles
            x = torch.randn(num_rows, size, generator=g)
            bias = torch.randn(w.shape[0], generator=g).bfloat16()
            ref = torch.nn.functional.linear(x, w.float(), bias.float())
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out = cpu.linear(x, w, bias)
                assert out.dtype == torch.float32 and out.shape == ref.shape
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)
    assert backend_for(x).linear is cpu.linear


@pytest.mark.parametrize("weight_std", [0.02, 0.3])
def test_cpu_bf16_logits_as_accurate_as_transformers_bf16(make_model, weight_std):
    """A CPU node in bf16 keeps bf16 weights and KV and sums in fp32: its logits must be no
    less accurate (against fp32 transformers) than transformers' own bf16 forward, over
    twelve prompts: in the mean of each prompt's largest error, in the worst prompt, and no
    prompt by more than half again.
    NOTE: one prompt's largest error is a draw between two roundings; four prompts compared
    one by one failed on one by 5e-4 where the mean was 20% below transformers'."""
    from transformers import Qwen3ForCausalLM

    from common.base.config import WorkerConfig
    from common.base.request import SamplingParams
    from common.engine.worker import DeviceWorker, PrefillChunk
    from common.kv.blocks import BlockAllocator, num_blocks_for

    model = make_model(
        hidden_size=128,
        intermediate_size=256,
        heads=4,
        kv_heads=2,
        head_dim=32,
        layers=3,
        weight_std=weight_std,
    )
    g = torch.Generator().manual_seed(1)
    # (300: a chunk long enough for torch's attention kernel, where it takes long chunks)
    lens = (1, 5, 17, 33, 64, 90, 120, 150, 200, 250, 280, 300)
    prompts = [torch.randint(0, 400, (n,), generator=g).tolist() for n in lens]
    hf32 = Qwen3ForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    hf16 = Qwen3ForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).eval()
    cfg = WorkerConfig(model=str(model), device="cpu", dtype="bfloat16", kv_cache_memory=16 * 2**20)
    with DeviceWorker(cfg) as worker:
        assert (
            worker.kv_cache.dtype == torch.bfloat16
            and worker.weights.layers[0].qkv.dtype == torch.bfloat16
        )
        # Where the CPU has bf16 matrix units the weights are laid out once, at load (for the
        # tiles and the dot product where they run, else for oneDNN), and these logits come
        # through that path; elsewhere through the C kernel.
        qkv = worker.weights.layers[0].qkv
        is_tiled = HAS_CC and cpu_linear.IS_PACKED
        assert (qkv.dim() == 4) == is_tiled
        assert qkv.is_mkldnn == (portable.IS_BF16_NATIVE and not is_tiled)
        alloc = BlockAllocator(worker.num_kv_blocks)
        chunks = [
            PrefillChunk(p, 0, alloc.allocate(num_blocks_for(len(p), 16)), SamplingParams())
            for p in prompts
        ]
        _, logits = worker.prefill(chunks, return_logits=True)
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    errors = []  # (ours, transformers' bf16) per prompt
    with torch.no_grad():
        for p, ours in zip(prompts, logits):
            ref32 = hf32(torch.tensor([p])).logits[0, -1]
            ref16 = hf16(torch.tensor([p])).logits[0, -1].float()
            errors.append((rel(ours, ref32), rel(ref16, ref32)))
    ours, theirs = zip(*errors)
    assert sum(ours) / len(ours) <= sum(theirs) / len(theirs) + 1e-3, errors
    assert max(ours) <= max(theirs) + 2e-3, errors
    # and no prompt far worse than transformers' on it (a regression on one prompt alone)
    assert all(a <= 1.5 * b + 5e-4 for a, b in errors), errors


def test_loading_the_c_kernels_keeps_subnormal_floats():
    """Defect: the kernels' library was linked with -ffast-math, which brings gcc's
    crtfastmath: loading it set flush-to-zero for the whole process (every torch and numpy
    op of a node flushed subnormals to zero; a test of another module failed for it)."""
    import ctypes

    from kernels import cpu_build, options

    lib = cpu_build.build(options.current[0].build_dir)
    ctypes.CDLL(str(lib))
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # a subnormal float32
    assert (tiny * 1.0).item() != 0.0 and (tiny / 2).item() != 0.0


@needs_cc
def test_decode_attention_without_scratch_raises_and_without_rows_returns_none(monkeypatch):
    """Defect: the OpenMP path dropped the kernel's code, so a scratch allocation that
    failed handed back uninitialised rows; and zero sequences divided by zero in C.
    NOTE: the failure is the kernel's return code, stood in for here: asking the real
    kernel for more scratch than memory may be granted (overcommit) and then walks past
    the table."""
    k, v, tables = _paged_cache([5], 2, 32, 16, torch.float32, seed=5)
    q, lens = torch.randn(1, 4, 32), torch.tensor([5], dtype=torch.int32)
    empty = cpu.decode_attention(q[:0], k, v, tables[:0], lens[:0], 0.2)
    assert empty.shape == (0, 4, 32)
    monkeypatch.setitem(cpu._FNS, torch.float32, lambda *args: -1)
    with pytest.raises(MemoryError, match="scratch"):
        cpu.decode_attention(q, k, v, tables, lens, 0.2)


@needs_cc
@pytest.mark.parametrize(
    "dtype,head_dim", [(torch.bfloat16, 64), (torch.bfloat16, 48), (torch.float32, 64)]
)
def test_which_chunks_take_the_long_chunk_path_by_cache_and_cpu(dtype, head_dim, monkeypatch):
    """The rule, on this CPU: a bf16 cache whose head size the tiles take goes to them from
    TILES_MIN_QUERY_LEN; another bf16 one on a CPU with tiles to torch's (its bf16 kernel
    runs on them) from TORCH_QUERY_LEN; an fp32 one stays on the C kernel at every length on
    AVX-512 (the faster there), and goes to torch's from TORCH_QUERY_LEN on AVX2."""
    long_chunk = cpu.long_chunk
    taken, reference = [], cpu._long_chunk
    monkeypatch.setattr(
        cpu, "_long_chunk", lambda *a, **k: taken.append(len(a[0])) or reference(*a, **k)
    )
    n = cpu.TORCH_QUERY_LEN
    lens = [15, 16, n - 1, n]
    k, v, tables = _paged_cache(lens, 2, head_dim, 16, dtype, seed=head_dim)
    q = torch.randn(sum(lens), 4, head_dim).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # NOTE: no more threads than KV heads: that rule aside
        got = cpu.prefill_attention(q, k, v, tables, lens, [0] * 4, head_dim**-0.5)
    finally:
        torch.set_num_threads(before)
    if long_chunk.is_tiled(q, k):
        want = [16, n - 1, n]
    elif (dtype == torch.bfloat16 and cpu.FEATURES.is_amx_bf16) or not cpu.FEATURES.is_avx512:
        want = [n]
    else:
        want = []
    assert taken == want
    expected = _naive_prefill_attention(q, k, v, tables, lens, [0] * 4, head_dim**-0.5)
    assert torch.allclose(got.double(), expected, atol=1e-5 if dtype == torch.float32 else 2e-2)
