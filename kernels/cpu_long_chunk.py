"""A long prompt chunk's causal attention on the CPU (kernels/cpu.py sends it a chunk of
TILES_MIN_QUERY_LEN queries or more where the tiles serve, else of TORCH_MIN_QUERY_LEN or
more): on AMX tiles over a bf16 cache
(cpu_attention_tiles.c: both products on the tiles, K and V packed from the cache once a
call), else torch's fused kernel over the chunk's KV gathered heads-first.

Qwen3-0.6B's heads (16 / 8 x 128), bf16 cache, two Xeon cores with AMX, in process: 1,024
tokens 5.2 ms a layer on the tiles against 6.9 through torch's (its inner products are small
oneDNN calls), 2,048 tokens 19.4 against 23.0; the tiles' output (fp32, P rounded to bf16
as torch's is) is the nearer to float64's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import options
from kernels.cpu_build import load

_LIB = load(options.current[0].build_dir)
# AMX tiles this process may use, and the kernel built (AMX and AVX512-BF16)
IS_TILED = bool(_LIB.vnni_paths & 2) and _LIB.prefill_tiles is not None
TILE_FEATURES = 32  # the kernel's head size is a multiple of this (a tile's bf16 inputs)
# From this many queries a chunk's attention runs on the tiles where they serve (is_tiled);
# shorter chunks go to cpu_attention.c's kernel, which takes them all in one call (Qwen3-0.6B's
# heads, bf16 cache, two Xeon cores with AMX: `pdserve bench attention`, one chunk of 16
# tokens 0.04 ms against 0.12, of 256 0.53 against 1.59; through prefill_attention in
# process, 16 chunks of 8 tokens 2.6 against 2.3 ms, of 16 2.7 against 3.3).
TILES_MIN_QUERY_LEN = 16


def is_tiled(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether attend() runs on the tiles for queries like q over this cache."""
    return IS_TILED and k_cache.dtype == torch.bfloat16 and q.shape[-1] % TILE_FEATURES == 0


def attend(q, k_cache, v_cache, table, context_len, scale, dtype, out) -> str:
    """out [n, Hq, D] (fp32, rows contiguous) <- causal attention of q [n, Hq, D] fp32 after
    context_len cached tokens, through table's blocks. dtype: torch's kernel's (where it
    runs). Returns the path taken ("tiles" or "torch")."""
    if (
        is_tiled(q, k_cache)
        and _is_rows(q)
        and _is_rows(out)
        and k_cache.stride() == v_cache.stride()
        and k_cache[0, 0].is_contiguous()
    ):
        rows = table.to(torch.int32).contiguous()
        num_heads, head_dim = q.shape[1], q.shape[2]
        rc = _LIB.prefill_tiles(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            rows.data_ptr(),
            q.shape[0],
            context_len,
            num_heads,
            k_cache.shape[2],
            head_dim,
            k_cache.shape[1],
            k_cache.stride(0),
            k_cache.stride(1),
            scale,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
        if rc == 0:
            return "tiles"
    out.copy_(_torch_chunk(q, k_cache, v_cache, table, context_len, scale, dtype))
    return "torch"


def _is_rows(x: torch.Tensor) -> bool:
    """fp32 [n, H, D] with each row's heads contiguous: what the tile kernel reads and writes."""
    return x.dtype == torch.float32 and x.dim() == 3 and x[0].is_contiguous()


def _torch_chunk(q, k_cache, v_cache, table, context_len, scale, dtype):
    """torch's fused kernel over each operand heads-first, a head's rows contiguous (it
    read the token-major views ~30% slower: Qwen3-0.6B's heads, 1,024 tokens, bf16, two
    Xeon cores with AMX: 8.9 against 6.9 ms a layer). -> [n, Hq, D] in dtype."""
    total, block_size = context_len + q.shape[0], k_cache.shape[1]
    blocks = table[: -(-total // block_size)].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [1, Hk, total, D]
        heads_first = torch.empty((cache.shape[2], len(blocks), *cache.shape[1::2]), dtype=dtype)
        view = heads_first.permute(1, 2, 0, 3)  # [blocks, block_size, Hk, D] over it
        if cache.dtype == dtype:  # NOTE: one copy, straight into place
            torch.index_select(cache, 0, blocks, out=view)
        else:
            view.copy_(cache[blocks])
        return heads_first.flatten(1, 2)[None, :, :total]

    k, v = gather(k_cache), gather(v_cache)
    q = q.transpose(0, 1).to(dtype, memory_format=torch.contiguous_format)[None]
    mask = None
    if context_len:  # NOTE: is_causal aligns top-left: after a context, the mask is explicit
        where = torch.arange(total, device=q.device)
        mask = where[None, :] <= where[context_len:, None]
    causal = not context_len
    o = F.scaled_dot_product_attention(
        q, k, v, mask, is_causal=causal, scale=scale, enable_gqa=True
    )
    return o[0].transpose(0, 1)
