"""Every environment variable pdserve reads, declared once, all prefixed PDSERVE_.

The shell scripts in launch/ read PDSERVE_VENV and PDSERVE_TORCH_SPEC (set-up
only); everything the Python processes read is here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# A launcher's pid, set in each child's environment; the child reads (and removes) it first
# thing, before read_env could run (common/base/lifetime.py)
PARENT_PID_ENV = "PDSERVE_PARENT_PID"
# One launcher's id, the same in every node it starts: its nodes share cores by its plan
# (common/base/placement.py)
LAUNCHER_ENV = "PDSERVE_LAUNCHER"


@dataclass(frozen=True)
class Env:
    log_level: str  # PDSERVE_LOG_LEVEL: DEBUG, INFO (default), WARNING
    log_interval_s: float  # PDSERVE_LOG_INTERVAL: seconds between a busy process's periodic
    # lines (default 10)
    home: Path  # PDSERVE_HOME: cache for the generated tiny model and built kernels
    disable_triton: bool  # PDSERVE_DISABLE_TRITON=1: portable kernels on CUDA too
    disable_graphs: bool  # PDSERVE_DISABLE_GRAPHS=1: eager decode on CUDA
    disable_cpu_kernels: bool  # PDSERVE_DISABLE_CPU_KERNELS=1: portable attention on CPU too
    ready_file: Path | None  # PDSERVE_READY_FILE: a node writes it once the frontend accepts it
    temp_keys: Path | None  # PDSERVE_TEMP_KEYS: keys made for this cluster alone; the frontend
    # removes them as it exits (also when its launcher was killed)


def _seconds(text: str | None, default: float) -> float:
    """A positive number of seconds, or the default (unset, or not such a number)."""
    try:
        value = float(text) if text else default
    except ValueError:
        return default
    return value if 0 < value < float("inf") else default


def read_env() -> Env:
    return Env(
        log_level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper(),
        log_interval_s=_seconds(os.environ.get("PDSERVE_LOG_INTERVAL"), 10.0),
        home=Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve")),
        disable_triton=os.environ.get("PDSERVE_DISABLE_TRITON", "0") == "1",
        disable_graphs=os.environ.get("PDSERVE_DISABLE_GRAPHS", "0") == "1",
        disable_cpu_kernels=os.environ.get("PDSERVE_DISABLE_CPU_KERNELS", "0") == "1",
        ready_file=Path(os.environ["PDSERVE_READY_FILE"])
        if os.environ.get("PDSERVE_READY_FILE")
        else None,
        temp_keys=Path(os.environ["PDSERVE_TEMP_KEYS"])
        if os.environ.get("PDSERVE_TEMP_KEYS")
        else None,
    )
