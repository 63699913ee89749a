"""The CPU platform: the host's memory, its kernels (kernels/cpu.py), and a KV cache other
processes on this host map as a shared-memory segment (the ipc KV transfer).

NOTE: the weights and a KV cache of its own are held in pages of 2 MiB where the kernel
gives them on request (transparent huge pages set to `madvise` or `always`): a decode step
streams every weight, and over 4 KiB pages it walks the page tables every 4 KiB of it (one
L2 TLB covers ~12 MiB so). Qwen3-0.6B's shape in bf16, batch 1, two cores of an AMD EPYC,
the same steps alternated in one process: 2-5% less time a step (1% when the memory was slow).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import shutil
from multiprocessing import shared_memory

import torch

from common.base.procs import is_alive
from common.engine.platform_base import Platform, PlatformError, num_bytes

# /dev/shm/pdserve-kv-<pid namespace>-<pid>-<hex>: a CPU cache other processes map
SHM_PREFIX = "pdserve-kv"
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
HUGE_PAGE = 2 << 20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


class CpuPlatform(Platform):
    type = "cpu"
    is_pinned = False
    can_capture_graphs = False
    kernels: str | None = "kernels.cpu"
    kernels_off: str | None = "disable_cpu_kernels"
    is_host = True
    default_dtype = torch.float32
    nixl_memory: str | None = "DRAM"

    @classmethod
    def check(cls, device: torch.device) -> None:
        pass

    @classmethod
    def why_not_shared(cls) -> str | None:
        return None if os.path.isdir("/dev/shm") else "no /dev/shm here"

    @staticmethod
    def process_group(store, rank: int, size: int, timeout):
        import torch.distributed as dist

        return dist.ProcessGroupGloo(store, rank, size, timeout)

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._segment: shared_memory.SharedMemory | None = None  # a shared CPU cache's
        self._mapping: mmap.mmap | None = None  # its pages, as this process maps them

    def activate(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def free_memory(self) -> int:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def release_memory(self) -> None:
        """The C heap's free pages handed back to the system (glibc's malloc_trim): a weight
        copied into huge pages (hold) leaves its first copy's pages resident otherwise, ~70%
        of a 0.6B model's weights more in the node's memory."""
        trim = _malloc_trim()
        if trim is not None:
            trim(0)

    # ---- memory held for the worker's life: in huge pages where it can be had ---------

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        """t copied into huge pages where it spans one or more and they can be had (see the
        module); else t. NOTE: a tensor in oneDNN's own layout (is_mkldnn) stays where it is:
        it has no plain storage to copy into. The copied-from pages are the C heap's until
        release_memory()."""
        if t.device.type != "cpu" or t.is_mkldnn or not t.is_contiguous():
            return t
        held = huge_page_zeros(t.numel() * t.element_size())
        if held is None:
            return t
        return held.view(t.dtype).view(t.shape).copy_(t)

    # ---- the KV cache: its own, or one other processes map (a shared-memory segment) ---

    def allocate(self, shape, dtype: torch.dtype, is_shared: bool = False) -> torch.Tensor:
        if not is_shared:
            held = huge_page_zeros(num_bytes(shape, dtype))
            if held is None:
                return torch.zeros(shape, dtype=dtype, device=self.device)
            return held.view(dtype).view(shape)
        _remove_stale_segments()
        nbytes = num_bytes(shape, dtype)
        # Python's resource tracker unlinks the segment if this process dies without closing it.
        self._segment = shared_memory.SharedMemory(
            f"{SHM_PREFIX}-{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(4)}",
            create=True,
            size=max(nbytes, 1),
        )
        self._mapping = self._reserve(self._segment.name, nbytes)
        return _tensor_over(self._mapping, nbytes).view(dtype).view(shape)

    def _reserve(self, name: str, nbytes: int) -> mmap.mmap:
        """The segment's pages, had now (a fresh one reads as zeros either way), and this
        process's mapping of them, whole. NOTE: else each page is had at its first touch:
        a prefill node's KV write paid for it (a third of its loop's time under load), a
        decode step for each block it first read, and where /dev/shm is smaller than the
        cache (a container's 64 MiB) a write past its end killed the writer with SIGBUS."""
        try:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, max(nbytes, 1))
                return mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | _MAP_POPULATE)
            finally:
                os.close(fd)
        except OSError as e:
            self.release()
            free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
            # NOTE: a ValueError, as a KV budget refused at load is: one line, exit 2
            raise ValueError(
                f"the KV cache shared with prefill nodes needs {nbytes / 2**20:.0f} MiB in "
                f"/dev/shm, which has {free / 2**20:.0f} MiB free ({e.strerror}): give "
                f"--kv-cache-memory less, /dev/shm more (docker run --shm-size), or "
                f"--kv-transfer tcp"
            ) from None

    def share(self, cache: torch.Tensor) -> str:
        segment = self._segment
        if segment is None:
            raise PlatformError("this CPU cache was not allocated in shared memory")
        return segment.name

    def open_shared(self, handle, dtype: torch.dtype, shape: list[int]):
        name = handle if isinstance(handle, str) else ""
        if not name.startswith(SHM_PREFIX + "-") or "/" in name:
            raise PlatformError(f"no usable shared-memory segment named ({name!r})")
        nbytes = num_bytes(shape, dtype)
        # NOTE: opened with os/mmap rather than SharedMemory, whose resource tracker
        # would unlink the owner's segment when this process exits.
        try:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        except OSError as e:
            raise PlatformError(f"cannot open the shared segment {name}: {e}") from None
        try:
            if os.fstat(fd).st_size < nbytes:
                raise PlatformError(
                    f"segment {name} holds {os.fstat(fd).st_size} bytes, "
                    f"{list(shape)} needs {nbytes}"
                )
            # NOTE: populated now, not a page fault at a time inside the KV writes
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        finally:
            os.close(fd)

        def close() -> None:
            nonlocal mapping
            m, mapping = mapping, None  # NOTE: else this closure kept the pages mapped
            try:
                if m is not None:
                    m.close()
            except BufferError:  # a tensor over it lives: the pages go with its last view
                pass

        return _tensor_over(mapping, nbytes).view(dtype).view(shape), close

    def release(self, cache: torch.Tensor | None = None) -> None:
        segment, self._segment = self._segment, None
        mapping, self._mapping = self._mapping, None
        if segment is None:
            return
        for m in (mapping, segment):
            try:
                if m is not None:
                    m.close()
            except BufferError:  # a tensor over it lives: the pages go with its last view
                pass
        try:
            segment.unlink()
        except FileNotFoundError:
            pass


