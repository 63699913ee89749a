"""The pdserve client: a library (blocking and asyncio); its command line is frontend/cli.py.

    .venv/bin/pdserve client --endpoint tcp://127.0.0.1:5600 --prompt "Hello" [--json]

A request the caller walks away from (a loop broken out of, a cancelled task,
Ctrl-C, a closed client) is aborted on the cluster, which frees its KV blocks.
The first request checks that a frontend answers within connect_timeout_s.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator, Iterator

from common.base.config import check_endpoint
from common.wire.channel import AsyncChannel, BadMessage, Channel, open_async_context, open_context
from common.wire.keys import CLIENTS, load_keys
from common.wire.protocol import FRONTEND_TO_CLIENT as REPLIES
from common.wire.protocol import (
    AbortRequest,
    DrainReply,
    DrainRequest,
    ErrorReply,
    GenerateOutput,
    GenerateRequest,
    StatsReply,
    StatsRequest,
)
from frontend.client_messages import (
    Result,
    StreamEnds,
    as_output,
    check_request_id,
    make_request,
    unbatch,
)


class ServerError(RuntimeError):
    pass


DEFAULT_MAX_TOKENS = GenerateRequest.max_tokens  # the CLI's default is the library's


def _check(endpoint: str) -> None:
    try:
        check_endpoint("endpoint", endpoint, allow_remote=True)
    except ValueError as e:
        raise ValueError(
            f"{e} (the frontend's client endpoint, e.g. tcp://127.0.0.1:5600)"
        ) from None


def _client_keys(keys_dir: str | None, key_name: str | None):
    """A client's CURVE key, for a frontend started with --client-keys."""
    return load_keys(keys_dir, f"{CLIENTS}/{key_name or 'client'}")


def _silent(endpoint: str, timeout_s: float) -> TimeoutError:
    return TimeoutError(
        f"nothing answers at {endpoint} within {timeout_s:g}s: is the cluster "
        f"running there (and, with --client-keys, is this client's key admitted)?"
    )


