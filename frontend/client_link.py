"""Replies to ZeroMQ clients, and what becomes of a client that cannot take them.

A client that exits without aborting its requests, or stops reading its replies, is
noticed at its next reply: the client socket refuses a message for a connection that is
gone, or for one that left MAX_QUEUED messages unread (never waited on: a wait for one
client would hold every other). Then each request of that client is aborted on its nodes,
freeing their blocks, rather than decoded for no one or piled up in the frontend's memory.
NOTE: the bound counts messages, not bytes: a TokenBatch's outputs for one client are one
message: megabytes for thousands of requests asking for logprobs.
"""

from __future__ import annotations

import asyncio

from common.base.log import Throttle, get_logger
from common.base.request import FINISH_ABORT

log = get_logger("frontend")
noisy = Throttle(log)

MAX_QUEUED = 1_000  # replies a client may leave unread, beyond what its own queue holds

WHY = {
    "gone": "its connection is gone",
    "full": f"it left {MAX_QUEUED:,} replies unread",
}


class ClientLink:
    def __init__(self, fe):
        self.fe = fe
        self.num_dropped = 0  # clients whose requests were aborted for this
        self._dropping: set[bytes] = set()  # each with a drop task under way
        self._tasks: set[asyncio.Task] = set()

    async def send(self, client: bytes, msg) -> None:
        """To a ZeroMQ client by its routing id; a client that cannot take it is dropped."""
        why = await self.fe.clients.send(msg, to=client)
        if why is None or client in self._dropping:
            return
        # NOTE: in a task of its own, never here: whoever replied may be walking requests
        # (a lost node's, say) that the drop would end under it. Each finish in the drop
        # replies to client, and that reply is refused too: not a second drop.
        self._dropping.add(client)
        task = asyncio.create_task(self._drop(client, WHY[why]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drop(self, client: bytes, why: str) -> None:
        """Abort every request of client, waiting or running (its nodes free their blocks),
        and drop those still being tokenized."""
        fe = self.fe
        try:
            requests = fe.admission.items_of(client)
            for key in [k for k in fe.intake.pending if k[0] == client]:
                fe.intake.cancel(key)
            if not requests:
                return  # a reply to a stats or drain request, say: nothing to free
            self.num_dropped += 1
            noisy.warning(
                "client %s: %s; its %d requests in flight are aborted",
                client.hex(),
                why,
                len(requests),
            )
            for req in requests:
                await fe.finish(req, FINISH_ABORT, f"the client is unreachable: {why}")
        except Exception:  # one client's drop must not end the frontend's loop
            log.exception("could not drop client %s", client.hex())
        finally:
            self._dropping.discard(client)
