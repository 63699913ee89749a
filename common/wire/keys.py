"""The cluster's CURVE keys: who may join which link, and under which name.

A key directory holds one key pair per member, in ZeroMQ's certificate files:
    DIR/frontend.key, DIR/frontend.key_secret     the frontend (a server to nodes and clients)
    DIR/NAME.key, DIR/NAME.key_secret             each node, by node name (prefill-0, decode-1, ...)
    DIR/clients/NAME.key, ...key_secret           clients, when the client port asks for keys
A node's name is bound to its key: a peer that proves the key of prefill-0 is
prefill-0, and no other peer can be. `python -m launch.keys DIR` makes them.
Files are read at each handshake, so a key added later admits its node at once.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

FRONTEND = "frontend"
CLIENTS = "clients"  # the sub-directory of client keys
DOMAINS = ("nodes", "clients")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_name(name: str) -> str:
    if not _NAME_RE.match(name) or name.endswith((".key", ".key_secret")):
        raise ValueError(f"a key name is letters, digits, '.', '_' and '-', got {name!r}")
    return name


def make_keys(key_dir: str | Path, names: list[str], clients: list[str] = ()) -> list[Path]:
    """Key pairs for the frontend (always) and each name; existing pairs are kept.
    Returns the public key files written."""
    key_dir = Path(key_dir)
    made = []
    for sub, name in [
        (None, FRONTEND),
        *((None, n) for n in names),
        *((CLIENTS, c) for c in clients),
    ]:
        where = key_dir / sub if sub else key_dir
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        if (where / f"{check_name(name)}.key_secret").exists():
            continue
        public, secret = zmq.auth.create_certificates(str(where), name)
        os.chmod(secret, 0o600)
        made.append(Path(public))
    return made


def load_keys(key_dir: str | Path | None, name: str) -> "ClusterKeys | None":
    """The keys a process named `name` holds, or None for open links (no directory)."""
    return ClusterKeys(Path(key_dir), name) if key_dir else None


@dataclass(frozen=True)
class ClusterKeys:
    """What one process holds: the key directory and the name whose secret key it uses
    ("frontend", a node name, or "clients/NAME")."""

    key_dir: Path
    name: str

    def __post_init__(self) -> None:
        if not self._file(self.name, secret=True).is_file():
            raise ValueError(
                f"no secret key for {self.name!r} in {self.key_dir}: make it with "
                f"python -m launch.keys {self.key_dir} --nodes {self.name}"
            )

    def _file(self, name: str, secret: bool = False) -> Path:
        return self.key_dir / f"{name}.key{'_secret' if secret else ''}"

    def own(self) -> tuple[bytes, bytes]:
        public, secret = zmq.auth.load_certificate(str(self._file(self.name, secret=True)))
        return public, secret

    def public(self, name: str) -> bytes:
        """The public key of a named member; ValueError if the directory has none."""
        path = self._file(name)
        if not _NAME_RE.match(name.removeprefix(CLIENTS + "/")) or not path.is_file():
            raise ValueError(f"no public key for {name!r} in {self.key_dir}")
        return zmq.auth.load_certificate(str(path))[0]

    def members(self, domain: str) -> dict[bytes, str]:
        """Public key (z85) -> name, for the peers admitted to a domain: every node
        key for "nodes", every client key for "clients"."""
        where = self.key_dir / CLIENTS if domain == CLIENTS else self.key_dir
        found = {}
        for path in sorted(where.glob("*.key")) if where.is_dir() else []:
            name = path.name.removesuffix(".key")
            if domain == "nodes" and name == FRONTEND:
                continue
            try:
                found[zmq.auth.load_certificate(str(path))[0]] = name
            except (OSError, ValueError):
                continue  # a half-written or foreign file admits no one
        return found
