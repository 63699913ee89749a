"""A cluster for a benchmark or a soak: launch/start_cluster.sh in a session of its
own, its client endpoint once it is ready, and a drain and stop at the end."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def running_cluster(args: list[str], prog: str) -> Iterator[str | None]:
    """The client endpoint once every node is ready, or None (said on stderr) if the
    cluster did not start; on leaving, SIGTERM to the whole session and a wait."""
    cluster = subprocess.Popen(
        ["bash", str(ROOT / "launch/start_cluster.sh"), *args],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        line = cluster.stdout.readline().decode()
        if not line.startswith("PDSERVE_ENDPOINT="):
            print(f"{prog}: the cluster did not start", file=sys.stderr)
            yield None
        else:
            yield line.strip().split("=", 1)[1]
    finally:
        if cluster.poll() is None:
            os.killpg(cluster.pid, signal.SIGTERM)
            cluster.wait(60)