class Client:
    """Blocking client. Several requests may be in flight; outputs are sorted by request id."""

    def __init__(
        self,
        endpoint: str,
        idle_timeout_s: float = 60.0,
        keys_dir: str | None = None,
        key_name: str | None = None,
        connect_timeout_s: float = 5.0,
    ):
        _check(endpoint)
        self._ctx = open_context(_client_keys(keys_dir, key_name))
        self._ch = Channel(self._ctx, False, endpoint, server="frontend")
        self.endpoint = endpoint
        self.idle_timeout_s = idle_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.is_connected = False
        self._inbox: dict[str, list] = {}  # requests in flight -> outputs not yet read
        self._ends: dict[str, StreamEnds] = {}

    def close(self) -> None:
        """Aborts every request still in flight, then closes the socket."""
        for rid in list(self._inbox):
            self.abort(rid)
        self._ch.close(linger_s=1.0 if self._inbox else 0.0)
        self._inbox.clear()
        self._ctx.term()

    def connect(self) -> None:
        """Check that a frontend answers (a stats round trip), once."""
        if not self.is_connected:
            try:
                self.stats(self.connect_timeout_s)
            except TimeoutError:
                raise _silent(self.endpoint, self.connect_timeout_s) from None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _recv(self, timeout_s: float) -> list:
        """The next reply, as the messages it carries (an OutputBatch holds several)."""
        if not self._ch.has_message(timeout_s):
            raise TimeoutError(f"no reply from the frontend within {timeout_s:.0f}s")
        _, msg = self._ch.recv(REPLIES)
        if isinstance(msg, BadMessage):
            raise ServerError(f"malformed reply: {msg.error}")
        return unbatch(msg)

    def _file(self, msg) -> None:
        """A request's output (or error) into its inbox; the late word on a request this
        client left is dropped."""
        if msg.request_id in self._inbox:
            self._inbox[msg.request_id].append(as_output(msg.request_id, msg))

    def _next_for(self, rid: str) -> GenerateOutput:
        deadline = time.monotonic() + self.idle_timeout_s
        while not self._inbox.get(rid):
            for msg in self._recv(max(deadline - time.monotonic(), 0.001)):
                if isinstance(msg, (StatsReply, DrainReply)):
                    continue  # the late answer to a call that timed out
                if getattr(msg, "request_id", None) is None:
                    raise ServerError(getattr(msg, "error", f"unexpected {type(msg).__name__}"))
                self._file(msg)
        return self._inbox[rid].pop(0)

    def submit(self, req: GenerateRequest) -> str:
        check_request_id(req.request_id)
        self.connect()
        self._inbox.setdefault(req.request_id, [])
        self._ends[req.request_id] = StreamEnds(req.n)
        self._ch.send(req)
        return req.request_id

    def stream(self, rid: str) -> Iterator[GenerateOutput]:
        is_finished = False
        ends = self._ends.pop(rid, StreamEnds(1))
        try:
            while not is_finished:
                out = self._next_for(rid)
                is_finished = ends.see(out)
                yield out
        finally:  # NOTE: also when the caller breaks out or an exception ends its loop
            if self._inbox.pop(rid, None) is not None and not is_finished:
                self.abort(rid)

    def generate(self, prompt=None, **kw) -> Iterator[GenerateOutput]:
        return self.stream(self.submit(make_request(prompt, **kw)))

    def complete(self, prompt=None, **kw) -> Result:
        return self.complete_many([dict(prompt=prompt, **kw)])[0]

    def complete_many(self, requests: list[dict]) -> list[Result]:
        """Send every request at once, then collect each one whole."""
        rids = [self.submit(make_request(**r)) for r in requests]
        results = []
        for rid in rids:
            result = Result(rid)
            for out in self.stream(rid):
                result.add(out)
            results.append(result)
        return results

    def abort(self, request_id: str) -> None:
        self._ch.send(AbortRequest(request_id))

    def _call(self, msg, replies: tuple[type, ...], timeout_s: float):
        """Send msg; the first reply of one of these types that names no request (the
        outputs read meanwhile go to their requests' inboxes)."""
        self._ch.send(msg)
        deadline = time.monotonic() + timeout_s
        while True:
            for m in self._recv(max(deadline - time.monotonic(), 0.001)):
                self.is_connected = True
                if getattr(m, "request_id", None) is not None:
                    self._file(m)
                elif isinstance(m, replies):
                    return m  # NOTE: never batched, so nothing after it is left unread

    def stats(self, timeout_s: float = 5.0) -> StatsReply:
        return self._call(StatsRequest(), (StatsReply,), timeout_s)

    def drain(self, node: str, timeout_s: float = 5.0) -> DrainReply:
        """Drain a node: the frontend routes nothing more to it and moves its requests to
        other nodes; the node stops once empty. ServerError says why it was refused."""
        self.connect()
        reply = self._call(DrainRequest(node), (DrainReply, ErrorReply), timeout_s)
        if isinstance(reply, ErrorReply):
            raise ServerError(reply.error)
        return reply

    def wait_ready(
        self,
        timeout_s: float,
        num_nodes: int = 0,
        frontend_pid: int | None = None,
        names: list[str] | None = None,
    ) -> StatsReply:
        """Until the frontend has a live prefill and decode node, and at least num_nodes
        live nodes in all (a handshake, not a sleep); with names, until those nodes are
        live instead (other hosts' nodes may join later). With frontend_pid, the answer
        must come from that process: another cluster on the same port is not ready."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = self.stats(timeout_s=min(1.0, max(deadline - time.monotonic(), 0.001)))
                num_live = sum(bool(n.get("is_alive")) for n in reply.nodes.values())
                pid = (reply.frontend or {}).get("pid")
                if frontend_pid is not None and pid != frontend_pid:
                    raise ServerError(
                        f"the frontend at this endpoint is pid {pid}, "
                        f"not {frontend_pid}: the port belongs to another cluster"
                    )
                if names is not None:
                    if all(reply.nodes.get(n, {}).get("is_alive") for n in names):
                        return reply
                elif reply.is_ready and num_live >= num_nodes:
                    return reply
            except TimeoutError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster was not ready within {timeout_s:.0f}s")
            time.sleep(0.1)


class AsyncClient:
    """asyncio client: any number of concurrent streams over one socket."""

    def __init__(
        self,
        endpoint: str,
        idle_timeout_s: float = 60.0,
        keys_dir: str | None = None,
        key_name: str | None = None,
        connect_timeout_s: float = 5.0,
    ):
        _check(endpoint)
        self._ctx = open_async_context(_client_keys(keys_dir, key_name))
        self._ch = AsyncChannel(self._ctx, False, endpoint, server="frontend")
        self.endpoint = endpoint
        self.idle_timeout_s = idle_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._connected: asyncio.Future | None = None  # the first stats round trip
        self._streams: dict[str, asyncio.Queue] = {}
        self._stats: asyncio.Queue = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            _, reply = await self._ch.recv(REPLIES)
            for msg in unbatch(reply):
                if isinstance(msg, StatsReply):
                    self._stats.put_nowait(msg)
                elif not isinstance(msg, BadMessage) and msg.request_id in self._streams:
                    self._streams[msg.request_id].put_nowait(as_output(msg.request_id, msg))

    async def close(self) -> None:
        """Aborts every request still in flight, then closes the socket."""
        self._reader.cancel()
        for rid in list(self._streams):
            await self.abort(rid)
        self._ch.close(linger_s=1.0 if self._streams else 0.0)
        self._streams.clear()
        self._ctx.term()

    async def connect(self) -> None:
        """Check that a frontend answers (a stats round trip), once; concurrent callers share it."""
        if self._connected is None:
            self._connected = asyncio.ensure_future(self.stats(self.connect_timeout_s))
        try:
            await asyncio.shield(self._connected)
        except asyncio.TimeoutError:
            self._connected = None
            raise _silent(self.endpoint, self.connect_timeout_s) from None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def generate(self, prompt=None, **kw) -> AsyncIterator[GenerateOutput]:
        req = make_request(prompt, **kw)
        await self.connect()
        queue = asyncio.Queue()
        self._streams[req.request_id] = queue
        is_finished = False
        ends = StreamEnds(req.n)
        try:
            await self._ch.send(req)
            while not is_finished:
                out = await self._next(queue)
                is_finished = ends.see(out)
                yield out
        finally:  # NOTE: also on cancellation, or when the caller leaves its async for
            if self._streams.pop(req.request_id, None) is not None and not is_finished:
                await self.abort(req.request_id)

    async def _next(self, queue: asyncio.Queue) -> GenerateOutput:
        """The stream's next output, or TimeoutError after idle_timeout_s of silence.
        NOTE: not asyncio.wait_for, which (before Python 3.12) can swallow a
        cancellation that arrives as the output does: a cancelled stream would go on."""
        if not queue.empty():
            return queue.get_nowait()
        getter = asyncio.ensure_future(queue.get())
        try:
            done, _ = await asyncio.wait({getter}, timeout=self.idle_timeout_s)
        finally:
            if not getter.done():
                getter.cancel()
        if not done:
            raise TimeoutError(f"no output from the frontend for {self.idle_timeout_s:g}s")
        return getter.result()

    async def complete(self, prompt=None, **kw) -> Result:
        kw.setdefault("request_id", uuid.uuid4().hex)
        result = Result(kw["request_id"])
        async for out in self.generate(prompt, **kw):
            result.add(out)
        return result

    async def abort(self, request_id: str) -> None:
        await self._ch.send(AbortRequest(request_id))

    async def stats(self, timeout_s: float = 5.0) -> StatsReply:
        await self._ch.send(StatsRequest())
        return await asyncio.wait_for(self._stats.get(), timeout_s)
