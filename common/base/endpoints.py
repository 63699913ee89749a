"""Every process's sockets: the endpoints they bind or connect to, and the timing and size
rules they all apply (NodeLinks)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from common.base.env import read_env
from common.base.flags import flag

LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("0.0.0.0", "::", "*")


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def endpoint_host(value: str) -> str:
    """The host of tcp://HOST:PORT (127.0.0.1 for ipc:// and inproc://)."""
    m = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:(\d+)", value)
    return m.group(1) if m else "127.0.0.1"


def is_loopback_endpoint(value: str) -> bool:
    """Only this machine can connect (tcp on a loopback address, ipc, inproc)."""
    return endpoint_host(value) in LOOPBACK


def check_endpoint(name: str, value: str, allow_remote: bool) -> None:
    m = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:(\d+)|ipc://.+|inproc://.+", value)
    if not m:
        raise ValueError(f"{name} must be tcp://HOST:PORT or ipc://PATH, got {value!r}")
    if m.group(1) and m.group(1) not in LOOPBACK and not allow_remote:
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
