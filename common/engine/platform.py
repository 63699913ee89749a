"""The device platform: everything that differs by device type, declared by one class
per type and found through a small registry (PLATFORMS, filled by @register), so the
worker, the transfer backends and the process set-up name no device API. A new device
is its class here (or anywhere: @register is all it takes), its kernels module in
kernels/, and a test.

What a platform declares:
    type                    the device type it serves ("cpu", "cuda:N" names one of several)
    torch_device(name)      the torch device of a name (the same name, unless a stand-in maps it)
    check(device)           ValueError, in one line naming the fix, if this machine lacks it
    kernels                 its fast kernels' module (kernels/), or None: the portable ops
    kernels_off             the environment switch (common/base/env.py field) that turns them off
    is_host                 its memory is the host's (threads per core, CPU KV budget, fp32 sums)
    default_dtype           when --dtype is not given
    nixl_memory             NIXL's memory kind for its cache ("DRAM", "VRAM"), or None: no NIXL
    why_not_shared()        why processes on one host cannot share its memory, or None
    process_group(...)      torch.distributed's group of its kind (dist KV transfer)
And what it does:

    activate()              make the device current (and import its torch plugin)
    synchronize()           wait for all queued work
    free_memory()           bytes free on the device (host: available RAM)
    release_memory()        hand cached allocations back
    is_pinned               host staging buffers are page-locked (async copies)
    event(timing)           a marker queued on the current stream, or None (no queue)
    side_stream()           a second queue for copies beside the forward pass, or None
    on_stream(stream)       context: queue work on stream (nothing for None)
    wait_for_current(s)     s waits for what the current stream has queued
    can_capture_graphs      decode steps may be captured and replayed
    capture(graph, pool)    context: capture into graph
    allocate(shape, dtype, is_shared)   the KV cache, zeroed; shareable with other processes
    share(cache)            a handle another process on this host can open
    open_shared(h, ...)     that process's view of the shared allocation, and how to close it
    release(cache)          the cache's shared segment, if any, is unlinked
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from multiprocessing import shared_memory

import torch

from common.base.env import read_env
from common.base.log import get_logger
from common.base.procs import is_alive
from kernels import backends as kernel_backends
from kernels.options import KernelOptions

SHM_PREFIX = (
    "pdserve-kv"  # /dev/shm/pdserve-kv-<pid namespace>-<pid>-<hex>: a CPU cache other processes map
)


def _nbytes(shape, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


class PlatformError(RuntimeError):
    pass


PLATFORMS: dict[str, type["CpuPlatform"]] = {}  # by torch device type


def register(cls):
    """Class decorator: the platform of cls.type from now on."""
    PLATFORMS[cls.type] = cls
    return cls


@register
class CpuPlatform:
    type = "cpu"
    is_pinned = False
    can_capture_graphs = False
    kernels: str | None = "kernels.cpu"
    kernels_off: str | None = "disable_cpu_kernels"
    is_host = True
    default_dtype = torch.float32
    nixl_memory: str | None = "DRAM"

    @classmethod
    def torch_device(cls, name: str) -> torch.device:
        """The torch device a name of this platform's (a stand-in may map its own names)."""
        return torch.device(name)

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
        self.device = device
        self._segment: shared_memory.SharedMemory | None = None  # a shared CPU cache's

    def activate(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def free_memory(self) -> int:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def release_memory(self) -> None:
        pass

    def event(self, timing: bool = False):
        return None  # work runs as it is called: nothing is queued to mark

    def side_stream(self):
        return None

    def on_stream(self, stream):
        return contextlib.nullcontext()

    def wait_for_current(self, stream) -> None:
        pass

    def new_graph(self):
        raise PlatformError("the CPU has no graphs")

    def capture(self, graph, pool=None):
        raise PlatformError("the CPU has no graphs")

    # ---- a cache other processes map: a shared-memory segment ------------------

    def allocate(self, shape, dtype: torch.dtype, is_shared: bool = False) -> torch.Tensor:
        if not is_shared:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        _remove_stale_segments()
        nbytes = _nbytes(shape, dtype)
        # Python's resource tracker unlinks the segment if this process dies without closing it.
        self._segment = shared_memory.SharedMemory(
            f"{SHM_PREFIX}-{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(4)}",
            create=True,
            size=max(nbytes, 1),
        )
        # a fresh segment reads as zeros
        return (
            torch.frombuffer(self._segment.buf, dtype=torch.uint8, count=nbytes)
            .view(dtype)
            .view(shape)
        )

    def share(self, cache: torch.Tensor) -> str:
        segment = self._segment
        if segment is None:
            raise PlatformError("this CPU cache was not allocated in shared memory")
        return segment.name

    def open_shared(self, handle, dtype: torch.dtype, shape: list[int]):
        name = handle if isinstance(handle, str) else ""
        if not name.startswith(SHM_PREFIX + "-") or "/" in name:
            raise PlatformError(f"no usable shared-memory segment named ({name!r})")
        nbytes = _nbytes(shape, dtype)
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
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)

        def close() -> None:
            try:
                mapping.close()
            except BufferError:  # a tensor view is still alive: the mapping goes at exit
                pass

        return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(dtype).view(
            shape
        ), close

    def release(self, cache: torch.Tensor | None = None) -> None:
        segment, self._segment = self._segment, None
        if segment is None:
            return
        try:
            segment.close()
        except BufferError:  # a tensor view is still alive somewhere: the mapping goes at exit
            pass
        try:
            segment.unlink()
        except FileNotFoundError:
            pass


