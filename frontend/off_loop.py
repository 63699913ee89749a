"""Work that may not run on the frontend's loop (tokenizing a long prompt or a batch,
checking a grammar: prompts.py), on one thread at the lowest priority, clients taking turns.

One thread does it all, so one client's ten thousand grammars (each up to half a second of
compiling) would hold everyone's structured outputs behind them. Here each client's jobs
wait in a line of their own, at most max_per_client of them (one more is refused at once,
a 429 saying why), and the thread takes the lines in turn, one job each: another client's
job waits for at most one job of each client ahead of it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from concurrent.futures import Executor
from typing import Callable, Hashable

MAX_PER_CLIENT = 64  # jobs of one client waiting or running


class Busy(ValueError):
    """A client's share of the off-loop work is full: answered as overloaded (HTTP 429)."""

    status = 429


class OffLoop:
    def __init__(self, executor: Executor, max_per_client: int = MAX_PER_CLIENT):
        self.executor, self.max_per_client = executor, max_per_client
        # client -> its jobs waiting, the clients in the order of their turns
        self._lines: OrderedDict[Hashable, deque] = OrderedDict()
        self._counts: dict[Hashable, int] = {}  # client -> its jobs waiting or running
        self._is_running = False
        self._last: Hashable | None = None  # whose job started last
        self.num_refused = 0

    async def run(self, client: Hashable, fn: Callable, *args, wait_for=None):
        """fn(*args) on the thread, in client's turn; Busy if client's share is full. A
        caller cancelled while its job waits takes the job out of the line. wait_for: an
        async callable awaited first, on the loop, the job counted in client's share
        meanwhile (what it needs before it may take the thread: the grammar checker's start)."""
        count = self._counts.get(client, 0)
        if count >= self.max_per_client:
            self.num_refused += 1
            raise Busy(
                f"overloaded: this client has {count} requests waiting to be tokenized "
                f"or to have their grammar checked (the limit per client is "
                f"{self.max_per_client}); retry when some finish"
            )
        self._counts[client] = count + 1
        if wait_for is not None:
            try:
                await wait_for()
            except BaseException:
                self._release(client)
                raise
        job = (asyncio.get_running_loop().create_future(), fn, args)
        if client not in self._lines:
            self._lines[client] = deque()
            if self._last in self._lines and self._last != client:
                self._lines.move_to_end(self._last)  # served last: it goes after the newcomer
        self._lines[client].append(job)
        self._next()
        try:
            return await job[0]
        except asyncio.CancelledError:
            line = self._lines.get(client)
            if line is not None and job in line:  # not started: it never will be
                line.remove(job)
                if not line:
                    del self._lines[client]
                self._release(client)
            raise

    def _next(self) -> None:
        """Start the next client's next job, if the thread is free."""
        while not self._is_running and self._lines:
            client, line = next(iter(self._lines.items()))
            future, fn, args = line.popleft()
            self._last = client
            if line:
                self._lines.move_to_end(client)  # its next job after every other client's
            else:
                del self._lines[client]
            try:
                done = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
            except RuntimeError as e:  # the executor is shut down: the frontend is stopping
                self._release(client)
                if not future.done():
                    future.set_exception(Busy(f"the frontend is stopping ({e})"))
                continue
            self._is_running = True
            done.add_done_callback(lambda d, c=client, f=future: self._done(c, f, d))

    def _done(self, client: Hashable, future: asyncio.Future, done: asyncio.Future) -> None:
        self._is_running = False
        self._release(client)
        if not future.done():  # NOTE: its caller may have left (cancelled) meanwhile
            if done.cancelled():
                future.cancel()
            elif done.exception() is not None:
                future.set_exception(done.exception())
            else:
                future.set_result(done.result())
        self._next()

    def _release(self, client: Hashable) -> None:
        count = self._counts.get(client, 0) - 1
        if count > 0:
            self._counts[client] = count
        else:
            self._counts.pop(client, None)
