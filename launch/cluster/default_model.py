"""A launcher's default model (no --model): the tiny random Qwen3, made on first use in a
process of its own, so that a launcher never imports torch (launch/make_tiny_model.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable


def make_default(model_dir: str, say: Callable[[str], None], where: str = "") -> None:
    if (Path(model_dir) / "config.json").is_file():
        return
    say(f"making a tiny random Qwen3 at {model_dir}{where}")
    subprocess.run(
        [sys.executable, "-m", "launch.make_tiny_model", model_dir],
        stdout=subprocess.DEVNULL,
        check=True,
    )
