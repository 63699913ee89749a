"""dist's pieces both halves use: the announcement's header, and the pair's process
group with the thread that joins it and runs its sends or receives in order (the
backend is common/transfer/dist.py)."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Callable

import torch
import torch.distributed as dist

from common.base.log import get_logger
from common.engine.platform import platform_type
from common.wire.limits import Name, Range

log = get_logger("transfer")
JOIN_TIMEOUT = timedelta(seconds=30)


@dataclass
class DistHeader:
    """The request's blocks follow as one send on the pair's process group `group` under `tag`."""

    group: Name
    tag: Annotated[int, Range(0, 2**31 - 1)]
    is_int8: bool = False  # the send is [.., D + 4] int8 rows: values and their scales


def pair_group(store: dist.Store, name: str, rank: int, device: torch.device):
    """The pair's group, of the kind the device's platform says (gloo, nccl, hccl)."""
    return platform_type(device).process_group(
        dist.PrefixStore(f"pdserve/{name}", store), rank, 2, JOIN_TIMEOUT
    )


class Pipe:
    """A process group of two and a thread that joins it (joining blocks until the
    peer joins), then runs each queued operation to completion in order.

    NOTE: gloo marks a send or receive complete only in wait(), so waiting happens
    here, off the node loop; FIFO order on both sides pairs each send with its
    receive. An operation whose peer never comes blocks the thread until the
    group's timeout; the pipe is then broken (error) and is replaced, never reused."""

    def __init__(self, make: Callable[[], object], what: str):
        self.error: str | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(make, what), daemon=True, name="kv-dist"
        )
        self._thread.start()

    def put(self, op) -> None:
        """op.run(pg) -> Work; op.done(error) is called once it has completed or failed."""
        self._queue.put(op)

    def _run(self, make, what: str) -> None:
        try:
            pg = make()
        except Exception as e:  # what it was given fails below
            self.error = f"joining the KV process group {what} failed: {e}"
            log.error("%s", self.error)
            pg = None
        while (op := self._queue.get()) is not None:
            if self.error:
                op.done(self.error)
                continue
            try:
                op.run(pg).wait()
                op.done(None)
            except Exception as e:
                self.error = f"the KV process group {what} failed: {e}"
                log.error("%s", self.error)
                op.done(self.error)

    def close(self) -> None:
        self._queue.put(None)
