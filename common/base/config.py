"""One frozen config per role, validated at creation: a node's worker (WorkerConfig), what
both nodes share (NodeConfig), and each node's own (PrefillConfig, DecodeConfig). The
frontend's is common/base/frontend_config.py."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from common.base.endpoints import (
    WILDCARDS,
    NodeLinks,
    check_endpoint,
    endpoint,
    endpoint_host,
    is_loopback_endpoint,
)
from common.base.flags import flag
from common.base.frontend_config import FrontendConfig
from common.base.layerwise import KV_LAYERWISE
from common.base.model_dir import check_model_dir
from common.base.parse import (
    DTYPES,
    parse_bytes,
    parse_core_pool,
    parse_dtype,
    parse_swap,
)
from common.base.speculative import SpeculativeConfig, parse_speculative

# NOTE: the names its callers import from here, wherever they are defined.
__all__ = [
    "DTYPES",
    "KV_BACKENDS",
    "KV_TRANSFERS",
    "DecodeConfig",
    "FrontendConfig",
    "NodeConfig",
    "NodeLinks",
    "PrefillConfig",
    "WorkerConfig",
    "check_endpoint",
    "check_model_dir",
    "clamp_model_len",
    "endpoint",
    "endpoint_host",
    "is_loopback_endpoint",
    "parse_bytes",
    "parse_core_pool",
    "parse_dtype",
]

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
            "suffix decoding), or off",
            parse=parse_speculative,
            metavar="JSON",
            default_text="off",
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


# The KV transfer backends, best first: each is the module common/transfer/<name>.py.
KV_BACKENDS = ("ipc", "nixl", "tcp", "dist")
KV_TRANSFERS = ("auto", *KV_BACKENDS)  # what --kv-transfer takes
_NAME = flag("--name", "unique in the cluster (with keys: its key's name)")


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    """What a prefill and a decode node share: their worker, their frontend, how their KV
    moves, and how they stop. Each role extends it (PrefillConfig, DecodeConfig)."""

    worker: WorkerConfig
    frontend_endpoint: str = field(
        metadata=flag("--frontend", "the frontend's node endpoint (we connect)")
    )
    name: str = field(metadata=_NAME)  # each role gives its default
    kv_transfer: str  # --kv-transfer: each role says what its auto means
    kv_layerwise: str = field(
        default="auto",
        metadata=flag(
            "--kv-layerwise",
            "push a prompt's KV layer by layer while its prefill computes the "
            "rest (on a decode node: whether it takes such writes). auto: where the transfer "
            "would take long enough to hide, at the rate measured on that link",
            choices=KV_LAYERWISE,
        ),
    )
    links: NodeLinks = field(default_factory=NodeLinks)
    allow_remote: bool = field(
        default=False, metadata=flag("--allow-remote", "allow non-loopback endpoints")
    )
    keys_dir: str | None = field(
        default=None,
        metadata=flag(
            "--keys",
            "CURVE keys (python -m launch.keys DIR); this node's is DIR/NAME.key_secret",
            metavar="DIR",
        ),
    )
    is_prefix_caching: bool = field(
        default=True,
        metadata=flag(
            "--no-prefix-caching",
            "compute every prompt from scratch (default: reuse cached full "
            "blocks; a decode node keeps finished sequences' blocks for follow-up turns)",
            "--no-enable-prefix-caching",
        ),
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "--drain-timeout",
            "on SIGTERM or a drain: seconds its requests get to move elsewhere or finish "
            "before it stops",
        ),
    )
    is_kv_verified: bool = field(
        default=False,
        metadata=flag(
            "--kv-verify",
            "check every handoff's KV end to end: the prefill node sends a checksum of "
            "each block with the commit, the decode node checks the blocks once landed and "
            "refuses (the request moves on) on a mismatch",
        ),
    )

    def __post_init__(self) -> None:
        check_endpoint("frontend_endpoint", self.frontend_endpoint, self.allow_remote)
        if self.kv_transfer not in KV_TRANSFERS:
            raise ValueError(f"kv_transfer must be one of {KV_TRANSFERS}, got {self.kv_transfer!r}")
        if self.kv_layerwise not in KV_LAYERWISE:
            raise ValueError(
                f"kv_layerwise must be one of {KV_LAYERWISE}, got {self.kv_layerwise!r}"
            )
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(NodeConfig):
    name: str = field(default="prefill-0", metadata=_NAME)
    kv_transfer: str = field(
        default="auto",
        metadata=flag(
            "--kv-transfer",
            "auto: the best backend both nodes can use with that decode node: ipc on "
            "this host, else nixl, else tcp",
            choices=KV_TRANSFERS,
        ),
    )
    token_budget: int = field(
        default=8192,
        metadata=flag(
            "--token-budget",
            "prompt tokens per forward pass (a prefill node runs no decode steps, so "
            "larger passes cost no one latency)",
            "--max-num-batched-tokens",
        ),
    )
    max_pass_s: float = field(
        default=2.0,
        metadata=flag(
            "--max-pass-time",
            "seconds a forward pass should take at most: where the token budget "
            "takes longer (a large model on a CPU), a pass holds fewer tokens, from the "
            "measured rate (at least 256); 0: the token budget alone",
        ),
    )
    max_batch_prompts: int = 64
    handoff_lease_s: float = field(
        default=10.0,
        metadata=flag(
            "--handoff-lease",
            "seconds after its prefill within which a handoff must be committed, and "
            "within which a decode node must answer a reservation request",
        ),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.token_budget < self.worker.block_size:
            raise ValueError(f"token_budget must be >= block_size ({self.worker.block_size})")
        if self.max_batch_prompts < 1 or self.handoff_lease_s <= 0:
            raise ValueError("max_batch_prompts must be >= 1 and handoff_lease_s > 0")


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(NodeConfig):
    name: str = field(default="decode-0", metadata=_NAME)
    kv_transfer: str = field(
        default="auto",
        metadata=flag(
            "--kv-transfer",
            "KV transfer backends offered to prefill nodes (auto: ipc and tcp, and nixl "
            "when the KV link is reachable from other hosts; never dist)",
            choices=KV_TRANSFERS,
        ),
    )
    kv_endpoint: str = field(
        metadata=flag("--kv-bind", "where prefill nodes hand KV to this node (we bind)")
    )
    max_queue: int = field(
        default=256,
        metadata=flag(
            "--max-queue",
            "reservations held (being written or waiting for a batch row), and requests "
            "waiting in line for blocks",
        ),
    )
    reservation_lease_s: float = field(
        default=30.0,
        metadata=flag(
            "--reservation-lease",
            "seconds before a reservation neither renewed nor committed is freed",
        ),
    )
    is_preemptive: bool = field(
        default=True,
        metadata=flag(
            "--no-preemption",
            "reserve every block a request could need (prompt + max_tokens) before it "
            "starts, as a smaller batch that is never preempted (default: admit on what a "
            "request needs now, preempt when full)",
        ),
    )
    kv_advertise: str | None = field(
        default=None,
        metadata=flag(
            "--kv-advertise",
            "the KV endpoint prefill nodes are told to connect to (default: --kv-bind; "
            "needed when --kv-bind is a wildcard such as tcp://0.0.0.0:PORT)",
        ),
    )
    swap_space: int = field(
        default=4 * 2**30,
        metadata=flag(
            "--swap-space",
            "host memory for the KV of preempted requests: GiB, or a size such as 512MiB; "
            "past it, a preempted request's KV is dropped and recomputed when it resumes "
            "(0: always)",
            parse=parse_swap,
            metavar="SIZE",
            default_text="4",
        ),
    )

    @property
    def kv_reachable(self) -> str:
        """The KV endpoint prefill nodes connect to."""
        return self.kv_advertise or self.kv_endpoint

    def __post_init__(self) -> None:
        super().__post_init__()
        check_endpoint("kv_endpoint", self.kv_endpoint, self.allow_remote)
        if self.kv_advertise is not None:
            check_endpoint("kv_advertise", self.kv_advertise, self.allow_remote)
        # NOTE: a wildcard binds every interface but names none: peers told it connect nowhere.
        for name, value in (
            ("kv_advertise", self.kv_advertise),
            ("kv_endpoint", self.kv_endpoint if self.kv_advertise is None else None),
        ):
            if value is not None and endpoint_host(value) in WILDCARDS:
                raise ValueError(
                    f"{name} {value} is a wildcard address, which no prefill node can "
                    f"connect to: give --kv-advertise tcp://HOST:PORT, an address of this "
                    f"host that prefill nodes reach"
                )
        if self.max_queue < 1 or self.reservation_lease_s <= 0:
            raise ValueError("max_queue must be >= 1 and reservation_lease_s > 0")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")
