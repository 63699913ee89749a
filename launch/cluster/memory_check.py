"""Whether this host's memory holds what a launch or a benchmark is about to load, asked
before anything starts: a refusal is one line saying what needs how much, what is
available, and what to change."""

from __future__ import annotations

import json
from pathlib import Path

from common.base.config import DTYPES

GIB = 2**30


def available_bytes() -> int | None:
    """What the host can give without swapping (MemAvailable); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def element_size(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def checkpoint_bytes(model_dir: str | Path, dtype: str) -> int:
    """The weights' bytes once loaded in dtype: the checkpoint's safetensors, rescaled
    from the dtype they were saved in (config.json's, else bfloat16)."""
    d = Path(model_dir)
    on_disk = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    saved = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return on_disk * element_size(dtype) // element_size(saved if saved in DTYPES else "bfloat16")


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def refusal(what: str, need: dict[str, int], fixes: str, have: int | None = None) -> str | None:
    """None when the parts of need fit in what is available (have: else the host's);
    else the line that says they do not, and fixes."""
    have = available_bytes() if have is None else have
    total = sum(need.values())
    if have is None or total <= have:
        return None
    parts = ", ".join(f"{k} {gib(v)}" for k, v in need.items())
    return f"{what} needs ~{gib(total)} of memory ({parts}); {gib(have)} is available: {fixes}"
