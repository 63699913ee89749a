"""One logging setup for every process: role-tagged, timestamped lines on stderr."""
from __future__ import annotations

import logging
import sys

from common.env import read_env


def get_logger(role: str) -> logging.Logger:
    logger = logging.getLogger(f"pdserve.{role}")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s.%(msecs)03d {role:<8} %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(read_env().log_level)
        logger.propagate = False
    return logger
