"""Writing a snapshot's files inside the training process: atomically, into a directory that
can be trusted (gpumon/agent/paths.py), each failure as one line for the user. Standard library
only."""
from __future__ import annotations

import errno
import os
import tempfile
from typing import Any, Callable

from gpumon.agent import paths


def _os_error_line(e: OSError, where: str) -> str:
    if isinstance(e, paths.UnsafeDirectory):
        return str(e)
    if e.errno == errno.ENOSPC:
        return f"disk full while writing {where}: free some space or pass another place (-o)"
    if e.errno == errno.EDQUOT:
        return f"disk quota exceeded while writing {where}: pass another place (-o)"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"no permission to write {where}: pass a writable place (-o)"
    if e.errno == errno.EROFS:
        return f"{where} is on a read-only file system: pass a writable place (-o)"
    return f"cannot write {where}: {e.strerror or e}"


def write_atomic(path: str, write: Callable[[Any], None]) -> int:
    """Write a file so that ``path`` is either absent/old or complete: a hidden temp file in
    the same folder, fsync'd, then renamed, all through a checked descriptor of the folder
    (paths.open_dir: a symbolic link planted or flipped there is never followed to someone
    else's folder). Returns the size. Raises OSError (temp file removed)."""
    return paths.write_file(path, write, mode=0o666 & ~_umask(),
                            hint="pass a directory of yours (-o)")


def _umask() -> int:
    """The process's umask, read without setting it: os.umask() can only be read by changing
    it, and for that moment another thread of the program would create files with mode 0."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022  # (kernels before 4.7): the usual one, never a change to the program's


def _check_writable_dir(d: str, private_base: str | None = None) -> None:
    """Create d if needed, check it may be trusted (gpumon/agent/paths.py) and prove a file
    can be made there. private_base: d lies in this folder of gpumon's own (the temp-dir
    fallback), made 0700 and refused if someone else made it. Raises OSError (an
    UnsafeDirectory is one)."""
    if private_base is not None:
        paths.private_dir(private_base, True, "or pass a place of yours (-o)")
        os.makedirs(d, 0o700, exist_ok=True)
    else:
        paths.make_dest_dir(d, "pass a directory of yours (-o)")
    fd, tmp = tempfile.mkstemp(prefix=".gpumon-probe.", dir=d)
    os.close(fd)
    os.unlink(tmp)
