"""The agent's own log. Nothing goes to the program's stdout/stderr unless GPUMON_LOG=stderr.

GPUMON_LOG: a file path, ``stderr``, or unset (then ``<socket dir>/agent.log``, opened only when
the first line is written).
"""
from __future__ import annotations

import logging
import os
import sys

_logger: logging.Logger | None = None


class _QuietFileHandler(logging.FileHandler):
    """A log write that fails (disk full, directory removed) is dropped: logging's default
    would print a traceback on the program's stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            super().emit(record)  # opening the file (delay=True) happens here, unguarded
        except Exception:
            pass

    def handleError(self, record: logging.LogRecord) -> None:
        pass


def get_logger() -> logging.Logger:
    global _logger
    if _logger is not None:
        return _logger
    log = logging.getLogger("gpumon.agent")
    log.propagate = False  # never reach the program's root logger or logging.lastResort
    log.setLevel(logging.DEBUG if os.environ.get("GPUMON_DEBUG") else logging.INFO)
    target = os.environ.get("GPUMON_LOG", "")
    refused = None
    try:
        if target == "stderr":
            handler: logging.Handler = logging.StreamHandler(sys.stderr)
        else:
            from gpumon.agent import paths
            if target:
                try:  # a folder others can write or that isn't yours: the default log instead
                    paths.check_dest_dir(os.path.dirname(os.path.abspath(target)),
                                         "set GPUMON_LOG to a file in a directory of yours")
                except paths.UnsafeDirectory as e:
                    target, refused = "", f"GPUMON_LOG not used: {e}"
            if not target:
                target = os.path.join(paths.socket_dir(create=True), "agent.log")
            handler = _QuietFileHandler(target, delay=True)
    except Exception:
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter(
        "%(asctime)s gpumon[%(process)d] %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    _logger = log
    if refused:
        log.warning("%s", refused)
    return log
