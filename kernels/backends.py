"""Which implementation serves a device type. A backend is a module exposing
the op functions; a fast backend may leave an op out and the portable one
serves it. Chosen once per device type, not per call."""

from __future__ import annotations

import importlib
import logging
import types
from functools import lru_cache, partial

import torch

from kernels import options, portable
from kernels.options import KernelOptions

log = logging.getLogger("pdserve.kernels")
_OPS = (
    "rms_norm",
    "add_rms_norm",
    "qk_norm_rope",
    "write_kv",
    "prefill_attention",
    "decode_attention",
    "linear",
    "pack_linear_weight",
    "embedding",
    "silu_mul",
    "qk_norm_rope_write_kv",
    "compute_slot_mapping",
    "advance_step",
    "prompt_lookup",
)


def _merge(fast) -> types.SimpleNamespace:
    ops = {op: getattr(fast, op, getattr(portable, op)) for op in _OPS}
    # NOTE: a backend without a verify attention of its own spreads it over its decode one
    spread = partial(portable.verify_attention, decode_attention=ops["decode_attention"])
    ops["verify_attention"] = getattr(fast, "verify_attention", spread)
    # whether decode and verify attention read an 8-bit cache in place (kernels/kv_quant.py)
    ops["reads_8bit_kv"] = getattr(fast, "reads_8bit_kv", False)
    return types.SimpleNamespace(**ops)


def configure(opts: KernelOptions) -> None:
    """The engine's options (kernels/options.py); a change makes the next op choose again."""
    if opts != options.current[0]:
        options.current[0] = opts
        _backend_for_type.cache_clear()


@lru_cache(maxsize=None)
def _backend_for_type(device_type: str):
    """The device type's fast module (its platform names it), over the portable ops."""
    opts = options.current[0]
    why_off, name = dict(opts.off).get(device_type), dict(opts.fast).get(device_type)
    if name is None:
        return portable
    if why_off:
        log.warning("fast %s kernels are off (%s): the portable ones serve", device_type, why_off)
        return portable
    try:
        return _merge(importlib.import_module(name))
    except ImportError as e:
        log.warning("fast %s kernels unavailable (%s): the portable ones serve", device_type, e)
        return portable


def describe(device_type: str) -> str:
    """What serves this device type's ops, in words (a node's ready line)."""
    if _backend_for_type(device_type) is portable:
        return "portable (torch)"
    name = dict(options.current[0].fast)[device_type]
    module = importlib.import_module(name)  # loaded already: the backend above is built on it
    return module.describe() if hasattr(module, "describe") else name


def backend_for(t: torch.Tensor):
    return _backend_for_type(t.device.type)
