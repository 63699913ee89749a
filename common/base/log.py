"""One logging setup for every process: role-tagged, timestamped lines on stderr."""
from __future__ import annotations

import logging
import sys
import time

from common.base.env import read_env


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


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
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s.%(msecs)03d {role:<8} %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    return logger


def add_log_level_arg(p) -> None:
    p.add_argument("--log-level", type=str.upper, choices=LEVELS, default=None,
                   help="default: PDSERVE_LOG_LEVEL, else INFO")


def set_level(level: str | None) -> None:
    """Every pdserve logger's level (they inherit it from their parent)."""
    if level:
        logging.getLogger("pdserve").setLevel(level)


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
                self.logger.warning("... and %d more lines like these in %.0fs, not shown",
                                    self._num_held, self.window_s)
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
