"""Per-client admission: limits, and round-robin dispatch across clients.

A request is admitted under its client's limits (requests in flight, KV tokens
they may claim), and while the prompt tokens waiting here over all clients stay
under a bound (each client's limits alone let many clients hold unbounded memory
here), or refused at once as overloaded. Admitted requests wait here,
one queue per client, until the nodes have room; then clients take turns, one
request each, so a client with thousands queued delays another's request by at
most one turn of the queue.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable


@dataclass
class ClientLoad:
    waiting: deque = field(default_factory=deque)  # admitted, not yet sent to a node
    items: set = field(default_factory=set)  # waiting + running
    num_kv_tokens: int = 0  # prompt + max_tokens, over those

    @property
    def num_requests(self) -> int:
        return len(self.items)


class Admission:
    def __init__(
        self,
        max_requests: int,
        max_kv_tokens: int,
        max_waiting_tokens: int = 2**62,
        num_tokens_of: Callable[[object], int] = lambda item: 0,
    ):
        """num_tokens_of(item): the prompt tokens a waiting item holds here."""
        self.max_requests = max_requests
        self.max_kv_tokens = max_kv_tokens
        self.max_waiting_tokens = max_waiting_tokens
        self._num_tokens_of = num_tokens_of
        self.clients: OrderedDict[Hashable, ClientLoad] = OrderedDict()  # turn order
        self.num_waiting = 0
        self.num_waiting_tokens = 0  # over the waiting items, every client's
        self.num_refused = 0

    def overload(self, num_tokens: int) -> str | None:
        """Why a request of num_tokens prompt tokens may not wait here now, whoever sends it
        (the frontend's own bound, not a client's), or None. NOTE: with nothing waiting, any
        request may (a bound below one prompt would refuse it forever)."""
        if not self.num_waiting_tokens or (
            self.num_waiting_tokens + num_tokens <= self.max_waiting_tokens
        ):
            return None
        self.num_refused += 1
        return (
            f"overloaded: {self.num_waiting_tokens} prompt tokens wait for the nodes here, and "
            f"this request adds {num_tokens} (the limit: --max-waiting-tokens "
            f"{self.max_waiting_tokens}); retry later"
        )

    def refusal(self, client: Hashable, kv_tokens: int, num_requests: int = 1) -> str | None:
        """Why this client may not add num_requests requests (a request's n choices, each
        counted) of kv_tokens in all now, or None."""
        load = self.clients.get(client) or ClientLoad()
        if load.num_requests + num_requests > self.max_requests:
            adds = f", and this request adds {num_requests}" if num_requests > 1 else ""
            why = (
                f"{load.num_requests} requests in flight{adds} (the limit per client is "
                f"{self.max_requests})"
            )
        elif load.num_kv_tokens + kv_tokens > self.max_kv_tokens:
            why = (
                f"{load.num_kv_tokens} + {kv_tokens} KV tokens claimed (the limit per client is "
                f"{self.max_kv_tokens}; prompt + max_tokens counts)"
            )
        else:
            return None
        self.num_refused += 1
        return f"overloaded: this client has {why}; retry when some finish"

    def add(self, client: Hashable, item, kv_tokens: int, is_waiting: bool = True) -> None:
        """is_waiting=False: it counts against the client's limits, but goes to the nodes
        with another item (one of n choices, sent with the first), not from the line."""
        load = self.clients.setdefault(client, ClientLoad())
        if is_waiting:
            load.waiting.append(item)
            self.num_waiting += 1
            self.num_waiting_tokens += self._num_tokens_of(item)
        load.items.add(item)
        load.num_kv_tokens += kv_tokens

    def peek(self):
        """The item next() would give, left in place; None if none waits."""
        return next((load.waiting[0] for load in self.clients.values() if load.waiting), None)

    def next(self):
        """The next waiting item, taking clients in turn; None if none waits."""
        for client in list(self.clients):
            load = self.clients[client]
            self.clients.move_to_end(client)  # whoever is served goes to the back
            if load.waiting:
                self.num_waiting -= 1
                item = load.waiting.popleft()
                self.num_waiting_tokens -= self._num_tokens_of(item)
                return item
        return None

    def items_of(self, client: Hashable) -> list:
        """Every item of client's, waiting or running."""
        load = self.clients.get(client)
        return list(load.items) if load is not None else []

    def requeue(self, client: Hashable, item) -> None:
        """A running item goes back to the front of its client's line (it moves to
        other nodes); its claim on the client's limits stays as it was."""
        load = self.clients.get(client)
        if load is not None:
            load.waiting.appendleft(item)
            self.num_waiting += 1
            self.num_waiting_tokens += self._num_tokens_of(item)

    def done(self, client: Hashable, item, kv_tokens: int) -> None:
        """The item ended, waiting or running."""
        load = self.clients.get(client)
        if load is None:
            return
        try:
            load.waiting.remove(item)
            self.num_waiting -= 1
            self.num_waiting_tokens -= self._num_tokens_of(item)
        except ValueError:
            pass  # it was running
        load.items.discard(item)
        load.num_kv_tokens -= kv_tokens
        if not load.items:
            del self.clients[client]
