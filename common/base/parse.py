"""Flag text read into values: sizes, dtypes, core pools."""

from __future__ import annotations

import re

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_bytes(text: str | int | None) -> int | None:
    """'512MiB', '2GiB', '1000000' -> bytes."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a size from {text!r}; say e.g. 512MiB or 2GiB")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(unit or " "))


def parse_swap(text: str) -> int:
    """--swap-space: a bare number is GiB (as vLLM's flag), else a size with its unit."""
    try:
        return int(float(text) * 2**30)
    except ValueError:
        return parse_bytes(text)


def parse_dtype(text: str) -> str | None:
    return None if text == "auto" else text


def parse_core_pool(text: str) -> tuple[str, int, int]:
    """--core-pool NAME:BUDGET:SHARE -> (name, budget, share); ValueError says what is wrong."""
    m = re.fullmatch(r"([A-Za-z0-9._-]{1,100}):(\d+):(\d+)", text)
    if not m or not 1 <= int(m[3]) <= int(m[2]):
        raise ValueError(
            f"--core-pool takes NAME:BUDGET:SHARE (letters, digits, '.', '_', '-'; "
            f"1 <= SHARE <= BUDGET), got {text!r}"
        )
    return m[1], int(m[2]), int(m[3])
