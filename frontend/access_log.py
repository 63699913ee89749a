"""The HTTP access log: one line per request as it ends (a stream: once it is done),
as uvicorn's: the client, the request line, the status and the time it took. On by
default; --no-access-log (or a log level above INFO) turns it off."""

from __future__ import annotations

import logging

from aiohttp.abc import AbstractAccessLogger

from common.base.log import get_logger

log = get_logger("access")
MAX_PATH_CHARS = 200


def _printable(text: str) -> str:
    """A path as a client sent it, cut short and with nothing that could fake a log line."""
    cut = text[:MAX_PATH_CHARS] + ("..." if len(text) > MAX_PATH_CHARS else "")
    return "".join(c if c.isprintable() else "?" for c in cut)


class AccessLog(AbstractAccessLogger):
    """aiohttp's access_log_class; its logger is `log`."""

    def log(self, request, response, time: float) -> None:
        self.logger.info(
            '%s "%s %s HTTP/%d.%d" %d %.1f ms',
            request.remote or "-",
            request.method,
            _printable(request.raw_path),
            *request.version,
            response.status,
            time * 1e3,
        )

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


def set_access_log(is_on: bool) -> None:
    """--access-log / --no-access-log: off, only warnings and errors pass."""
    log.setLevel(logging.NOTSET if is_on else logging.WARNING)


def runner_args() -> dict:
    """The access log's arguments to web.AppRunner."""
    return {"access_log_class": AccessLog, "access_log": log}
