"""The agent's own log. Nothing goes to the program's stdout/stderr unless GPUMON_LOG=stderr.

GPUMON_LOG: a file path, ``stderr``, or unset (then ``<socket dir>/agent.log``, opened only when
the first line is written).

The file is the program's neighbour, never its burden:
- no descriptor is kept open between lines: each line opens the file through a checked
  descriptor of its folder (paths.open_dir, O_NOFOLLOW, O_APPEND) and closes it, so a program
  that closes every fd (os.closerange) and reuses the numbers never gets a line of ours in its
  own files;
- lines are rate-limited (a burst of LOG_BURST, then one every LOG_EVERY_S seconds; what was
  dropped is counted in one "N messages suppressed" line), and each is at most MAX_RECORD bytes;
- the file is bounded: past MAX_LOG_BYTES it is renamed to agent.log.1 (replacing the older
  one) and a new one is begun, so the two never pass ~2 x MAX_LOG_BYTES.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

LOG_BURST = 20
LOG_EVERY_S = 5.0
MAX_RECORD = 8 * 1024
MAX_LOG_BYTES = 1024 * 1024

_logger: logging.Logger | None = None


class _RateLimit(logging.Filter):
    """A token bucket over all the agent's lines: a fault that repeats (an accept that fails at
    the fd limit, a sample that fails every 100 ms) costs a few lines, not megabytes."""

    def __init__(self, burst: int = LOG_BURST, every_s: float = LOG_EVERY_S) -> None:
        super().__init__()
        self.burst, self.every_s = float(burst), float(every_s)
        self.tokens, self.t = float(burst), time.monotonic()
        self.suppressed = 0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.t) / self.every_s)
            self.t = now
            if self.tokens < 1.0:
                self.suppressed += 1
                return False
            self.tokens -= 1.0
            if self.suppressed:
                record.gpumon_suppressed = self.suppressed  # said before this line
                self.suppressed = 0
        return True


class _BoundedFileHandler(logging.Handler):
    """Opens, appends one line and closes, through a checked descriptor of the folder; keeps
    the file under MAX_LOG_BYTES by renaming it to NAME.1. A write that fails (disk full,
    folder removed or unsafe) is dropped: logging's default would print a traceback on the
    program's stderr."""

    def __init__(self, path: str, max_bytes: int = MAX_LOG_BYTES) -> None:
        super().__init__()
        self.dir, self.name = os.path.split(os.path.abspath(path))
        self.max_bytes = max_bytes

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            if len(text) > MAX_RECORD:
                text = text[:MAX_RECORD] + " [...]"
            n = getattr(record, "gpumon_suppressed", 0)
            if n:
                text = (f"{self.formatter.formatTime(record) if self.formatter else ''} "
                        f"gpumon[{record.process}] WARNING {n} messages suppressed (rate limit)"
                        f"\n{text}")
            self._append((text + "\n").encode("utf-8", "replace"))
        except Exception:
            pass

    def _append(self, data: bytes) -> None:
        from gpumon.agent import paths
        dfd = paths.open_dir(self.dir, hint="set GPUMON_LOG to a file in a directory of yours")
        try:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(self.name, flags, 0o600, dir_fd=dfd)
            try:
                if os.fstat(fd).st_size + len(data) > self.max_bytes:
                    os.close(fd)
                    fd = -1
                    os.replace(self.name, self.name + ".1", src_dir_fd=dfd, dst_dir_fd=dfd)
                    fd = os.open(self.name, flags, 0o600, dir_fd=dfd)
                os.write(fd, data)
            finally:
                if fd >= 0:
                    os.close(fd)
        finally:
            os.close(dfd)

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
            handler = _BoundedFileHandler(target)
    except Exception:
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter(
        "%(asctime)s gpumon[%(process)d] %(levelname)s %(message)s"))
    handler.addFilter(_RateLimit())
    log.handlers[:] = [handler]
    _logger = log
    if refused:
        log.warning("%s", refused)
    return log
