"""One logging setup for every process: timestamped lines on stderr, each carrying the
process's name (a node's --name, "frontend"), so the lines of two nodes of one role
can be told apart in one log."""

from __future__ import annotations

import logging
import re
import sys
import time

from common.base.env import read_env

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ROLES = ("frontend", "prefill", "decode")  # a process's own loggers; the rest are its parts
_name: str | None = None  # this process's name, once set_name has said it
# C0 and C1 controls and the line and paragraph separators: what may break a line
CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def set_name(name: str | None) -> None:
    """The name on every line this process logs from now on: a node's --name, or
    "frontend". Before it is said (or in a test's own process) a line carries its
    logger's role."""
    global _name
    _name = name or None


class _Format(logging.Formatter):
    """`HH:MM:SS.mmm NAME LEVEL message`; NAME is the process's, with the part that
    logged after a slash where that is not the process's role (decode-0/transfer)."""

    def __init__(self, role: str):
        super().__init__("%(asctime)s.%(msecs)03d %(who)s %(levelname)s %(message)s", "%H:%M:%S")
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        who = (
            self.role if _name is None else _name if self.role in ROLES else f"{_name}/{self.role}"
        )
        record.who = f"{who:<9}"
        text = super().format(record)
        # NOTE: a traceback follows its message behind a bar: an exception's text may quote
        # a client's, and no line of it may pass for a log line of its own
        return text.replace("\n", "\n| ") if "\n" in text else text

    def formatMessage(self, record: logging.LogRecord) -> str:
        # NOTE: one line a message (a traceback follows it apart): text a client chose (an
        # id, a field's name, an error that quotes them) may not forge lines of its own
        if CONTROL_CHARS.search(record.message):
            record.message = CONTROL_CHARS.sub(_escape, record.message)
        return super().formatMessage(record)


def _escape(match: re.Match) -> str:
    return match.group().encode("unicode_escape").decode("ascii")


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged, not when the logger
    was made (a process that redirects stderr later still gets its lines)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def get_logger(role: str) -> logging.Logger:
    """A role's logger. Its level is the "pdserve" parent's: PDSERVE_LOG_LEVEL, or
    --log-level once parsed (set_level)."""
    parent = logging.getLogger("pdserve")
    if parent.level == logging.NOTSET:
        level = read_env().log_level
        parent.setLevel(level if level in LEVELS else "INFO")
    logger = logging.getLogger(f"pdserve.{role}")
    if not logger.handlers:
        handler = _Stderr()
        handler.setFormatter(_Format(role))
        logger.addHandler(handler)
        logger.propagate = False
    return logger


def add_log_level_arg(p) -> None:
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LEVELS,
        default=None,
        help="default: PDSERVE_LOG_LEVEL, else INFO",
    )


def set_level(level: str | None) -> None:
    """Every pdserve logger's level (they inherit it from their parent)."""
    if level:
        logging.getLogger("pdserve").setLevel(level)


class IdleQuiet:
    """Whether a periodic line is said: every time while its process works, once more as
    it becomes idle, then not until work comes again, so an idle cluster's log stays
    still (and a process that starts idle says nothing)."""

    def __init__(self) -> None:
        self.was_busy = False

    def says(self, is_busy: bool) -> bool:
        said, self.was_busy = is_busy or self.was_busy, is_busy
        return said


class Throttle:
    """Log lines about input from outside (malformed messages, refused peers) at most
    `limit` per `window_s`; past that, one line says how many were held back. A
    flood of bad messages must not become a flood of log lines."""

    def __init__(self, logger: logging.Logger, limit: int = 20, window_s: float = 10.0):
        self.logger, self.limit, self.window_s = logger, limit, window_s
        self._window_start = 0.0
        self._num_logged = self._num_held = 0

    def log(self, level: int, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._window_start >= self.window_s:
            if self._num_held:
                self.logger.warning(
                    "... and %d more lines like these in %.0fs, not shown",
                    self._num_held,
                    self.window_s,
                )
            self._window_start, self._num_logged, self._num_held = now, 0, 0
        if self._num_logged < self.limit:
            self._num_logged += 1
            self.logger.log(level, msg, *args)
        else:
            self._num_held += 1

    def warning(self, msg: str, *args) -> None:
        self.log(logging.WARNING, msg, *args)

    def info(self, msg: str, *args) -> None:
        self.log(logging.INFO, msg, *args)
