"""Argument types shared by every command."""
from __future__ import annotations

import sys


def pid_arg(text: str) -> int:
    """argparse type of every PID argument: a positive whole number. Anything else is one line
    on stderr and exit status 2 (argparse's own error would add a usage line, and the
    traceback of a negative pid reaching os.kill or psutil is worse)."""
    try:
        pid = int(text.strip(), 10)
    except ValueError:
        pid = None
    if pid is None or pid <= 0:
        sys.stderr.write(f"gpumon: {text!r} is not a process id: a pid is a positive whole "
                         "number (see `gpumon ls`)\n")
        raise SystemExit(2)
    return pid
