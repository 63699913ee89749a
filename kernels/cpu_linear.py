"""The CPU's matmuls with bf16 weights, by what the CPU has (kernels/cpu_features.py):

- bf16 tiles (AMX-BF16): each weight is laid out once, at load, in 16-column blocks of
  input pairs (cpu_linear_vnni.c), a 4-D tensor [N / 16, K / 2, 16, 2]; up to DOT_MAX_ROWS
  rows of x stream it through the bf16 dot-product instruction, more rows through the
  tiles. A tied embedding reads its rows from the same tensor (embedding()).
- bf16 dot products without tiles (AVX512-BF16): the same layout, every row count through
  the dot product: up to 4 rows as above, more 8 rows by 3 column blocks a pass (AMD EPYC,
  2 threads, Qwen3-0.6B's shapes: 0.8-1.1x oneDNN's packed linear from 1 to 1,024 rows; a
  tied lm_head, which oneDNN's layout cannot hold as an embedding, 0.5-0.7x the table as it
  is from 1 to 128 rows: pdserve bench linear).
- neither (AVX2 and older): the checkpoint's layout, read in place by cpu_linear.c's kernel
  for fp32 activations, widened whole for a large batch.

x is rounded to bf16 on the first two paths (as oneDNN's bf16 matmul does); sums are fp32.
fp32 weights: kernels/cpu_linear_fp32.py (oneDNN where torch's own leaves AVX-512 unused).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_linear_fp32, options, portable
from kernels.cpu_build import load
from kernels.cpu_features import CpuFeatures
from kernels.cpu_threads import run_split

# Up to this many rows of x a 16-column block streams through vdpbf16ps (Qwen3-0.6B's 28
# layers, 2 threads, Xeon with AMX, timed in process: 1 row 37.6 ms against the tiles' 44.9,
# 4 rows 42.6 against 44.3, 8 rows 68.5 against 46.3).
DOT_MAX_ROWS = 4
TILE_ROWS = 32  # the tile kernel's rows of x per pass: x is padded to a multiple
# From this many rows of x, a bf16 weight is widened whole and the matmul runs at the fp32
# rate; below it, the C kernel streams the weight once (measured crossover on AVX2: 64-128).
LINEAR_WIDEN_ROWS = 96
LINEAR_COLUMNS = 8  # the AVX2 kernel's column tile: threads split N in these
MIN_COLUMNS_PER_THREAD = 256
# NOTE: where oneDNN has bf16 (AVX512-BF16, AMX), torch's own bf16 matmul beats the AVX2 kernel.
IS_BF16_NATIVE = portable.IS_BF16_NATIVE

FEATURES = CpuFeatures.read()
_LIB = load(options.current[0].build_dir)
IS_TILED = bool(_LIB.vnni_paths & 2)  # the tiles are built and this process may use them
# bf16 arithmetic units (NOTE: not IS_BF16_NATIVE, which plain AVX-512 may claim too)
HAS_BF16_UNITS = FEATURES.is_avx512_bf16 or FEATURES.is_amx_bf16
HAS_DOT = bool(_LIB.vnni_paths & 1)
IS_PACKED = IS_TILED or HAS_DOT  # bf16 weights take the layout above
IS_ONEDNN_FP32 = cpu_linear_fp32.is_onednn_faster(FEATURES)  # fp32 weights: that module's way


def describe() -> str:
    """The CPU and the path each kernel takes on it, for a node's ready line."""
    if IS_TILED:
        matmul = f"bf16 matmul: dot products to {DOT_MAX_ROWS} rows, AMX tiles beyond"
    elif HAS_DOT:
        matmul = "bf16 matmul: dot products, weights packed at load"
    elif IS_BF16_NATIVE:
        matmul = "bf16 matmul: oneDNN, weights packed at load"
    else:
        matmul = "bf16 matmul: C kernel, fp32 sums"
    if IS_ONEDNN_FP32:
        matmul += "; fp32 matmul: oneDNN"
    return f"{FEATURES.model} ({FEATURES.describe()}); {matmul}; C attention built for it"


