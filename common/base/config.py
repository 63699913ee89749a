"""One frozen config per role, validated at creation."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from common.base.env import read_env
from common.base.flags import flag
from common.base.model_dir import check_model_dir  # noqa: F401  (re-exported: its callers' name)

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
_DEVICE_RE = re.compile(r"^[a-z][a-z0-9_]*(:\d+)?$")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_WILDCARDS = ("0.0.0.0", "::", "*")


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


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def parse_core_pool(text: str) -> tuple[str, int, int]:
    """--core-pool NAME:BUDGET:SHARE -> (name, budget, share); ValueError says what is wrong."""
    m = re.fullmatch(r"([A-Za-z0-9._-]{1,100}):(\d+):(\d+)", text)
    if not m or not 1 <= int(m[3]) <= int(m[2]):
        raise ValueError(
            f"--core-pool takes NAME:BUDGET:SHARE (letters, digits, '.', '_', '-'; "
            f"1 <= SHARE <= BUDGET), got {text!r}"
        )
    return m[1], int(m[2]), int(m[3])


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
            "cache takes, when --kv-cache-memory is not given (NOTE: vLLM's flag counts the weights in; "
            "here they are taken out first)",
            "--gpu-memory-utilization",
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


def endpoint_host(value: str) -> str:
    """The host of tcp://HOST:PORT (127.0.0.1 for ipc:// and inproc://)."""
    m = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:(\d+)", value)
    return m.group(1) if m else "127.0.0.1"


def is_loopback_endpoint(value: str) -> bool:
    """Only this machine can connect (tcp on a loopback address, ipc, inproc)."""
    return endpoint_host(value) in _LOOPBACK


def check_endpoint(name: str, value: str, allow_remote: bool) -> None:
    m = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:(\d+)|ipc://.+|inproc://.+", value)
    if not m:
        raise ValueError(f"{name} must be tcp://HOST:PORT or ipc://PATH, got {value!r}")
    if m.group(1) and m.group(1) not in _LOOPBACK and not allow_remote:
        raise ValueError(
            f"{name} {value} is not a loopback address; pass allow_remote=True "
            f"(--allow-remote) to serve beyond this machine"
        )


@dataclass(frozen=True)
class NodeLinks:
    """The timing and size rules every process applies to its sockets."""

    heartbeat_s: float = 0.5  # a node reports its load this often
    dead_after_s: float = field(
        default=3.0,
        metadata=flag("--dead-after", "seconds of silence after which a node is taken for dead"),
    )
    max_message_bytes: int = 16 * 2**20  # control and client messages
    # the periodic lines' interval (PDSERVE_LOG_INTERVAL)
    log_interval_s: float = field(default_factory=lambda: read_env().log_interval_s)

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.dead_after_s:
            raise ValueError("need 0 < heartbeat_s < dead_after_s")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be at least 1024")


# The KV transfer backends, best first: each is the module common/transfer/<name>.py.
KV_BACKENDS = ("ipc", "nixl", "tcp", "dist")
KV_TRANSFERS = ("auto", *KV_BACKENDS)  # what --kv-transfer takes
_ALLOW_REMOTE = flag("--allow-remote", "allow non-loopback endpoints")
_NAME = flag("--name", "unique in the cluster (with keys: its key's name)")
_NODE_DRAIN = flag(
    "--drain-timeout",
    "on SIGTERM or a drain: seconds its requests get to move elsewhere or finish before it stops",
)
_NODE_KEYS = flag(
    "--keys",
    "CURVE keys (python -m launch.keys DIR); this node's is DIR/NAME.key_secret",
    metavar="DIR",
)
_KV_VERIFY = flag(
    "--kv-verify",
    "check every handoff's KV end to end: the prefill node sends a checksum of "
    "each block with the commit, the decode node checks the blocks once landed and refuses "
    "(the request moves on) on a mismatch",
)


KV_LAYERWISE = ("auto", "on", "off")  # common/handoff/writes.py
_KV_LAYERWISE = flag(
    "--kv-layerwise",
    "push a prompt's KV layer by layer while its prefill computes the "
    "rest (on a decode node: whether it takes such writes). auto: where the transfer "
    "would take long enough to hide, at the rate measured on that link",
    choices=KV_LAYERWISE,
)


