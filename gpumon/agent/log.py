"""The agent's own log. Nothing goes to the program's stdout/stderr unless GPUMON_LOG=stderr.

GPUMON_LOG: a file path, ``stderr``, or unset (then ``<socket dir>/agent.log``, opened only when
the first line is written).
"""
from __future__ import annotations

import logging
import os
import sys

_logger: logging.Logger | None = None


def get_logger() -> logging.Logger:
    global _logger
    if _logger is not None:
        return _logger
    log = logging.getLogger("gpumon.agent")
    log.propagate = False  # never reach the program's root logger or logging.lastResort
    log.setLevel(logging.DEBUG if os.environ.get("GPUMON_DEBUG") else logging.INFO)
    target = os.environ.get("GPUMON_LOG", "")
    try:
        if target == "stderr":
            handler: logging.Handler = logging.StreamHandler(sys.stderr)
        else:
            if not target:
                from gpumon.agent.core import socket_dir
                target = os.path.join(socket_dir(create=True), "agent.log")
            handler = logging.FileHandler(target, delay=True)
    except Exception:
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter(
        "%(asctime)s gpumon[%(process)d] %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    _logger = log
    return log
