"""What a device platform must define (Platform) and what every platform shares.

Each device type is one Platform subclass (platform_cpu.py, platform_cuda.py,
platform_npu.py), registered in platform.py. A subclass that leaves a declaration or an
abstract method out cannot be created: nothing is inherited from another device.

What a platform declares (class attributes):
    type                    the device type it serves ("cpu", "cuda:N" names one of several)
    kernels                 its fast kernels' module (kernels/), or None: the portable ops
    kernels_off             the environment switch (common/base/env.py field) that turns them off
    is_host                 its memory is the host's (threads per core, CPU KV budget, fp32 sums)
    default_dtype           when --dtype is not given
    nixl_memory             NIXL's memory kind for its cache ("DRAM", "VRAM"), or None: no NIXL
    is_pinned               host staging buffers are page-locked (async copies)
    can_capture_graphs      decode steps may be captured and replayed
What it says of this machine (class methods):
    check(device)           ValueError, in one line naming the fix, if this machine lacks it
    why_not_shared()        why processes on one host cannot share its memory, or None
    process_group(...)      torch.distributed's group of its kind (dist KV transfer)
And what it does:
    activate()              make the device current (and import its torch plugin)
    synchronize()           wait for all queued work
    free_memory()           bytes free on the device (host: available RAM)
    release_memory()        hand cached allocations back
    allocate(shape, dtype, is_shared)   the KV cache, zeroed; shareable with other processes
    share(cache)            a handle another process on this host can open
    open_shared(h, ...)     that process's view of the shared allocation, and how to close it
    release(cache)          the cache's shared segment, if any, is unlinked

Shared by all, each overridable: torch_device(name) (the same name), hold(t) (a tensor that
lives as long as the worker, the weights, where the device reads it fastest: t itself),
is_row_exact(dtype) (a row's logits the same alone and among others: float32 alone) and,
for a device whose work runs as it is called or whose queues are not used yet, no streams
or graphs:
    event(timing)           a marker queued on the current stream, or None (no queue)
    side_stream()           a second queue for copies beside the forward pass, or None
    on_stream(stream)       context: queue work on stream (nothing for None)
    wait_for_current(s)     s waits for what the current stream has queued
    new_graph(), capture(graph, pool)   a graph, and the context that captures into it
"""

from __future__ import annotations

import abc
import contextlib
from typing import ClassVar

import torch

# NOTE: annotations alone, so a subclass that forgets one is caught (__init_subclass__).
_DECLARED = (
    "type",
    "kernels",
    "kernels_off",
    "is_host",
    "default_dtype",
    "nixl_memory",
    "is_pinned",
    "can_capture_graphs",
)


class PlatformError(RuntimeError):
    pass


def num_bytes(shape, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


class Platform(abc.ABC):
    type: ClassVar[str]
    kernels: ClassVar[str | None]
    kernels_off: ClassVar[str | None]
    is_host: ClassVar[bool]
    default_dtype: ClassVar[torch.dtype]
    nixl_memory: ClassVar[str | None]
    is_pinned: ClassVar[bool]
    can_capture_graphs: ClassVar[bool]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        missing = [name for name in _DECLARED if not hasattr(cls, name)]
        if missing:
            raise TypeError(f"platform {cls.__name__} does not declare {', '.join(missing)}")

    def __init__(self, device: torch.device):
        self.device = device

    @classmethod
    def torch_device(cls, name: str) -> torch.device:
        """The torch device a name of this platform's (a stand-in may map its own names)."""
        return torch.device(name)

    # ---- what this machine has -----------------------------------------------------

    @classmethod
    def is_row_exact(cls, dtype: torch.dtype) -> bool:
        """Whether a row's logits come out the same in this dtype alone and among others
        (a verify step's tokens then equal plain decoding's): known of float32 alone.
        NOTE: bf16 on a CPU is not: oneDNN without bf16 units rounds one row apart from
        several, and with them a batch's rows change paths with its size (dot products to
        4 rows, AMX tiles beyond: kernels/cpu_linear.py); bench spec saw tokens differ."""
        return dtype == torch.float32

    @classmethod
    @abc.abstractmethod
    def check(cls, device: torch.device) -> None: ...

    @classmethod
    @abc.abstractmethod
    def why_not_shared(cls) -> str | None: ...

    @staticmethod
    @abc.abstractmethod
    def process_group(store, rank: int, size: int, timeout): ...

    # ---- the device ----------------------------------------------------------------

    @abc.abstractmethod
    def activate(self) -> None: ...

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    @abc.abstractmethod
    def free_memory(self) -> int: ...

    @abc.abstractmethod
    def release_memory(self) -> None: ...

    # ---- the KV cache, and its sharing with other processes on this host -------------

    @abc.abstractmethod
    def allocate(self, shape, dtype: torch.dtype, is_shared: bool = False) -> torch.Tensor: ...

    @abc.abstractmethod
    def share(self, cache: torch.Tensor): ...

    @abc.abstractmethod
    def open_shared(self, handle, dtype: torch.dtype, shape: list[int]): ...

    @abc.abstractmethod
    def release(self, cache: torch.Tensor | None = None) -> None: ...

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        """t, which lives as long as the worker (a weight), where this device reads it
        fastest: as it is."""
        return t

    # ---- queues and graphs: none unless a device has them ------------------------------

    def event(self, timing: bool = False):
        return None  # work runs as it is called (or is collected by synchronizing)

    def side_stream(self):
        return None

    def on_stream(self, stream):
        return contextlib.nullcontext()

    def wait_for_current(self, stream) -> None:
        pass

    def new_graph(self):
        raise PlatformError(f"a {self.type} device captures no graphs")

    def capture(self, graph, pool=None):
        raise PlatformError(f"a {self.type} device captures no graphs")
