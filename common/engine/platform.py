"""The device platforms, found by device type: everything that differs by device is
declared by one Platform class per type (common/engine/platform_base.py says what each
must define), so the worker, the transfer backends and the process set-up name no
device API. A new device is its class (platform_<type>.py, or anywhere: register() is
all it takes), its kernels module in kernels/, and a test.
"""

from __future__ import annotations

import torch

from common.base.env import read_env
from common.base.log import get_logger
from common.engine.platform_base import Platform, PlatformError
from common.engine.platform_cpu import CpuPlatform
from common.engine.platform_cuda import CudaPlatform
from common.engine.platform_npu import NpuPlatform
from kernels import backends as kernel_backends
from kernels.options import KernelOptions

__all__ = [
    "PLATFORMS",
    "CpuPlatform",
    "CudaPlatform",
    "NpuPlatform",
    "Platform",
    "PlatformError",
    "check_device",
    "configure_kernels",
    "platform_for",
    "platform_type",
    "register",
    "torch_device",
]

# by torch device type
PLATFORMS: dict[str, type[Platform]] = {p.type: p for p in (CpuPlatform, CudaPlatform, NpuPlatform)}


def register(cls: type[Platform]) -> type[Platform]:
    """Class decorator: the platform of cls.type from now on."""
    PLATFORMS[cls.type] = cls
    return cls


def platform_type(device: torch.device | str) -> type[Platform]:
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


def platform_for(device: torch.device | str) -> Platform:
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