def _check_kv_transfer(value: str) -> None:
    if value not in KV_TRANSFERS:
        raise ValueError(f"kv_transfer must be one of {KV_TRANSFERS}, got {value!r}")


_PREFIX_CACHING = flag(
    "--no-prefix-caching",
    "compute every prompt from scratch (default: reuse cached full "
    "blocks; a decode node keeps finished sequences' blocks for follow-up turns)",
    "--no-enable-prefix-caching",
)


def _check_kv_layerwise(value: str) -> None:
    if value not in KV_LAYERWISE:
        raise ValueError(f"kv_layerwise must be one of {KV_LAYERWISE}, got {value!r}")


@dataclass(frozen=True)
class PrefillConfig:
    worker: WorkerConfig
    frontend_endpoint: str = field(
        metadata=flag("--frontend", "the frontend's node endpoint (we connect)")
    )
    name: str = field(default="prefill-0", metadata=_NAME)
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
            "takes longer (a large model on a CPU), a pass holds fewer tokens, from the measured rate "
            "(at least 256); 0: the token budget alone",
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
    kv_transfer: str = field(
        default="auto",
        metadata=flag(
            "--kv-transfer",
            "auto: the best backend both nodes can use with that decode node: ipc on "
            "this host, else nixl, else tcp",
            choices=KV_TRANSFERS,
        ),
    )
    kv_layerwise: str = field(default="auto", metadata=_KV_LAYERWISE)
    links: NodeLinks = field(default_factory=NodeLinks)
    allow_remote: bool = field(default=False, metadata=_ALLOW_REMOTE)
    keys_dir: str | None = field(default=None, metadata=_NODE_KEYS)
    is_prefix_caching: bool = field(default=True, metadata=_PREFIX_CACHING)
    drain_timeout_s: float = field(default=30.0, metadata=_NODE_DRAIN)
    is_kv_verified: bool = field(default=False, metadata=_KV_VERIFY)

    def __post_init__(self) -> None:
        check_endpoint("frontend_endpoint", self.frontend_endpoint, self.allow_remote)
        _check_kv_transfer(self.kv_transfer)
        _check_kv_layerwise(self.kv_layerwise)
        if self.token_budget < self.worker.block_size:
            raise ValueError(f"token_budget must be >= block_size ({self.worker.block_size})")
        if self.max_batch_prompts < 1 or self.handoff_lease_s <= 0:
            raise ValueError("max_batch_prompts must be >= 1 and handoff_lease_s > 0")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")


@dataclass(frozen=True)
class DecodeConfig:
    worker: WorkerConfig
    frontend_endpoint: str = field(
        metadata=flag("--frontend", "the frontend's node endpoint (we connect)")
    )
    kv_endpoint: str = field(
        metadata=flag("--kv-bind", "where prefill nodes hand KV to this node (we bind)")
    )
    name: str = field(default="decode-0", metadata=_NAME)
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
    kv_transfer: str = field(
        default="auto",
        metadata=flag(
            "--kv-transfer",
            "KV transfer backends offered to prefill nodes (auto: ipc and tcp, and nixl "
            "when the KV link is reachable from other hosts; never dist)",
            choices=KV_TRANSFERS,
        ),
    )
    kv_layerwise: str = field(default="auto", metadata=_KV_LAYERWISE)
    links: NodeLinks = field(default_factory=NodeLinks)
    allow_remote: bool = field(default=False, metadata=_ALLOW_REMOTE)
    keys_dir: str | None = field(default=None, metadata=_NODE_KEYS)
    is_preemptive: bool = field(
        default=True,
        metadata=flag(
            "--no-preemption",
            "reserve every block a request could need (prompt + max_tokens) before it "
            "starts, as a smaller batch that is never preempted (default: admit on what a request needs "
            "now, preempt when full)",
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
            "past it, a preempted request's KV is dropped and recomputed when it resumes (0: always)",
            parse=parse_swap,
            metavar="SIZE",
            default_text="4",
        ),
    )
    drain_timeout_s: float = field(default=30.0, metadata=_NODE_DRAIN)
    is_kv_verified: bool = field(default=False, metadata=_KV_VERIFY)
    is_prefix_caching: bool = field(default=True, metadata=_PREFIX_CACHING)

    @property
    def kv_reachable(self) -> str:
        """The KV endpoint prefill nodes connect to."""
        return self.kv_advertise or self.kv_endpoint

    def __post_init__(self) -> None:
        check_endpoint("frontend_endpoint", self.frontend_endpoint, self.allow_remote)
        check_endpoint("kv_endpoint", self.kv_endpoint, self.allow_remote)
        if self.kv_advertise is not None:
            check_endpoint("kv_advertise", self.kv_advertise, self.allow_remote)
        # NOTE: a wildcard binds every interface but names none: peers told it connect nowhere.
        for name, value in (
            ("kv_advertise", self.kv_advertise),
            ("kv_endpoint", self.kv_endpoint if self.kv_advertise is None else None),
        ):
            if value is not None and endpoint_host(value) in _WILDCARDS:
                raise ValueError(
                    f"{name} {value} is a wildcard address, which no prefill node can "
                    f"connect to: give --kv-advertise tcp://HOST:PORT, an address of this "
                    f"host that prefill nodes reach"
                )
        _check_kv_transfer(self.kv_transfer)
        _check_kv_layerwise(self.kv_layerwise)
        if self.max_queue < 1 or self.reservation_lease_s <= 0:
            raise ValueError("max_queue must be >= 1 and reservation_lease_s > 0")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")


