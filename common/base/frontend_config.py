"""The frontend's config, validated at creation."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.base.endpoints import LOOPBACK, NodeLinks, check_endpoint
from common.base.flags import flag
from common.base.model_dir import check_model_dir

DISAGGREGATE = ("auto", "always", "never")  # what --disaggregate takes (frontend/paths.py)


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
    max_waiting_tokens: int = field(
        default=2**25,
        metadata=flag(
            "--max-waiting-tokens",
            "prompt tokens of the requests waiting here for the nodes, over all clients; "
            "past it: overloaded (a 503)",
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
            "whitespace between tokens (default: compact, as vLLM's disable_any_whitespace, "
            "so a weak model's output still closes)",
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
            "on its decode node when the nodes' measured rates say its first tokens come "
            "sooner that way and that node has time to spare (frontend/paths.py); never: on "
            "the decode node whenever it can (a prefill node still serves n > 1, prompt "
            "logprobs and grammars)",
            choices=DISAGGREGATE,
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
        if self.http_host not in LOOPBACK and not self.allow_remote:
            raise ValueError(
                f"http_host {self.http_host} is not a loopback address; pass "
                f"--allow-remote to serve HTTP beyond this machine"
            )
        if self.default_timeout_s <= 0:
            raise ValueError("default_timeout_s must be positive")
        if self.is_client_auth and not self.keys_dir:
            raise ValueError("client keys need a key directory (--keys DIR)")
        if (
            min(
                self.max_requests_per_client,
                self.max_kv_tokens_per_client,
                self.max_queued_tokens,
                self.max_waiting_tokens,
            )
            < 1
        ):
            raise ValueError(
                "per-client limits, max_queued_tokens and max_waiting_tokens must be >= 1"
            )
        if self.hung_after_s <= 0:
            raise ValueError("hung_after_s must be positive")
        if self.forget_after_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("forget_after_s must be positive and drain_timeout_s >= 0")
        if self.max_migrations < 0 or self.migration_wait_s < 0:
            raise ValueError("max_migrations and migration_wait_s must be >= 0")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(
                "logprobs_mode must be raw_logprobs or processed_logprobs, "
                f"got {self.logprobs_mode!r}"
            )
