"""What the kernels are told by the engine: which fast backends may serve, and where the
CPU one is built. The engine reads them from the environment (common/base/env.py) and
sets them once per process, before the first op (kernels/backends.py: configure, called
by common/engine/platform.py); kernels/ itself reads no environment variable of ours.
NOTE: process-wide, like torch's backend flags.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KernelOptions:
    is_triton_disabled: bool = False         # portable ops on CUDA too
    is_cpu_kernels_disabled: bool = False    # portable ops on CPU too
    # where the CPU kernel is built and cached (the engine names $PDSERVE_HOME/kernels)
    build_dir: Path = Path(tempfile.gettempdir()) / f"pdserve-kernels-{getattr(os, 'getuid', lambda: 0)()}"


current = [KernelOptions()]   # one slot, set through kernels.backends.configure()
