"""The CUDA platform: streams, events and graphs, Triton kernels (kernels/triton_cuda.py),
and a KV cache shared with processes on this host through a CUDA IPC handle."""

from __future__ import annotations

import torch

from common.engine.platform_base import Platform, PlatformError, num_bytes


class CudaPlatform(Platform):
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
        nbytes = num_bytes(shape, dtype)
        if nbytes > storage.nbytes():
            raise PlatformError(
                f"the shared allocation holds {storage.nbytes()} bytes, "
                f"{list(shape)} needs {nbytes}"
            )
        return torch.empty(0, dtype=dtype, device=f"cuda:{device}").set_(
            storage, 0, shape
        ), lambda: None
