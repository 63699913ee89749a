"""The Ascend platform, through torch_npu."""

from __future__ import annotations

import torch

from common.engine.platform_base import Platform, PlatformError


class NpuPlatform(Platform):
    """Ascend through torch_npu. NOTE: no events or side streams yet: a step is
    collected by synchronizing, and transfers copy on the default stream."""

    type = "npu"
    is_pinned = True
    can_capture_graphs = False
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
