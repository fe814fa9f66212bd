"""Argument types and waits shared by every command."""
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


def wait_while_only_waiting(target, line: str, spinning: str, timeout: float | None) -> None:
    """Agents loaded but waiting for the program's first CUDA call (a model still building on
    the CPU): ``line`` once on stderr, then wait (a spinner saying ``spinning``) until one
    serves, none waits any more, or ``timeout`` passes. Returns at once when nothing waits or
    something already serves."""
    from gpumon import client

    def waiting(ms: dict) -> list:
        return [m for m in ms.values() if m.state == client.WAITING]

    def serving_or_none_waiting(ms: dict) -> bool:
        return any(m.serving for m in ms.values()) or not waiting(ms)

    ms = target.members()
    if serving_or_none_waiting(ms):
        return
    pids = ", ".join(str(m.pid) for m in waiting(ms))
    print(line.format(pids=pids), file=sys.stderr, flush=True)
    poll, target.poll_s = target.poll_s, min(target.poll_s, 0.05)  # see it serve at once
    try:
        with progress(spinning.format(pids=pids)):
            target.wait(serving_or_none_waiting, timeout)
    finally:
        target.poll_s = poll


def no_agent_line(target, pid: int) -> str:
    """What the target's processes are, when none has a serving agent: the first member's own
    line (waiting for CUDA, not Python, no agent, ...), else that pid and its children have
    no agent."""
    from gpumon import client
    why = [m.line for m in target.members().values()
           if m.state not in (client.LAUNCHER, client.HELPER)]
    return why[0] if why else (f"no gpumon agent in process {pid} or its children: start the "
                               "program with `gpumon run -- ...`, GPUMON=1 or gpumon.start()")
