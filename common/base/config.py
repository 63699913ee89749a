"""One frozen config per role, validated at creation: what both nodes share (NodeConfig),
and each node's own (PrefillConfig, DecodeConfig). A node's worker's is
common/base/worker_config.py, the frontend's common/base/frontend_config.py."""

from __future__ import annotations

from dataclasses import dataclass, field

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
from common.base.kv_wire import KV_WIRE_DTYPES
from common.base.layerwise import KV_LAYERWISE
from common.base.model_dir import check_model_dir
from common.base.parse import DTYPES, parse_bytes, parse_core_pool, parse_dtype, parse_swap
from common.base.worker_config import KV_CACHE_DTYPES, WorkerConfig, clamp_model_len

# NOTE: the names its callers import from here, wherever they are defined.
__all__ = [
    "DTYPES",
    "KV_BACKENDS",
    "KV_CACHE_DTYPES",
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
    kv_wire_dtype: str = field(
        default="same",
        metadata=flag(
            "--kv-wire-dtype",
            "how a prompt's KV crosses a tcp or dist link from a cache in the model's dtype: same, "
            "int8 (each token and head's row with its scale, about half the bytes; lossy), "
            "or auto: int8 where the link time saved outweighs quantizing",
            choices=KV_WIRE_DTYPES,
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
        if self.kv_wire_dtype not in KV_WIRE_DTYPES:
            raise ValueError(
                f"kv_wire_dtype must be one of {KV_WIRE_DTYPES}, got {self.kv_wire_dtype!r}"
            )
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
