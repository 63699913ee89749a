"""CPU ops beyond the portable ones: paged decode attention in C (cpu_attention.c).

The C file is built once per source, compiler and CPU with the system compiler
and cached under $PDSERVE_HOME/kernels; importing this module raises ImportError
(and kernels/backends.py keeps the portable op) where it cannot be built.
Everything the kernel reads stays where the worker put it: the cache is read
in place through the block tables, never gathered.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kernels import portable

SOURCE = Path(__file__).with_name("cpu_attention.c")
# NOTE: -ffast-math lets expf vectorize (glibc libmvec); the kernel sees no inf or NaN:
# scores are finite and the max it subtracts is one of them.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-shared", "-fPIC", "-std=gnu11"]
MIN_ROWS_PER_THREAD = 8


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cache_dir: Path) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise ImportError("no C compiler (cc or gcc) to build the CPU attention kernel")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, " ".join(FLAGS),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    lib = cache_dir / f"cpu_attention-{key}.so"
    if lib.is_file():
        return lib
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    for libs in (["-lmvec", "-lm"], ["-lm"]):   # libmvec: glibc's vector math, where there is one
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), *libs], capture_output=True, text=True)
        if done.returncode == 0:
            break
    if done.returncode != 0:
        os.unlink(tmp)
        raise ImportError(f"building the CPU attention kernel failed: {done.stderr.strip()[:500]}")
    os.replace(tmp, lib)   # NOTE: atomic: processes starting together each see a whole file
    return lib


def _load():
    from common.env import read_env
    env = read_env()
    if env.disable_cpu_kernels:
        raise ImportError("PDSERVE_DISABLE_CPU_KERNELS=1")
    lib = ctypes.CDLL(str(_build(env.home / "kernels")))
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    fns = {}
    for dtype, name in ((torch.float32, "pdserve_decode_attention_f32"),
                        (torch.bfloat16, "pdserve_decode_attention_bf16")):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, f32]
        fn.restype = ctypes.c_int
        fns[dtype] = fn
    return fns


_FNS = _load()
_POOL: list[ThreadPoolExecutor] = []   # made on first use by a process given several threads


def _pool(num_threads: int) -> ThreadPoolExecutor:
    if not _POOL or _POOL[0]._max_workers != num_threads:
        _POOL[:] = [ThreadPoolExecutor(num_threads, thread_name_prefix="attention")]
    return _POOL[0]


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, host_seq_lens=None):
    """As portable.decode_attention: q [B, Hq, D] over the paged cache -> [B, Hq, D]."""
    fn = _FNS.get(k_cache.dtype)
    if fn is None or k_cache.device.type != "cpu" or k_cache.stride(-1) != 1 \
            or k_cache.stride(-2) != k_cache.shape[-1] or v_cache.stride() != k_cache.stride():
        return portable.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    qf = q.float().contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    tables = block_tables.to(torch.int32)
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    row = num_heads * head_dim

    def run(b0: int, b1: int) -> int:
        return fn(qf.data_ptr() + 4 * b0 * row, k_cache.data_ptr(), v_cache.data_ptr(),
                  tables.data_ptr() + 4 * b0 * tables.stride(0), tables.stride(0),
                  lens.data_ptr() + 4 * b0, out.data_ptr() + 4 * b0 * row, b1 - b0, num_heads,
                  num_kv_heads, head_dim, block_size, k_cache.stride(0), k_cache.stride(1), scale)

    # NOTE: ctypes drops the GIL for the call, so slices of the batch run in parallel.
    num_parts = min(torch.get_num_threads(), num_seqs // MIN_ROWS_PER_THREAD)
    if num_parts > 1:
        bounds = [num_seqs * i // num_parts for i in range(num_parts + 1)]
        codes = list(_pool(num_parts).map(run, bounds[:-1], bounds[1:]))
    else:
        codes = [run(0, num_seqs)]
    if any(codes):
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
