"""The HTTP site's bounds on connections. Each connection holds a file descriptor, and the
frontend's descriptors also carry its ZeroMQ clients, its nodes' links and its grammar
checks: HTTP takes at most a share of them, and a connection that sends nothing is closed
soon (aiohttp's own default keeps it an hour), so idle sockets cannot use them all up."""

from __future__ import annotations

import asyncio
import json
import logging
import resource

from aiohttp import web

from common.base.log import Throttle, get_logger
from frontend.openai_errors import error_body

log = get_logger("http")
noisy = Throttle(log)

# A connection idle this long (or that sends nothing) is closed: longer than clients' own
# pools keep one (5-15 s), so a pool never reuses a connection as it is closed.
IDLE_S = 75.0
FD_SHARE = 2  # HTTP connections hold at most 1/FD_SHARE of the process's descriptors
MAX_FDS = 1 << 20  # the soft limit is raised to the hard one, at most this


def raise_fd_limit() -> int:
    """The soft limit on open files raised to the hard one (a busy frontend holds a
    descriptor a connection); returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_FDS if hard == resource.RLIM_INFINITY else min(hard, MAX_FDS)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open files limit from %d to %d: %s", soft, target, e)
    return MAX_FDS if soft == resource.RLIM_INFINITY else soft


def max_connections(fd_limit: int) -> int:
    return max(fd_limit // FD_SHARE, 16)


class CappedSite(web.BaseSite):
    """A TCP site that holds at most max_connections at once: past that, a connection is
    answered 503 and closed as it comes, before any of it is read."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, max_connections: int):
        super().__init__(runner)
        self._host, self._port = host, port
        self.max_connections = max_connections
        self.num_refused = 0

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        """The port bound (the one asked for, or the one given for 0)."""
        sockets = self._server.sockets if self._server is not None else ()
        return sockets[0].getsockname()[1] if sockets else self._port

    async def start(self) -> None:
        await super().start()
        server = self._runner.server

        def connection() -> asyncio.Protocol:
            # NOTE: counted as they are made; a burst accepted in one turn may pass the cap by
            # the listen backlog's length at most
            if _num_open(server) < self.max_connections:
                return server()
            self.num_refused += 1
            noisy.log(
                logging.WARNING,
                "refused an HTTP connection: %d are open, the most this frontend holds "
                "(half its open files limit)",
                self.max_connections,
            )
            return _Refused()

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            connection,
            self._host,
            self._port,
            backlog=128,  # TCPSite's, as reuse_address
            reuse_address=True,
        )


def _num_open(server) -> int:
    """Connections the server holds. NOTE: Server.connections copies its dict into a list,
    a cost in the connections open at each accept: its dict is counted where it has one."""
    connections = getattr(server, "_connections", None)
    return len(connections) if isinstance(connections, dict) else len(server.connections)


_REFUSAL = json.dumps(
    error_body(503, "too many HTTP connections are open: try again later")
).encode()


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(_REFUSAL)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        transport.write(head.encode() + _REFUSAL)
        transport.close()
