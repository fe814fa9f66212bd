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



def progress(text: str):
    """A spinner with the elapsed time on stderr (Rich's Progress, transient), for work that
    takes more than a second in a plain command; nothing when stdout or stderr is not a
    terminal (scripts, pipes, tests), so no output changes. A context manager; it gives a
    function that changes the text while it spins (a no-op where nothing spins)."""
    import contextlib
    if not (sys.stderr.isatty() and sys.stdout.isatty()):
        return contextlib.nullcontext(lambda new_text: None)
    try:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:  # rich comes with textual; an agent-only install may lack it
        return contextlib.nullcontext(lambda new_text: None)

    @contextlib.contextmanager
    def spin():
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=Console(stderr=True), transient=True) as p:
            task = p.add_task(text, total=None)
            yield lambda new_text: p.update(task, description=new_text)
    return spin()