@dataclass(frozen=True)
class FrontendConfig:
    model: str = field(metadata=flag("--model", "model directory (tokenizer and limits)"))
    client_endpoint: str = field(
        metadata=flag("--clients", "endpoint clients connect to (we bind)")
    )
    node_endpoint: str = field(metadata=flag("--nodes", "endpoint nodes connect to (we bind)"))
    default_timeout_s: float = field(
        default=600.0,
        metadata=flag("--default-timeout", "seconds a request with no timeout_s may take"),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=flag(
            "--max-model-len",
            "prompt + max_tokens limit (default: the model's max_position_embeddings)",
            parse=int,
        ),
    )
    links: NodeLinks = field(default_factory=NodeLinks)
    allow_remote: bool = field(
        default=False,
        metadata=flag("--allow-remote", "serve clients, nodes and HTTP beyond this machine"),
    )
    keys_dir: str | None = field(
        default=None,
        metadata=flag(
            "--keys",
            "CURVE keys (python -m launch.keys DIR): nodes must hold one (default: open links)",
            metavar="DIR",
        ),
    )
    is_client_auth: bool = field(
        default=False,
        metadata=flag("--client-keys", "clients too must hold a key (DIR/clients/NAME)"),
    )
    max_requests_per_client: int = field(
        default=4096,
        metadata=flag(
            "--max-requests-per-client",
            "requests in flight per client connection; past it: overloaded",
        ),
    )
    max_kv_tokens_per_client: int = field(
        default=2**24,
        metadata=flag(
            "--max-kv-tokens-per-client",
            "prompt + max_tokens over a client's requests in flight; past it: overloaded",
        ),
    )
    max_queued_tokens: int = field(
        default=32768,
        metadata=flag(
            "--max-queued-tokens",
            "prompt tokens sent to one prefill node and not yet prefilled; the rest "
            "wait here, clients taking turns",
        ),
    )
    hung_after_s: float = field(
        default=30.0,
        metadata=flag(
            "--hung-after", "seconds a node's loop may go without turning before it counts as dead"
        ),
    )
    forget_after_s: float = field(
        default=60.0,
        metadata=flag("--forget-after", "seconds after which a dead node leaves the node list"),
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata=flag("--drain-timeout", "on SIGTERM, seconds running requests get to finish"),
    )
    max_migrations: int = field(
        default=3,
        metadata=flag(
            "--max-migrations",
            "times a request may move to other nodes when its node is lost or "
            "drained, resuming where its stream is (0: it fails with its node)",
        ),
    )
    migration_wait_s: float = field(
        default=30.0,
        metadata=flag(
            "--migration-wait",
            "seconds a moved request waits for a live prefill and decode node before it fails",
        ),
    )
    http_port: int | None = field(
        default=None,
        metadata=flag(
            "--http-port",
            "serve the OpenAI API, /metrics and /health on this port (default: no HTTP)",
            parse=int,
        ),
    )
    metrics_port: int | None = field(
        default=None,
        metadata=flag(
            "--metrics-port",
            "without --http-port: serve /metrics and /health alone on this port",
            parse=int,
        ),
    )
    http_host: str | None = field(
        default=None,
        metadata=flag(
            "--http-host", "HTTP address (default: 127.0.0.1, or 0.0.0.0 with --allow-remote)"
        ),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=flag(
            "--served-model-name",
            "the model name HTTP clients use (default: the model directory's name)",
        ),
    )
    is_json_whitespace: bool = field(
        default=False,
        metadata=flag(
            "--allow-json-whitespace",
            "JSON from a grammar (response_format, guided_json) may hold free "
            "whitespace between tokens (default: compact, as vLLM's disable_any_whitespace, so a weak "
            "model's output still closes)",
        ),
    )
    tool_call_parser: str = field(
        default="qwen3",
        metadata=flag(
            "--tool-call-parser",
            "how tool calls are read out of an answer: qwen3 (<tool_call> blocks; "
            "hermes is the same format) or none (the text is left as it is)",
            choices=("qwen3", "hermes", "none"),
        ),
    )
    is_auto_tool_choice: bool = field(
        default=False,
        metadata=flag(
            "--enable-auto-tool-choice",
            "accepted for vLLM's command lines: tool_choice auto is always served",
        ),
    )
    reasoning_parser: str = field(
        default="",
        metadata=flag(
            "--reasoning-parser",
            "qwen3: a chat answer's <think> ... </think> goes to reasoning_content "
            "(default: it stays in the content)",
            choices=("", "qwen3", "deepseek_r1"),
        ),
    )
    logprobs_mode: str = field(
        default="raw_logprobs",
        metadata=flag(
            "--logprobs-mode",
            "what logprobs report: the model's raw distribution (raw_logprobs, as vLLM's "
            "default) or the one sampled from, after penalties, temperature, top-k and top-p "
            "(processed_logprobs)",
            choices=("raw_logprobs", "processed_logprobs"),
        ),
    )
    disaggregate: str = field(
        default="always",
        metadata=flag(
            "--disaggregate",
            "always: every prompt is prefilled on a prefill node; auto: a prompt is prefilled "
            "on its decode node when the nodes' measured rates say its first tokens come sooner that way and "
            "that node has time to spare (frontend/paths.py); never: on the decode node whenever it can "
            "(a prefill node still serves n > 1, prompt logprobs and grammars)",
            choices=("auto", "always", "never"),
        ),
    )

    def __post_init__(self) -> None:
        if self.http_host is None:  # NOTE: frozen: set once, here
            object.__setattr__(self, "http_host", "0.0.0.0" if self.allow_remote else "127.0.0.1")
        check_model_dir(self.model, needs_tokenizer=True)
        check_endpoint("client_endpoint", self.client_endpoint, self.allow_remote)
        check_endpoint("node_endpoint", self.node_endpoint, self.allow_remote)
        for name in ("http_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 1 <= port <= 65535:
                raise ValueError(f"{name} must be a port number in [1, 65535], got {port}")
        if self.http_port is not None and self.http_port == self.metrics_port:
            raise ValueError(
                "metrics are served on the HTTP port already: give metrics_port only "
                "without http_port"
            )
        if self.http_host not in _LOOPBACK and not self.allow_remote:
            raise ValueError(
                f"http_host {self.http_host} is not a loopback address; pass "
                f"--allow-remote to serve HTTP beyond this machine"
            )
        if self.default_timeout_s <= 0:
            raise ValueError("default_timeout_s must be positive")
        if self.is_client_auth and not self.keys_dir:
            raise ValueError("client keys need a key directory (--keys DIR)")
        if (
            min(self.max_requests_per_client, self.max_kv_tokens_per_client, self.max_queued_tokens)
            < 1
        ):
            raise ValueError("per-client limits and max_queued_tokens must be >= 1")
        if self.hung_after_s <= 0:
            raise ValueError("hung_after_s must be positive")
        if self.forget_after_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("forget_after_s must be positive and drain_timeout_s >= 0")
        if self.max_migrations < 0 or self.migration_wait_s < 0:
            raise ValueError("max_migrations and migration_wait_s must be >= 0")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(
                f"logprobs_mode must be raw_logprobs or processed_logprobs, got {self.logprobs_mode!r}"
            )
