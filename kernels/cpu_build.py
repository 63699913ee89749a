"""The CPU kernels' C library (cpu_attention.c, cpu_rows.c, cpu_linear*.c): built once per source,
compiler and CPU with the system compiler, cached in the build directory the engine names
(kernels/options.py: $PDSERVE_HOME/kernels), and loaded with its functions typed.
ImportError where it cannot be built."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger("pdserve.kernels")

SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "cpu_attention.c",
        "cpu_attention_tiles.c",
        "cpu_decode_avx512.c",
        "cpu_rows.c",
        "cpu_linear.c",
        "cpu_linear_vnni.c",
    )
]
# every header beside them, which SOURCES may include: in the build's key
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# NOTE: -ffast-math lets expf vectorize (glibc libmvec); the kernel sees no inf or NaN:
# scores are finite and the max it subtracts is one of them. It compiles the sources only:
# a library linked with it carries gcc's crtfastmath, whose constructor sets flush-to-zero
# for the whole process that loads it (every torch and numpy op of a node, then).
FLAGS = [
    "-O3",
    "-march=native",
    "-ffast-math",
    "-fopenmp-simd",
    "-fPIC",
    "-std=gnu11",
]
LINK_FLAGS = ["-shared", "-fPIC"]
# NOTE: -march=native alone keeps the loops to 256-bit vectors on CPUs with AVX-512 (the
# compilers' preference there): the prefill attention then ran at half its rate (a 128-token
# prompt's, 2.0 -> 1.0 ms a layer on a Xeon's two cores). An x86 option: asked only there.
AVX512_FLAGS = ["-mprefer-vector-width=512"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def flags() -> list[str]:
    """FLAGS, and AVX512_FLAGS where this CPU has AVX-512 (gcc on Arm refuses them)."""
    return FLAGS + (AVX512_FLAGS if "avx512f" in _cpu_flags().split() else [])


def build(cache_dir: Path) -> Path:
    """The library, built into cache_dir unless a build of these sources, compiler, flags
    and CPU is there; ImportError where it cannot be built (any filesystem or compiler
    error included: the portable ops then serve, never a failed start)."""
    try:
        return _build(cache_dir)
    except OSError as e:
        raise ImportError(f"the CPU kernels could not be built in {cache_dir}: {e}") from e


def _build(cache_dir: Path) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise ImportError("no C compiler (cc or gcc) to build the CPU attention kernel")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join(
            [
                *(src.read_text() for src in SOURCES + HEADERS),
                version,
                " ".join(flags()),
                " ".join(LINK_FLAGS),
                _cpu_flags(),
            ]
        ).encode()
    ).hexdigest()[:16]
    lib = cache_dir / f"cpu_attention-{key}.so"
    for d in reversed([cache_dir, *cache_dir.parents]):  # NOTE: each one made is ours alone
        if not d.exists():
            d.mkdir(mode=0o700, exist_ok=True)
    _check_own(cache_dir)
    if os.path.lexists(lib):
        st = os.lstat(lib)
        if _is_trusted(st):
            return lib
        # NOTE: a link, someone else's, or others could have written it: built again
        log.warning("%s is not this user's alone: building the CPU kernels again", lib)
        lib.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    with tempfile.TemporaryDirectory(dir=cache_dir) as build:
        # libmvec: glibc's vector math, where there is one; OpenMP: torch's runtime, where it
        # can be linked
        for libs in (
            ["-fopenmp", "-lmvec", "-lm"],
            ["-fopenmp", "-lm"],
            ["-lmvec", "-lm"],
            ["-lm"],
        ):
            omp = [f for f in libs if f == "-fopenmp"]
            objs = [os.path.join(build, src.stem + ".o") for src in SOURCES]
            for src, obj in zip(SOURCES, objs):
                done = subprocess.run(
                    [cc, *flags(), *omp, "-c", "-o", obj, str(src)], capture_output=True, text=True
                )
                if done.returncode != 0:
                    break
            else:
                done = subprocess.run(
                    [cc, *LINK_FLAGS, "-o", tmp, *objs, *libs], capture_output=True, text=True
                )
            if done.returncode == 0:
                break
    if done.returncode != 0:
        os.unlink(tmp)
        raise ImportError(f"building the CPU attention kernel failed: {done.stderr.strip()[:500]}")
    os.chmod(tmp, 0o755)  # NOTE: whatever the umask: a library others may write is not loaded
    os.replace(tmp, lib)  # NOTE: atomic: processes starting together each see a whole file
    return lib


def _is_owner(st: os.stat_result) -> bool:
    return not hasattr(os, "getuid") or st.st_uid == os.getuid()


def _is_trusted(st: os.stat_result) -> bool:
    """A library this user wrote and no one else could have: a file of ours others cannot
    write to."""
    return stat.S_ISREG(st.st_mode) and _is_owner(st) and not _is_open_to_others(st)


def _open_trusted(lib: Path) -> ctypes.CDLL:
    """The library, loaded from the file checked: opened without following a link, checked
    on the open file, loaded through it where /proc names it (NOTE: between build() and here
    a directory above could be swapped by whoever may write to its parent: the path would
    then name another file). ImportError where it is not a library of ours."""
    try:
        fd = os.open(lib, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
    except OSError as e:
        raise ImportError(f"the CPU kernels' library {lib}: {e}") from e
    try:
        if not _is_trusted(os.fstat(fd)):
            raise ImportError(f"{lib} is not this user's alone: the CPU kernels are not loaded")
        via = f"/proc/self/fd/{fd}"
        # NOTE: fd stays open for the process: dlopen knows a library by its name, and a
        # later load through a reused /proc/self/fd/N would get this one back
        return ctypes.CDLL(via if os.path.exists(via) else str(lib))
    except BaseException:
        os.close(fd)
        raise


def _is_open_to_others(st: os.stat_result) -> bool:
    return os.name != "nt" and bool(st.st_mode & 0o022)  # NOTE: Windows' modes say nothing


def _check_own(cache_dir: Path) -> None:
    """NOTE: a library found in cache_dir is loaded and run. The default is a predictable name
    under /tmp: another user could have made it (or a link to swap after this check), with a
    library of theirs in it. So it (and a link to it) must be this user's, else ImportError
    (the portable ops serve), and others may not write to it (closed to them here)."""
    link, st = os.lstat(cache_dir), os.stat(cache_dir)
    for who in (link, st):
        if not _is_owner(who):
            raise ImportError(
                f"{cache_dir} belongs to another user (uid {who.st_uid}): the CPU kernels "
                "are not built there (set PDSERVE_HOME to a directory of yours)"
            )
    if _is_open_to_others(st):
        log.warning("closing %s to other users: the CPU kernels are loaded from it", cache_dir)
        os.chmod(cache_dir, st.st_mode & 0o7755)
        if _is_open_to_others(os.stat(cache_dir)):
            raise ImportError(f"{cache_dir} stays writable by other users: not used")


class Library(NamedTuple):
    decode: dict  # decode attention by KV dtype
    prefill: dict  # prefill attention by KV dtype
    elementwise: dict  # the one-pass ops and the AVX2 bf16 linear, by name
    vnni: dict  # the bf16 dot-product and tile linears (cpu_linear_vnni.c), by name
    vnni_paths: int  # which of them this build has: 1 dot product, 2 tiles
    prefill_tiles: ctypes._CFuncPtr | None  # a chunk's attention on the tiles (None: not built)
    has_openmp: bool


@lru_cache(maxsize=None)
def load(build_dir: Path) -> Library:
    """The library's functions, typed; built and opened once per process."""
    lib = _open_trusted(build(build_dir))
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    fns = {}
    for dtype, name in (
        (torch.float32, "pdserve_decode_attention_f32"),
        (torch.bfloat16, "pdserve_decode_attention_bf16"),
        (torch.int8, "pdserve_decode_attention_i8"),  # 8-bit KV (kernels/kv_quant.py)
        (torch.uint8, "pdserve_decode_attention_e4m3"),
    ):
        fn = getattr(lib, name)
        # q, K, V, tables, table stride, lens, out, then B, Hq, Hk, D, block size, the
        # cache's strides, the scale, the threads and the queries per row
        fn.argtypes = [*[ptr] * 4, i64, ptr, ptr, *[i64] * 7, f32, i64, i64]
        fn.restype = ctypes.c_int
        fns[dtype] = fn
    prefill = {}
    for dtype, name in (
        (torch.float32, "pdserve_prefill_attention_f32"),
        (torch.bfloat16, "pdserve_prefill_attention_bf16"),
    ):
        fn = getattr(lib, name)
        fn.argtypes = [*[ptr] * 4, i64, *[ptr] * 4, *[i64] * 6, f32, i64, i64]
        fn.restype = ctypes.c_int
        prefill[dtype] = fn
    elementwise = {
        # the last argument of these three: threads, over rows (1 without OpenMP)
        "rms_norm": (
            lib.pdserve_rms_norm_f32,
            [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, f32, i64],
        ),
        "norm_rope": (
            lib.pdserve_norm_rope_f32,
            [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32, i64],
        ),
        "norm_rope_bf16": (  # the same, its rows rounded to bf16 (into a bf16 cache)
            lib.pdserve_norm_rope_bf16,
            [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32, i64],
        ),
        "silu_mul": (lib.pdserve_silu_mul_f32, [ptr, i64, ptr, i64, i64, i64]),
        "to_bf16_rows": (lib.pdserve_to_bf16_rows, [ptr, i64, ptr, i64, i64, i64, i64]),
        "scatter_rows": (lib.pdserve_scatter_rows_f32, [ptr, i64, ptr, ptr, i64, i64, i64]),
        "scatter_rows_bf16": (
            lib.pdserve_scatter_rows_bf16,
            [ptr, i64, ptr, ptr, i64, i64, i64],
        ),
        "slot_mapping": (lib.pdserve_slot_mapping, [ptr, ptr, i64, i64, i64, ptr, i64]),
        "advance_step": (lib.pdserve_advance_step, [ptr, ptr, ptr, ptr, ptr, i64, i64, i64]),
        "prompt_lookup": (
            lib.pdserve_prompt_lookup,
            [ptr, i64, i64, ptr, i64, i64, i64, i64, ptr],
        ),
        "linear_bf16": (
            lib.pdserve_linear_bf16,
            [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64],
        ),
    }
    for fn, argtypes in elementwise.values():
        fn.argtypes, fn.restype = argtypes, None
    for name in ("norm_rope", "norm_rope_bf16", "scatter_rows", "scatter_rows_bf16"):
        elementwise[name][0].restype = ctypes.c_int  # -1: a slot outside the cache
    lib.pdserve_has_openmp.restype = ctypes.c_int
    vnni = {"dot": lib.pdserve_linear_vnni_dot, "amx": lib.pdserve_linear_vnni_amx}
    for fn in vnni.values():
        fn.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64]
    vnni["dot"].restype, vnni["amx"].restype = ctypes.c_int, None
    lib.pdserve_amx_init.restype = lib.pdserve_vnni_paths.restype = ctypes.c_int
    lib.pdserve_prefill_tiles_available.restype = ctypes.c_int
    tiles = lib.pdserve_prefill_tiles_bf16
    # q and its row stride, K, V, table, then n, the context, Hq, Hk, D, the block size and
    # the cache's strides, the scale, out, its row stride and the threads
    tiles.argtypes = [ptr, i64, *[ptr] * 3, *[i64] * 8, f32, ptr, i64, i64]
    tiles.restype = ctypes.c_int
    paths = lib.pdserve_vnni_paths()
    if paths & 2 and lib.pdserve_amx_init() != 0:
        paths &= ~2  # the kernel (or a sandbox) refuses this process the tiles
    return Library(
        decode=fns,
        prefill=prefill,
        elementwise={name: fn for name, (fn, _) in elementwise.items()},
        vnni=vnni,
        vnni_paths=paths,
        prefill_tiles=tiles if lib.pdserve_prefill_tiles_available() else None,
        has_openmp=bool(lib.pdserve_has_openmp()),
    )
