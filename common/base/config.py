"""One frozen config per role, validated at creation."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16}
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?|npu(:\d+)?)$")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_bytes(text: str | int | None) -> int | None:
    """'512MiB', '2GiB', '1000000' -> bytes."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a size from {text!r}; say e.g. 512MiB or 2GiB")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(unit or " "))


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def check_model_dir(path: str, needs_tokenizer: bool = False) -> None:
    """A local Hugging Face model directory, or a ValueError a user can act on."""
    d = Path(path)
    if not d.exists():
        if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not path.startswith((".", "/")):
            raise ValueError(f"'{path}' looks like a model id, and there is no such directory here: "
                             f"pdserve loads models from local directories and downloads nothing; "
                             f"give --model the directory holding config.json and the weights")
        raise ValueError(f"no model directory at {path}: give --model a directory holding "
                         f"config.json and the weights")
    if not (d / "config.json").is_file():
        raise ValueError(f"{path} has no config.json: give --model a Hugging Face model directory")
    if needs_tokenizer and not any((d / f).is_file() for f in ("tokenizer.json", "vocab.json",
                                                               "tokenizer.model")):
        raise ValueError(f"{path} has no tokenizer files (tokenizer.json, or vocab.json and "
                         f"merges.txt): the frontend tokenizes prompts with the model's tokenizer; "
                         f"copy them into the directory")


@dataclass(frozen=True)
class WorkerConfig:
    model: str | None = None          # a Hugging Face model directory ...
    shape: str | None = None          # ... or a preset shape with random weights
    device: str = "cpu"
    dtype: str | None = None          # default: float32 on cpu, bfloat16 elsewhere
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; default: kv_cache_fraction of free memory
    kv_cache_fraction: float = 0.85   # of free accelerator memory after the weights
    cpu_kv_cache_memory: int = 256 * 2**20  # the CPU default budget
    max_batch_size: int = 64          # decode rows held on the device
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    use_graphs: bool = True           # CUDA graphs for decode steps where available
    is_cache_in_shm: bool = False     # CPU: the cache lives in a shared-memory segment (ipc KV transfer)
    seed: int = 0                     # random weights

    def __post_init__(self) -> None:
        if (self.model is None) == (self.shape is None):
            raise ValueError("give exactly one of model (a directory) or shape (a preset)")
        if self.model is not None:
            check_model_dir(self.model)
        if not _DEVICE_RE.match(self.device):
            raise ValueError(f"device must be cpu, cuda[:N] or npu[:N], got {self.device!r}")
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
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is None:
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        return DTYPES[self.dtype]


def clamp_model_len(requested: int | None, max_position_embeddings: int) -> int:
    """The longest sequence a node serves: what was asked for, never past the model's positions."""
    return min(requested or max_position_embeddings, max_position_embeddings)


def endpoint_host(value: str) -> str:
    """The host of tcp://HOST:PORT (127.0.0.1 for ipc:// and inproc://)."""
    m = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:(\d+)", value)
    return m.group(1) if m else "127.0.0.1"


def check_endpoint(name: str, value: str, allow_remote: bool) -> None:
    m = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:(\d+)|ipc://.+|inproc://.+", value)
    if not m:
        raise ValueError(f"{name} must be tcp://HOST:PORT or ipc://PATH, got {value!r}")
    if m.group(1) and m.group(1) not in _LOOPBACK and not allow_remote:
        raise ValueError(f"{name} {value} is not a loopback address; pass allow_remote=True "
                         f"(--allow-remote) to serve beyond this machine")


@dataclass(frozen=True)
class NodeLinks:
    """The timing and size rules every process applies to its sockets."""
    heartbeat_s: float = 0.5           # a node reports its load this often
    dead_after_s: float = 3.0          # silence after which a peer is taken for dead
    max_message_bytes: int = 16 * 2**20  # control and client messages
    log_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.dead_after_s:
            raise ValueError("need 0 < heartbeat_s < dead_after_s")
        if self.max_message_bytes < 1024:
            raise ValueError("max_message_bytes must be at least 1024")


KV_TRANSFERS = ("auto", "ipc", "tcp", "dist")   # see common/transfer; auto: ipc, else tcp


def _check_kv_transfer(value: str) -> None:
    if value not in KV_TRANSFERS:
        raise ValueError(f"kv_transfer must be one of {KV_TRANSFERS}, got {value!r}")