def is_tiled(weight: torch.Tensor) -> bool:
    """Whether this weight is in the tiles' layout (pack_linear_weight on a CPU with AMX or
    bf16 dot products)."""
    return weight.dim() == 4


def pack_linear_weight(weight: torch.Tensor, is_embedding: bool = False) -> torch.Tensor:
    """As portable.pack_linear_weight; where the tiles or the dot product run, their layout
    (see the module), which embedding() reads too."""
    if not (
        IS_PACKED
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[0] % (2 * 16) == 0  # whole pairs of column blocks
        and weight.shape[1] % 32 == 0  # whole tiles of inputs
    ):
        if IS_ONEDNN_FP32 and weight.dtype == torch.float32 and not is_embedding:
            return cpu_linear_fp32.pack(weight)
        return portable.pack_linear_weight(weight, is_embedding)
    num_columns, size = weight.shape
    # [N, K] -> [N / 16, K / 2, 16, 2]: block b, pair p holds W[16b + j, 2p + i] at [b, p, j, i]
    return weight.view(num_columns // 16, 16, size // 2, 2).permute(0, 2, 1, 3).contiguous()


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows of an embedding table [V, H], or of a tied one in the tiles' layout."""
    if not is_tiled(table):
        return F.embedding(ids, table)
    ids = ids.long()
    if ids.numel() and int(ids.min()) < 0:  # NOTE: as F.embedding: never a row from the end
        raise IndexError("an embedding id is negative")
    rows = table[ids // 16, :, ids % 16]  # [..., H / 2, 2]
    return rows.reshape(*ids.shape, table.shape[1] * 2)


def linear(x, weight, bias=None, num_seqs=None):
    """As portable.linear, by the weight's layout (see the module)."""
    if is_tiled(weight):
        return _linear_tiled(x, weight, bias, num_seqs)
    if IS_ONEDNN_FP32 and cpu_linear_fp32.is_served(x, weight):
        return cpu_linear_fp32.linear(x, weight, bias, num_seqs)
    if (
        IS_BF16_NATIVE
        or weight.is_mkldnn
        or not (
            weight.dtype == torch.bfloat16
            and x.dtype == torch.float32
            and x.dim() == 2
            and x.stride(-1) == 1
            and weight.is_contiguous()
            and x.device.type == "cpu"
            and weight.device.type == "cpu"
        )
    ):
        return portable.linear(x, weight, bias, num_seqs)
    return _linear_widened(x, weight, bias)


def _tiled_shape(weight) -> tuple[int, int, int]:
    """(column blocks, K, N) of a weight in the tiles' layout [N / 16, K / 2, 16, 2]."""
    num_blocks, num_pairs = weight.shape[:2]
    return num_blocks, 2 * num_pairs, 16 * num_blocks


def _linear_tiled(x, weight, bias, num_seqs=None):
    """x [..., K] by a weight in the tiles' layout -> [..., N] in x's dtype; through the dot
    product for a decode step's few rows (a verify step's by its sequences: num_seqs), or
    for every row count where there are no tiles.
    NOTE: the two sum a row in another order (vdpbf16ps adds a pair's odd product, then its
    even one, rounding each time; the tiles otherwise: ~1e-6 apart at K = 1,024), and a row's
    sum is the same whatever the rows beside it on either path: so a verify step's rows
    take the path its sequences' plain step takes, and greedy tokens stay plain decoding's."""
    num_blocks, size, num_columns = _tiled_shape(weight)
    num_rows = x.numel() // size
    if not IS_TILED and x.dtype != torch.float32:  # NOTE: the dot kernel reads fp32 x
        return _linear_tiled(x.float(), weight, bias).to(x.dtype)
    is_few = (num_rows if num_seqs is None else num_seqs) <= DOT_MAX_ROWS
    if (is_few or not IS_TILED) and HAS_DOT and x.dtype == torch.float32:
        # NOTE: a decode step's lone rows: as few torch ops as can be (the kernel rounds x)
        xf = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, size).contiguous()
        out = torch.empty((num_rows, num_columns), dtype=torch.float32)
        code = _LIB.vnni["dot"](
            xf.data_ptr(),
            size,
            weight.data_ptr(),
            size,
            out.data_ptr(),
            num_columns,
            num_rows,
            0,
            num_blocks,
            torch.get_num_threads() if _LIB.has_openmp else 1,
        )
        if code:
            raise MemoryError("the CPU linear kernel could not allocate its scratch memory")
        if bias is not None:
            out.add_(bias)
        return out.view(*x.shape[:-1], num_columns)
    return _linear_tiles(x, weight, bias)


def _linear_tiles(x, weight, bias):
    """As _linear_tiled, through the tiles (rows padded to TILE_ROWS)."""
    num_blocks, size, num_columns = _tiled_shape(weight)
    lead = x.shape[:-1]
    xf = x.reshape(-1, size)
    num_rows = xf.shape[0]
    padded = -(-num_rows // TILE_ROWS) * TILE_ROWS
    if xf.dtype == torch.float32 and xf.stride(-1) == 1:
        # NOTE: rounded and padded in one C pass: torch's conversion and pad, two parallel
        # regions a call, took 14% of a 128-token prefill on two cores
        xb = torch.empty((padded, size), dtype=torch.bfloat16)
        _LIB.elementwise["to_bf16_rows"](
            xf.data_ptr(),
            xf.stride(0),
            xb.data_ptr(),
            num_rows,
            size,
            padded,
            torch.get_num_threads() if _LIB.has_openmp and xf.numel() >= 1 << 20 else 1,
        )
    else:
        xb = xf.to(torch.bfloat16)
        if padded != num_rows or not xb.is_contiguous():  # NOTE: a pad is a copy: if needed
            xb = F.pad(xb, (0, 0, 0, padded - num_rows)).contiguous()  # [M padded, K]
    out = torch.empty((padded, num_columns), dtype=torch.float32)

    def run(u0: int, u1: int, num_threads: int = 1) -> int:
        _LIB.vnni["amx"](
            xb.data_ptr(),
            size,
            weight.data_ptr(),
            size,
            out.data_ptr(),
            num_columns,
            padded,
            2 * u0,  # NOTE: the tile kernel takes column blocks in pairs
            2 * u1,
            num_threads,
        )
        return 0

    num_units = num_blocks // 2
    if _LIB.has_openmp:
        run(0, num_units, torch.get_num_threads())
    else:
        run_split(run, num_units, num_units)
    out = out[:num_rows]
    if bias is not None:
        out.add_(bias)
    return out.reshape(*lead, num_columns).to(x.dtype)


def _linear_widened(x, weight, bias):
    """fp32 x [M, K] by a bf16 weight [N, K] in place, on a CPU without bf16 units."""
    num_rows, size = x.shape
    if num_rows >= LINEAR_WIDEN_ROWS:
        return F.linear(x, weight.float(), None if bias is None else bias.float())
    num_columns = weight.shape[0]
    out = torch.empty((num_rows, num_columns), dtype=torch.float32)

    def run(u0: int, u1: int, num_threads: int = 1) -> int:
        _LIB.elementwise["linear_bf16"](
            x.data_ptr(),
            x.stride(0),
            weight.data_ptr(),
            size,
            out.data_ptr(),
            num_columns,
            num_rows,
            u0 * LINEAR_COLUMNS,
            min(u1 * LINEAR_COLUMNS, num_columns),
            num_threads,
        )
        return 0

    num_units = -(-num_columns // LINEAR_COLUMNS)
    max_threads = max(num_columns // MIN_COLUMNS_PER_THREAD, 1)
    if _LIB.has_openmp:
        run(0, num_units, min(torch.get_num_threads(), max_threads))
    else:
        run_split(run, num_units, max_threads)
    return out if bias is None else out.add_(bias)
