"""What the kernels are told by the engine: each device type's fast module, those the
environment turns off, and where the CPU one is built. The engine's platforms declare
them (common/engine/platform.py: configure_kernels, before the first op); kernels/
itself reads no environment variable of ours.
NOTE: process-wide, like torch's backend flags.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KernelOptions:
    # device type -> the module of its fast ops; one not named is served by the portable ops
    fast: tuple[tuple[str, str], ...] = (
        ("cpu", "kernels.cpu"),
        ("cuda", "kernels.triton_cuda"),
        ("npu", "kernels.npu"),
    )
    off: tuple[tuple[str, str], ...] = ()  # device type -> why its fast ops are off (the switch)
    # where the CPU kernel is built and cached (the engine names $PDSERVE_HOME/kernels)
    build_dir: Path = (
        Path(tempfile.gettempdir()) / f"pdserve-kernels-{getattr(os, 'getuid', lambda: 0)()}"
    )


current = [KernelOptions()]  # one slot, set through kernels.backends.configure()
