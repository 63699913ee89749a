"""A node's worker: the model it runs, on which device, in what dtype, with how much KV
cache and how many rows (WorkerConfig). Each node's config holds one (common/base/config.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from common.base.flags import flag
from common.base.model_dir import check_model_dir
from common.base.parse import DTYPES, parse_bytes, parse_core_pool, parse_dtype
from common.base.speculative import SpeculativeConfig, parse_speculative

KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # fp8: e4m3 (vLLM's spelling)
_DEVICE_RE = re.compile(r"^[a-z][a-z0-9_]*(:\d+)?$")


@dataclass(frozen=True)
class WorkerConfig:
    model: str | None = field(
        default=None, metadata=flag("--model", "a Hugging Face Qwen3 model directory")
    )
    shape: str | None = field(
        default=None,
        metadata=flag("--shape", "a preset shape with random weights (e.g. qwen3-0.6b)"),
    )
    device: str = field(default="cpu", metadata=flag("--device", "cpu, cuda:N or npu:N"))
    dtype: str | None = field(
        default=None,
        metadata=flag(
            "--dtype",
            "float32, bfloat16 or float16 (also: half, float, auto); default: float32 on cpu, "
            "bfloat16 elsewhere",
            parse=parse_dtype,
        ),
    )
    block_size: int = field(default=16, metadata=flag("--block-size", "tokens per KV block"))
    kv_cache_memory: int | None = field(
        default=None,
        metadata=flag(
            "--kv-cache-memory",
            "KV cache budget, e.g. 2GiB (default: --kv-cache-fraction of free "
            "accelerator memory, 256MiB on cpu)",
            parse=parse_bytes,
            metavar="SIZE",
        ),
    )
    kv_cache_fraction: float = field(
        default=0.85,
        metadata=flag(
            "--kv-cache-fraction",
            "share of the accelerator memory left after the weights that the KV "
            "cache takes, when --kv-cache-memory is not given (NOTE: vLLM's flag counts the "
            "weights in; here they are taken out first)",
            "--gpu-memory-utilization",
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=flag(
            "--kv-cache-dtype",
            "auto (the model's dtype), int8 or fp8 (e4m3): KV kept in 8 bits with a scale per "
            "token and head, about twice the tokens in the same memory",
            choices=KV_CACHE_DTYPES,
        ),
    )
    cpu_kv_cache_memory: int = 256 * 2**20  # the CPU default budget
    max_batch_size: int = field(
        default=64,
        metadata=flag(
            "--max-batch-size",
            "decode: requests in one batch (rows held on the device)",
            "--max-num-seqs",
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=flag("--max-model-len", "default: the model's max_position_embeddings", parse=int),
    )
    use_graphs: bool = field(
        default=True,
        metadata=flag(
            "--no-graphs",
            "eager decode steps on CUDA (default: CUDA graphs where available)",
            "--enforce-eager",
        ),
    )
    core_pool: str | None = field(
        default=None,
        metadata=flag(
            "--core-pool",
            "CPU: share the host's cores with the other nodes of this pool, "
            "NAME:BUDGET:SHARE (cores in all, cores owed to this node); --threads caps this node",
            parse=str,
            metavar="NAME:BUDGET:SHARE",
        ),
    )
    speculative: SpeculativeConfig = field(
        default=SpeculativeConfig(),
        metadata=flag(
            "--speculative-config",
            "decode: draft tokens and verify them in the step, e.g. "
            '\'{"method": "ngram", "num_speculative_tokens": 3}\' (prompt lookup; "suffix": '
            "suffix decoding), off, or auto: prompt lookup of 4 drafts on a CPU (it turns "
            "itself down where drafts miss; in float32, where a verify step's tokens "
            "equal plain decoding's), off on other devices",
            parse=parse_speculative,
            metavar="JSON",
            default_text="auto",
        ),
    )
    is_cache_in_shm: bool = (
        False  # CPU: the cache lives in a shared-memory segment (ipc KV transfer)
    )
    seed: int = 0  # random weights

    def __post_init__(self) -> None:
        if (self.model is None) == (self.shape is None):
            raise ValueError("give exactly one of model (a directory) or shape (a preset)")
        if self.model is not None:
            check_model_dir(self.model)
        if self.core_pool is not None:
            parse_core_pool(self.core_pool)
        if not _DEVICE_RE.match(self.device):  # which types exist: the engine's platforms
            raise ValueError(
                f"device must be TYPE or TYPE:N (cpu, cuda:N, npu:N), got {self.device!r}"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.kv_cache_fraction < 1.0:
            raise ValueError(f"kv_cache_fraction must be in (0, 1), got {self.kv_cache_fraction}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """None: the device's platform chooses (common/engine/platform.py: default_dtype)."""
        return None if self.dtype is None else DTYPES[self.dtype]


def clamp_model_len(requested: int | None, max_position_embeddings: int) -> int:
    """The longest sequence a node serves: what was asked for, never past the model's positions."""
    return min(requested or max_position_embeddings, max_position_embeddings)