@dataclass(frozen=True)
class PrefillConfig:
    worker: WorkerConfig
    frontend_endpoint: str            # the frontend's node endpoint (we connect)
    name: str = "prefill-0"
    token_budget: int = 8192          # prompt tokens per forward pass
    max_batch_prompts: int = 64
    handoff_lease_s: float = 10.0     # a handoff not committed this long after its prefill, or
                                      # a reservation request unanswered this long, fails
    kv_transfer: str = "auto"         # auto: ipc with a decode node on this host, else tcp
    links: NodeLinks = field(default_factory=NodeLinks)
    allow_remote: bool = False
    keys_dir: str | None = None       # CURVE keys (launch/keys.py), this node's under its name
    is_prefix_caching: bool = True    # reuse full prompt blocks computed before (common/prefix.py)

    def __post_init__(self) -> None:
        check_endpoint("frontend_endpoint", self.frontend_endpoint, self.allow_remote)
        _check_kv_transfer(self.kv_transfer)
        if self.token_budget < self.worker.block_size:
            raise ValueError(f"token_budget must be >= block_size ({self.worker.block_size})")
        if self.max_batch_prompts < 1 or self.handoff_lease_s <= 0:
            raise ValueError("max_batch_prompts must be >= 1 and handoff_lease_s > 0")


@dataclass(frozen=True)
class DecodeConfig:
    worker: WorkerConfig
    frontend_endpoint: str            # the frontend's node endpoint (we connect)
    kv_endpoint: str                  # where prefill nodes hand KV to us (we bind)
    name: str = "decode-0"
    max_queue: int = 256              # reservations held (writing or waiting for a batch row)
    reservation_lease_s: float = 30.0  # a reservation not committed within this is freed
    kv_transfer: str = "auto"         # what prefill nodes may use: auto offers ipc and tcp
    links: NodeLinks = field(default_factory=NodeLinks)
    allow_remote: bool = False
    keys_dir: str | None = None       # CURVE keys (launch/keys.py), this node's under its name
    is_preemptive: bool = True        # admit on what a request needs now; preempt when full
    swap_space: int = 4 * 2**30       # bytes of host memory for preempted KV; past it: recompute

    def __post_init__(self) -> None:
        check_endpoint("frontend_endpoint", self.frontend_endpoint, self.allow_remote)
        check_endpoint("kv_endpoint", self.kv_endpoint, self.allow_remote)
        _check_kv_transfer(self.kv_transfer)
        if self.max_queue < 1 or self.reservation_lease_s <= 0:
            raise ValueError("max_queue must be >= 1 and reservation_lease_s > 0")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")


@dataclass(frozen=True)
class FrontendConfig:
    model: str                        # for the tokenizer and the model's limits
    client_endpoint: str              # clients connect here (we bind)
    node_endpoint: str                # nodes connect here (we bind)
    default_timeout_s: float = 600.0  # a request with no timeout_s ends after this
    max_model_len: int | None = None
    links: NodeLinks = field(default_factory=NodeLinks)
    allow_remote: bool = False
    keys_dir: str | None = None       # CURVE keys (launch/keys.py); None: open links
    is_client_auth: bool = False      # clients too must hold a key from keys_dir/clients
    max_requests_per_client: int = 4096   # in flight (waiting + running) per client connection
    max_kv_tokens_per_client: int = 2**24  # prompt + max_tokens over its requests in flight
    max_queued_tokens: int = 32768    # prompt tokens sent to one prefill node, not yet prefilled
    hung_after_s: float = 30.0        # a node whose loop has not turned this long is dead
    forget_after_s: float = 60.0      # a dead node is dropped from the node list after this
    drain_timeout_s: float = 30.0     # on SIGTERM, running requests get this long to finish
    http_port: int | None = None      # OpenAI API, /metrics and /health; None: no HTTP
    metrics_port: int | None = None   # /metrics and /health alone, when http_port is None
    http_host: str = "127.0.0.1"
    served_model_name: str | None = None  # the model name HTTP clients use; default: the directory's

    def __post_init__(self) -> None:
        check_model_dir(self.model, needs_tokenizer=True)
        check_endpoint("client_endpoint", self.client_endpoint, self.allow_remote)
        check_endpoint("node_endpoint", self.node_endpoint, self.allow_remote)
        for name in ("http_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 1 <= port <= 65535:
                raise ValueError(f"{name} must be a port number in [1, 65535], got {port}")
        if self.http_port is not None and self.http_port == self.metrics_port:
            raise ValueError("metrics are served on the HTTP port already: give metrics_port only "
                             "without http_port")
        if self.http_host not in _LOOPBACK and not self.allow_remote:
            raise ValueError(f"http_host {self.http_host} is not a loopback address; pass "
                             f"--allow-remote to serve HTTP beyond this machine")
        if self.default_timeout_s <= 0:
            raise ValueError("default_timeout_s must be positive")
        if self.is_client_auth and not self.keys_dir:
            raise ValueError("client keys need a key directory (--keys DIR)")
        if min(self.max_requests_per_client, self.max_kv_tokens_per_client, self.max_queued_tokens) < 1:
            raise ValueError("per-client limits and max_queued_tokens must be >= 1")
        if self.hung_after_s <= 0:
            raise ValueError("hung_after_s must be positive")
        if self.forget_after_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("forget_after_s must be positive and drain_timeout_s >= 0")
