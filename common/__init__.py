"""What pdserve's processes share, in rooms. Imports run only down this list, and
a room imports only the rooms it names (tests/test_layout.py checks it):

    base      environment variables, logging, the role configs, the model's
              spec, a request's parameters and rules              (nothing of ours)
    (kernels/ sits here: device ops; imports only base's env and log)
    kv        the cache layout, block allocator, prefix cache,
              a sequence's host-side state                        base
    wire      messages by link, their codec, channels, keys       base
    engine    device platform, model, loader, sampling, worker    base, kv, kernels
    transfer  KV transfer backends                                base, kv, wire, engine
    handoff   reserve -> write -> commit, both halves             base, kv, wire, transfer
    runtime   a node process: frontend link, heartbeat, threads   base, wire

The modules that lived at common/<name>.py before the rooms still import by their
old names (MOVED): the same module objects, so old imports keep working.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

MOVED = {
    "common.config": ("common.base.config",), "common.env": ("common.base.env",),
    "common.log": ("common.base.log",),
    "common.protocol": ("common.wire.protocol",), "common.channel": ("common.wire.channel",),
    "common.keys": ("common.wire.keys",),
    "common.kv_cache": ("common.kv.blocks",), "common.prefix": ("common.kv.prefix",),
    "common.sequence": ("common.kv.sequence", "common.base.request"),
    "common.model_spec": ("common.base.model_spec",), "common.qwen3": ("common.engine.qwen3",),
    "common.loader": ("common.engine.loader",), "common.worker": ("common.engine.worker",),
    "common.sampling": ("common.engine.sampling", "common.base.request"),
    "common.heartbeat": ("common.runtime.heartbeat",), "common.process": ("common.runtime.process",),
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        homes = [importlib.import_module(m) for m in MOVED[module.__name__]]
        if len(homes) == 1:
            # NOTE: the import system re-reads sys.modules after exec_module, so the
            # old name is bound to the moved module itself, not to a copy of it.
            sys.modules[module.__name__] = homes[0]
            return
        for home in reversed(homes):   # a module split in two: the union of both
            module.__dict__.update({k: v for k, v in vars(home).items() if not k.startswith("__")})


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
