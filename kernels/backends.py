"""Which implementation serves a device type. A backend is a module exposing
the op functions; a fast backend may leave an op out and the portable one
serves it. Chosen once per device type, not per call."""
from __future__ import annotations

import logging
import types
from functools import lru_cache

import torch

from kernels import options, portable
from kernels.options import KernelOptions

_OPS = ("rms_norm", "add_rms_norm", "qk_norm_rope", "write_kv", "prefill_attention",
        "decode_attention", "silu_mul", "qk_norm_rope_write_kv", "compute_slot_mapping",
        "advance_step")


def _merge(fast) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{op: getattr(fast, op, getattr(portable, op)) for op in _OPS})


def configure(opts: KernelOptions) -> None:
    """The engine's options (kernels/options.py); a change makes the next op choose again."""
    if opts != options.current[0]:
        options.current[0] = opts
        _backend_for_type.cache_clear()


@lru_cache(maxsize=None)
def _backend_for_type(device_type: str):
    opts = options.current[0]
    if device_type == "cuda" and not opts.is_triton_disabled:
        try:
            from kernels import triton_cuda
        except ImportError:
            return portable
        return _merge(triton_cuda)
    if device_type == "cpu" and not opts.is_cpu_kernels_disabled:
        try:
            from kernels import cpu
        except ImportError as e:
            logging.getLogger("pdserve.kernels").warning("CPU attention kernel unavailable (%s): the "
                                                         "portable one serves", e)
            return portable
        return _merge(cpu)
    if device_type == "npu":
        try:
            from kernels import npu
        except ImportError:
            return portable
        return _merge(npu)
    return portable


def backend_for(t: torch.Tensor):
    return _backend_for_type(t.device.type)
