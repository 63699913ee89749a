"""The frontend's watchdog: every tick it notes a loop held up (and excuses the nodes'
silence over that time), checks the nodes' heartbeats, and ends or moves the requests
that wait too long: past their deadline, moved and not yet routed again, or waiting
for the prompt's logprobs that never came."""

from __future__ import annotations

import asyncio
import time

from common.base.log import get_logger
from common.base.request import FINISH_ABORT

log = get_logger("frontend")

WATCHDOG_S = 0.1  # the watchdog's tick
STALL_S = 0.2  # a tick later than this by: the loop was held up
PROMPT_LOGPROBS_WAIT_S = 10.0  # a choice's updates wait this long for the prompt's logprobs


async def watchdog_loop(fe) -> None:
    """fe: the Frontend (its registry, requests, migrations and admission)."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(WATCHDOG_S)
        now = time.monotonic()
        # NOTE: a tick this late means the loop itself was held up, and with it the node
        # loop that reads heartbeats: that time is not nodes' silence.
        if now - last > WATCHDOG_S + STALL_S:
            log.warning(
                "the frontend's loop was held up for %.2fs, and every stream with it: "
                "if this recurs, give the frontend a core of its own (its --cpus) or "
                "run fewer nodes on this host",
                now - last - WATCHDOG_S,
            )
            fe.registry.excuse(now - last - WATCHDOG_S)
        last = now
        await fe.registry.check(now)
        for req in list(fe.requests.values()):
            if fe.requests.get(req.node_id) is not req:
                continue  # NOTE: ended or moved by another task while this tick awaited
            if now > req.deadline:
                await fe.finish(req, FINISH_ABORT, "deadline exceeded", status=504)
            elif req.moved_at is not None:  # NOTE: every request, every tick: test first
                await fe.migrations.check_wait(req, now)
            elif req.held_since is not None and now - req.held_since > PROMPT_LOGPROBS_WAIT_S:
                # NOTE: they come once, in one update (with choice 0's): lost on the way,
                # or dropped with a choice that ended or moved first, they never come.
                # Nothing was streamed yet: its prefill runs again, and brings them.
                await fe.migrations.move_or_fail(
                    req,
                    req.prefill_node,
                    "link",
                    f"the prompt's logprobs did not come from prefill node "
                    f"{req.prefill_node} in {PROMPT_LOGPROBS_WAIT_S:.0f}s",
                )
        if fe.admission.num_waiting:
            fe.wake_dispatch()