@register
class CudaPlatform(CpuPlatform):
    type = "cuda"
    is_pinned = True
    can_capture_graphs = True
    kernels = "kernels.triton_cuda"
    kernels_off = "disable_triton"
    is_host = False
    default_dtype = torch.bfloat16
    nixl_memory = "VRAM"

    @classmethod
    def check(cls, device: torch.device) -> None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"--device {device}: this machine has no usable CUDA device "
                f"(torch {torch.__version__}); use --device cpu"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"--device {device}: this machine has {count} CUDA device(s), "
                f"cuda:0 to cuda:{count - 1}"
            )

    @classmethod
    def why_not_shared(cls) -> str | None:
        return None

    @staticmethod
    def process_group(store, rank: int, size: int, timeout):
        import torch.distributed as dist

        return dist.ProcessGroupNCCL(store, rank, size)

    def activate(self) -> None:
        torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def free_memory(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def release_memory(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def event(self, timing: bool = False):
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record()
        return ev

    def side_stream(self):
        return torch.cuda.Stream(self.device)

    def on_stream(self, stream):
        return torch.cuda.stream(stream)

    def wait_for_current(self, stream) -> None:
        stream.wait_stream(torch.cuda.current_stream(self.device))

    def new_graph(self):
        return torch.cuda.CUDAGraph()

    def capture(self, graph, pool=None):
        return torch.cuda.graph(graph, pool=pool)

    def allocate(self, shape, dtype: torch.dtype, is_shared: bool = False) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)  # any allocation can be shared

    def release(self, cache: torch.Tensor | None = None) -> None:
        pass

    def share(self, cache: torch.Tensor) -> tuple:
        """The IPC handle of the cache's allocation: plain bytes and ints, in
        CudaIpcHandle's field order."""
        if cache.storage_offset() != 0:
            raise PlatformError("the KV cache must start its allocation to be shared")
        (device, handle, size, offset, ref_handle, ref_offset, event_handle, is_sync) = (
            cache.untyped_storage()._share_cuda_()
        )
        return (
            int(device),
            bytes(handle),
            int(size),
            int(offset),
            bytes(ref_handle),
            int(ref_offset),
            bytes(event_handle) if event_handle else None,
            bool(is_sync),
        )

    def open_shared(self, handle, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        device, h, size, offset, ref_h, ref_offset, event_h, is_sync = handle
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                device, h, size, offset, ref_h, ref_offset, event_h or b"", is_sync
            )
        except Exception as e:  # a bad or foreign handle: CUDA's error, whatever its type
            raise PlatformError(f"cannot open the CUDA IPC handle: {e}") from None
        nbytes = _nbytes(shape, dtype)
        if nbytes > storage.nbytes():
            raise PlatformError(
                f"the shared allocation holds {storage.nbytes()} bytes, "
                f"{list(shape)} needs {nbytes}"
            )
        return torch.empty(0, dtype=dtype, device=f"cuda:{device}").set_(
            storage, 0, shape
        ), lambda: None


@register
class NpuPlatform(CpuPlatform):
    """Ascend through torch_npu. NOTE: no events or side streams yet: a step is
    collected by synchronizing, and transfers copy on the default stream."""

    type = "npu"
    is_pinned = True
    kernels = "kernels.npu"
    kernels_off = None
    is_host = False
    default_dtype = torch.bfloat16
    nixl_memory = None

    @classmethod
    def check(cls, device: torch.device) -> None:
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise ValueError(
                f"--device {device}: torch_npu is not installed; use --device cpu "
                f"or install torch_npu on an Ascend host"
            ) from None

    @classmethod
    def why_not_shared(cls) -> str | None:
        return "sharing an Ascend cache between processes is not supported"

    @staticmethod
    def process_group(store, rank: int, size: int, timeout):
        import torch_npu  # noqa: F401  (registers ProcessGroupHCCL)

        return torch.distributed.ProcessGroupHCCL(store, rank, size)

    def activate(self) -> None:
        import torch_npu  # noqa: F401  (registers the npu device)

        torch.npu.set_device(self.device)  # type: ignore[attr-defined]

    def synchronize(self) -> None:
        torch.npu.synchronize(self.device)  # type: ignore[attr-defined]

    def free_memory(self) -> int:
        return torch.npu.mem_get_info(self.device)[0]  # type: ignore[attr-defined]

    def release_memory(self) -> None:
        self.synchronize()
        torch.npu.empty_cache()  # type: ignore[attr-defined]

    def allocate(self, shape, dtype: torch.dtype, is_shared: bool = False) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def release(self, cache: torch.Tensor | None = None) -> None:
        pass

    def share(self, cache: torch.Tensor):
        raise PlatformError("sharing an Ascend cache between processes is not supported")

    def open_shared(self, handle, dtype: torch.dtype, shape: list[int]):
        raise PlatformError("sharing an Ascend cache between processes is not supported")


def platform_type(device: torch.device | str) -> type[CpuPlatform]:
    """The platform class of a device (ValueError: no platform serves its type)."""
    kind = str(device).partition(":")[0]
    if kind not in PLATFORMS:
        raise ValueError(
            f"device {str(device)!r}: no platform serves {kind!r}; one of "
            f"{', '.join(sorted(PLATFORMS))} (with :N where there are several)"
        )
    return PLATFORMS[kind]


def torch_device(device: torch.device | str) -> torch.device:
    return platform_type(device).torch_device(str(device))


def check_device(device: str) -> None:
    """The device exists on this machine, or a ValueError saying what to use instead."""
    platform_type(device).check(torch_device(device))


def platform_for(device: torch.device | str) -> CpuPlatform:
    """The device's platform (its .device: the torch device); the kernels are configured
    from the environment first."""
    configure_kernels()
    return platform_type(device)(torch_device(device))


def configure_kernels() -> None:
    """Tell the kernels each platform's fast module, those the environment turns off
    (common/base/env.py), and where the CPU one is built."""
    env = read_env()
    get_logger("kernels")  # what the kernels say is logged as the process's other lines are
    off = {
        t: f"PDSERVE_{p.kernels_off.upper()}=1"
        for t, p in PLATFORMS.items()
        if p.kernels_off and getattr(env, p.kernels_off)
    }
    kernel_backends.configure(
        KernelOptions(
            tuple(sorted((t, p.kernels) for t, p in PLATFORMS.items() if p.kernels)),
            tuple(sorted(off.items())),
            env.home / "kernels",
        )
    )


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
