"""What this CPU can run, read once: the vector and matrix instructions the CPU kernels
choose their paths by (kernels/cpu_linear.py), and the words a node's ready line says."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuFeatures:
    model: str
    is_avx2: bool
    is_avx512: bool
    is_avx512_bf16: bool
    is_amx_bf16: bool
    vendor: str = ""  # e.g. GenuineIntel, AuthenticAMD: some libraries choose paths by it

    @classmethod
    def read(cls, cpuinfo: str | None = None) -> CpuFeatures:
        """From /proc/cpuinfo (or the text given); a CPU it cannot read has none of them."""
        if cpuinfo is None:
            try:
                cpuinfo = Path("/proc/cpuinfo").read_text()
            except OSError:
                cpuinfo = ""
        flags: set[str] = set()
        model = vendor = ""
        for line in cpuinfo.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags" and not flags:
                flags = set(value.split())
            elif key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "vendor_id" and not vendor:
                vendor = value.strip()
        return cls(
            model=model or platform.machine(),
            is_avx2="avx2" in flags and "fma" in flags,
            is_avx512="avx512f" in flags,
            is_avx512_bf16="avx512_bf16" in flags,
            is_amx_bf16="amx_bf16" in flags and "amx_tile" in flags,
            vendor=vendor,
        )

    def describe(self) -> str:
        """The widest of each kind, e.g. 'AVX-512 BF16, AMX-BF16'."""
        vector = (
            "AVX-512 BF16"
            if self.is_avx512_bf16
            else "AVX-512"
            if self.is_avx512
            else "AVX2"
            if self.is_avx2
            else "no AVX2"
        )
        return f"{vector}, AMX-BF16" if self.is_amx_bf16 else vector
