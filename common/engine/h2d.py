"""The one way host data reaches the device: every write is counted, so a test can
show that a steady decode step makes none."""

from __future__ import annotations

import threading

import numpy as np
import torch


class HostToDevice:
    def __init__(self, device: torch.device):
        self.device = device
        self.num_writes = 0
        self.num_bytes = 0
        self._lock = threading.Lock()  # prefill lanes count from several threads

    def write(self, dst: torch.Tensor, values) -> None:
        """Copy host values into the device tensor dst (same shape). A pinned source
        is copied without waiting; the caller keeps it unchanged until the device
        has read it."""
        src = torch.as_tensor(values, dtype=dst.dtype).reshape(dst.shape)
        dst.copy_(src, non_blocking=src.is_pinned())
        with self._lock:
            self.num_writes += 1
            self.num_bytes += src.numel() * src.element_size()

    def tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        """A fresh device tensor from host values (prefill inputs)."""
        t = torch.empty(np.shape(values), dtype=dtype, device=self.device)
        self.write(t, values)
        return t

    def stats(self) -> dict:
        return {"num_h2d_writes": self.num_writes, "num_h2d_bytes": self.num_bytes}

    def reset(self) -> None:
        self.num_writes = self.num_bytes = 0
