"""A client's requests from their arrival to their admission: checked before any work,
tokenized (a long prompt, or one with a grammar, off the loop: prompts.py), then admitted
under the client's limits and started as its n choices (each a RequestState).

A group of requests (an HTTP batch of prompts) is admitted whole or refused whole: its
prompts are tokenized one per turn of the loop (so no turn does more than one prompt's
worth, OFF_LOOP_CHARS at most), then its choices and KV tokens are counted against the
client's limits together, so a refusal leaves nothing of it running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time

from common.base.log import get_logger
from common.base.request import FINISH_ABORT
from common.wire.protocol import GenerateOutput, GenerateRequest
from frontend import router
from frontend.detok import IncrementalDetokenizer
from frontend.prompts import check_size
from frontend.reply_cost import check_reply_logprobs
from frontend.request import ClientKey, RequestState

log = get_logger("frontend")

# NOTE: a group's prompts are tokenized one per loop turn, but every pending group's in each
# turn: a client's groups being tokenized at once are held to this many (a 429 past it).
MAX_GROUPS_PER_CLIENT = 4


class Intake:
    """fe: the Frontend (server.py): its prompts, admission, nodes and replies."""

    def __init__(self, fe):
        self.fe = fe
        self._tasks: set[asyncio.Task] = set()  # groups being tokenized
        # (client, request id) -> its group's task, while the group is tokenized
        self.pending: dict[tuple, asyncio.Task] = {}
        self._aborted: set[tuple] = set()  # of pending: cancelled by their clients
        self.num_groups: dict[ClientKey, int] = {}  # groups of several prompts being tokenized
        self.num_requests = 0  # choices started: the next one's node id
        # NOTE: nodes outlive a frontend that restarts: ids of this life never name a request
        # of an earlier one (still decoding there, or remembered as aborted)
        self.life = secrets.token_hex(3)

    async def submit(self, client: ClientKey, reqs: list[GenerateRequest]) -> None:
        """Take a group of a client's requests (most often one): admitted together, or each
        answered with the error that refused them. One short prompt is tokenized at once;
        otherwise the group is tokenized on a task, and admitted after."""
        fe = self.fe
        for req in reqs:
            refusal = self._refusal(client, req)
            if refusal is not None:
                await self._refuse(client, reqs, *refusal)
                return
        refusal = self._group_refusal(client, reqs)
        if refusal is not None:
            await self._refuse(client, reqs, *refusal)
            return
        if len(reqs) == 1 and not fe.prompts.is_off_loop(reqs[0]):  # the common case
            try:
                prepared = [fe.prompts.now(reqs[0])]
            except Exception as e:  # ValueError: the request's fault; any other: ours (a 500)
                await self._refuse(client, reqs, *_why(e))
                return
            await self._admit(client, reqs, prepared)
            return
        task = asyncio.create_task(self._admit_later(client, reqs))
        for req in reqs:
            self.pending[(client, req.request_id)] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: self._end_unstarted(client, reqs, t))
        if len(reqs) > 1:
            self.num_groups[client] = self.num_groups.get(client, 0) + 1
            task.add_done_callback(lambda _: self._group_done(client))

    def _group_done(self, client: ClientKey) -> None:
        left = self.num_groups.pop(client, 1) - 1
        if left:
            self.num_groups[client] = left

    def _end_unstarted(
        self, client: ClientKey, reqs: list[GenerateRequest], task: asyncio.Task
    ) -> None:
        """NOTE: a task cancelled before its first step never runs its body (a ZeroMQ
        client's abort read in the same turn as its request): its ids would stay taken and
        the client unanswered. Freed here, and an aborted one answered as cancelled."""
        keys = [(client, req.request_id) for req in reqs]
        if not task.cancelled() or not any(self.pending.get(k) is task for k in keys):
            return  # its body ran: it answered and freed them itself
        is_aborted = bool(self._aborted.intersection(keys))
        for key in keys:
            self.pending.pop(key, None)
            self._aborted.discard(key)
        if is_aborted:
            answer = asyncio.get_running_loop().create_task(self._say_cancelled(client, reqs))
            self._tasks.add(answer)
            answer.add_done_callback(self._tasks.discard)

    async def _say_cancelled(self, client: ClientKey, reqs: list[GenerateRequest]) -> None:
        for req in reqs:
            await self.fe.reply(
                client,
                GenerateOutput(
                    req.request_id, [], "", True, FINISH_ABORT, "cancelled by the client", index=-1
                ),
            )

    def is_preparing(self, key: tuple) -> bool:
        """Whether a request of this key is being prepared, by a task other than this one
        (a refusal that names its id must not end it)."""
        task = self.pending.get(key)
        return task is not None and task is not asyncio.current_task()

    def cancel(self, key: tuple) -> bool:
        """A request still being tokenized is dropped with its group (a job of theirs that
        has not started is taken out of its line), each answered as cancelled; False if
        none is."""
        task = self.pending.get(key)
        if task is None:
            return False
        self._aborted.add(key)
        task.cancel()
        return True

    def _refusal(self, client: ClientKey, req: GenerateRequest) -> tuple[str, int] | None:
        """(why, HTTP status) a request is refused before any work, or None."""
        fe = self.fe
        key = (client, req.request_id)
        if not req.request_id:
            return "request_id must be a non-empty string", 400
        if key in fe.by_client or key in self.pending:
            return (
                f"duplicate request_id {req.request_id!r}: your request of that id is still running"
            ), 400
        if fe.is_draining:
            return "the cluster is shutting down", 503
        try:
            check_size(req, fe.prompts.max_chars)
        except ValueError as e:
            return str(e), 400
        rows, limit = router.max_rows(fe.nodes), fe.admission.max_requests
        if rows is not None and req.n > rows:
            # NOTE: the n choices run side by side in one decode node's batch
            return (
                f"'n' is {req.n}, more than the {rows} rows of the largest decode node's batch "
                f"(its --max-batch-size): ask for at most {rows} choices"
            ), 400
        if req.n > limit:
            return (
                f"'n' is {req.n}, more than the {limit} requests a client may have in flight "
                f"(--max-requests-per-client; each choice counts)"
            ), 400
        return None

    def _group_refusal(
        self, client: ClientKey, reqs: list[GenerateRequest]
    ) -> tuple[str, int] | None:
        """(why, HTTP status) a group is refused before any of it is tokenized, or None."""
        num, limit = sum(req.n for req in reqs), self.fe.admission.max_requests
        if num > limit:  # a group's choices, more than a client may run at once
            why = (
                f"these {len(reqs)} prompts ask for {num} choices in all, more than the "
                f"{limit} requests a client may have in flight (--max-requests-per-client)"
            )
            return why, 400
        if len(reqs) > 1 and self.num_groups.get(client, 0) >= MAX_GROUPS_PER_CLIENT:
            return (
                f"{MAX_GROUPS_PER_CLIENT} batches of prompts of yours are still being "
                f"tokenized: send this one when one of them has started"
            ), 429
        return None

    async def _refuse(
        self, client: ClientKey, reqs: list[GenerateRequest], why: str, status: int = 400
    ) -> None:
        fe = self.fe
        for req in reqs:
            await fe.reply_error(client, req.request_id or None, why, status)

    async def _admit_later(self, client: ClientKey, reqs: list[GenerateRequest]) -> None:
        fe = self.fe
        keys = [(client, req.request_id) for req in reqs]
        try:
            outcome = await self._prepare(client, reqs)
        except (asyncio.CancelledError, Exception) as e:  # ValueError: Busy among them (429)
            outcome = e
        is_aborted = bool(self._aborted.intersection(keys))
        for key in keys:
            self.pending.pop(key, None)
            self._aborted.discard(key)
        if isinstance(outcome, asyncio.CancelledError):
            if not is_aborted:
                raise outcome
            await self._say_cancelled(client, reqs)
        elif isinstance(outcome, Exception):
            await self._refuse(client, reqs, *_why(outcome))
        elif fe.is_draining:
            await self._refuse(client, reqs, "the cluster is shutting down", 503)
        else:
            await self._admit(client, reqs, outcome)

    async def _prepare(self, client: ClientKey, reqs: list[GenerateRequest]) -> list[tuple]:
        prepared = []
        for req in reqs:
            if self.fe.prompts.is_off_loop(req):
                prepared.append(await self.fe.prompts.off_loop(client, req))
            else:
                await asyncio.sleep(0)  # NOTE: a group's prompts, one per turn of the loop
                prepared.append(self.fe.prompts.now(req))
        return prepared

    async def _admit(
        self, client: ClientKey, reqs: list[GenerateRequest], prepared: list[tuple]
    ) -> None:
        fe = self.fe
        if router.choose(fe.nodes) is None:
            await self._refuse(
                client, reqs, "no live prefill and decode node pair is available", 503
            )
            return
        try:
            check_reply_logprobs(reqs, [len(ids) for ids, _ in prepared])
        except ValueError as e:
            await self._refuse(client, reqs, str(e))
            return
        num = sum(req.n for req in reqs)
        kv_tokens = sum(
            req.n * (len(ids) + params.max_tokens) for req, (ids, params) in zip(reqs, prepared)
        )
        overload = fe.admission.overload(sum(len(ids) for ids, _ in prepared))
        refusal = overload or fe.admission.refusal(client, kv_tokens, num)
        if refusal:
            await self._refuse(client, reqs, refusal, 503 if overload else 429)
            return
        for req, (ids, params) in zip(reqs, prepared):
            self._start(client, req, ids, params)
        fe.wake_dispatch()

    def _start(self, client: ClientKey, req: GenerateRequest, ids: list[int], params) -> None:
        """An admitted request's n choices, waiting for their turn."""
        fe = self.fe
        timeout = req.timeout_s or fe.cfg.default_timeout_s
        # n choices: n requests, choice i sampled with seed + i (as vLLM does); the others go
        # to the nodes with choice 0, as its forks: one prefill, the prompt's blocks shared.
        choices = []
        fe.by_client[(client, req.request_id)] = choices
        for i in range(req.n):
            self.num_requests += 1
            state = RequestState(
                f"{self.life}-{self.num_requests:x}",
                req.request_id,
                client,
                ids,
                dataclasses.replace(params, seed=(params.seed + i) % 2**63),
                IncrementalDetokenizer(fe.tokenizer, req.stop),
                time.time(),
                time.monotonic() + timeout,
                is_prompt_only=req.max_tokens == 0,
                index=i,
            )
            fe.requests[state.node_id] = state
            choices.append(state)
            fe.admission.add(client, state, state.kv_tokens, is_waiting=i == 0)
            if i:
                choices[0].forks.append(state)


def _why(e: Exception) -> tuple[str, int]:
    """(error, HTTP status) of what preparing a request raised: a ValueError says what is
    wrong with it (or, Busy, that its client is over its share: 429); anything else is a
    fault of the frontend's own, logged, and that request's 500 alone."""
    if isinstance(e, ValueError):
        return str(e), getattr(e, "status", 400)
    log.error("preparing a request failed", exc_info=e)
    return f"internal error while preparing the request ({type(e).__name__})", 500