def _tensor_over(mapping: mmap.mmap, nbytes: int) -> torch.Tensor:
    """The mapping's bytes as a tensor that keeps them mapped while it or a view of it lives.
    NOTE: torch.frombuffer keeps a reference to what it is given but holds no export of
    it, so over the mmap itself a close() would unmap the pages under a live tensor (its
    next read a SIGSEGV); over a memoryview, the close raises BufferError until the last
    view is gone, and the pages go with it."""
    return torch.frombuffer(memoryview(mapping), dtype=torch.uint8, count=nbytes)


def huge_page_zeros(nbytes: int) -> torch.Tensor | None:
    """nbytes of zeros (uint8), private to this process, starting at a 2 MiB boundary in a
    mapping the kernel is asked to back with 2 MiB pages, every page had now; None where it
    cannot be asked (not Linux, the setting `never`, less than one such page, no address
    space). The pages go with the last view of the tensor. NOTE: under overcommit a host
    short of memory fails in the zeroing, as torch.zeros would, not here."""
    if _MADV_HUGEPAGE is None or nbytes < HUGE_PAGE or not _is_thp_on():
        return None
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # a page more: room to align
    try:
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(_MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    whole = _tensor_over(mapping, size)
    start = -whole.data_ptr() % HUGE_PAGE
    # NOTE: touched now, as the advice stands: each page had at its first write instead (a
    # decode step's, for a block it first reads) would cost 2 MiB of zeroing there
    return whole[start : start + nbytes].zero_()


def _malloc_trim():
    """glibc's malloc_trim, or None (another C library): looked up among the symbols this
    process has loaded already, libc's among them (no search of the library path)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def _is_thp_on() -> bool:
    try:
        with open(THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _pid_namespace() -> str:
    """This process's pid namespace (its inode): pids mean something only within it."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "x"  # unknown: no stale segment is ever taken for ours


def _remove_stale_segments() -> None:
    """Segments of processes of this pid namespace that died before their tracker could
    unlink them. NOTE: a segment another pid namespace made (another container sharing
    /dev/shm) is never touched: its pid means nothing here."""
    ns = _pid_namespace()
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if (
            ns != "x"
            and name.startswith(SHM_PREFIX + "-")
            and len(parts) == 5
            and parts[2] == ns
            and parts[3].isdigit()
        ):
            if not is_alive(int(parts[3])):
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass
