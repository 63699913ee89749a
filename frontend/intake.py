"""A client's request from its arrival to its admission: checked, tokenized (a long
prompt off the loop: prompts.py), then admitted under its client's limits and started
(server.py's Frontend.start makes its n choices)."""
from __future__ import annotations

import asyncio

from common.base.request import FINISH_ABORT
from common.wire.protocol import ErrorReply, GenerateOutput, GenerateRequest
from frontend import router
from frontend.request import ClientKey


class Intake:
    """fe: the Frontend (server.py): its prompts, admission, nodes and replies."""

    def __init__(self, fe):
        self.fe = fe
        self._tasks: set[asyncio.Task] = set()   # requests whose long prompts are tokenized
        self.pending: dict[tuple, asyncio.Task] = {}   # (client, request id) -> its task meanwhile
        self._aborted: set[tuple] = set()   # of pending: cancelled by their clients

    async def submit(self, client: ClientKey, req: GenerateRequest) -> None:
        """Take a request from a client: admitted, or answered with an error. A long
        prompt is tokenized off the loop (frontend/prompts.py), and admitted after."""
        fe = self.fe
        key = (client, req.request_id)
        if not req.request_id:
            await fe.reply_error(client, None, "request_id must be a non-empty string")
        elif key in fe.by_client or key in self.pending:
            await fe.reply(client, ErrorReply(f"duplicate request_id {req.request_id!r}: your "
                                              f"request of that id is still running", req.request_id),
                           400)
        elif fe.is_draining:
            await fe.reply_error(client, req.request_id, "the cluster is shutting down", 503)
        elif (why := self.too_costly(req)) is not None:
            await fe.reply_error(client, req.request_id, why)
        elif fe.prompts.is_off_loop(req):
            task = self.pending[key] = asyncio.create_task(self._admit_later(key, req))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            try:
                ids, params = fe.prompts.now(req)
            except ValueError as e:
                await fe.reply_error(client, req.request_id, str(e))
                return
            await self._admit(client, req, ids, params)

    def cancel(self, key: tuple) -> bool:
        """A request still being tokenized is dropped (its job taken out of the line if it
        has not started) and answered as cancelled; False if none is."""
        task = self.pending.get(key)
        if task is None:
            return False
        self._aborted.add(key)
        task.cancel()
        return True

    def too_costly(self, req: GenerateRequest) -> str | None:
        """Why a request can never be served, known before any work (a 400), or None."""
        rows, limit = router.max_rows(self.fe.nodes), self.fe.admission.max_requests
        if rows is not None and req.n > rows:
            # NOTE: the n choices run side by side in one decode node's batch
            return (f"'n' is {req.n}, more than the {rows} rows of the largest decode node's batch "
                    f"(its --max-batch-size): ask for at most {rows} choices")
        if req.n > limit:
            return (f"'n' is {req.n}, more than the {limit} requests a client may have in flight "
                    f"(--max-requests-per-client; each choice counts)")
        return None

    async def _admit_later(self, key: tuple, req: GenerateRequest) -> None:
        fe, client = self.fe, key[0]
        try:
            prepared = await fe.prompts.off_loop(client, req)
        except asyncio.CancelledError:
            if key not in self._aborted:
                raise
            await fe.reply(client, GenerateOutput(req.request_id, [], "", True, FINISH_ABORT,
                                                  "cancelled by the client", index=-1))
            return
        except ValueError as e:   # Busy: the client's share of the thread is full (429)
            await fe.reply_error(client, req.request_id, str(e), getattr(e, "status", 400))
            return
        finally:
            self.pending.pop(key, None)
            self._aborted.discard(key)
        if fe.is_draining:
            await fe.reply_error(client, req.request_id, "the cluster is shutting down", 503)
        else:
            await self._admit(client, req, *prepared)

    async def _admit(self, client: ClientKey, req: GenerateRequest, ids: list[int], params) -> None:
        fe = self.fe
        if router.choose(fe.nodes) is None:
            await fe.reply_error(client, req.request_id,
                                 "no live prefill and decode node pair is available", 503)
            return
        refusal = fe.admission.refusal(client, req.n * (len(ids) + params.max_tokens), req.n)
        if refusal:
            await fe.reply_error(client, req.request_id, refusal, 429)
            return
        fe.start(client, req, ids, params)
