"""`gpumon inject PID` and `gpumon detach PID`: load gpumon's agent into a Python process that was
started without it, and take it out again. (`gpumon attach PID --inject` is core's attach, which
calls gpumon.inject.inject.)"""
from __future__ import annotations

import argparse
import os
import sys

from gpumon.commands.args import pid_arg


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inject", help="load the agent into a running Python process started without gpumon",
        description="Load gpumon's agent into the running Python process PID (sys.remote_exec on "
        "Python 3.14+, gdb on 3.10-3.13) and print its socket path; the program keeps running. "
        "Then: gpumon attach PID. Undo with: gpumon detach PID.")
    p.add_argument("pid", type=pid_arg)
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds allowed for each step: debugger, script run, socket (default 5)")
    # Tests without CUDA: the injected agent serves the simulated source.
    p.add_argument("--source", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_inject)

    p = sub.add_parser(
        "detach", help="stop an agent that was injected with --inject",
        description="Stop the agent that `gpumon attach PID --inject` (or `gpumon inject PID`) "
        "loaded into PID and remove its socket. The program keeps running, its output unchanged.")
    p.add_argument("pid", type=pid_arg)
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds to wait for the agent (default 5)")
    p.set_defaults(func=cmd_detach)


def _err(msg: str) -> None:
    sys.stderr.write(f"gpumon: {msg}\n")
    sys.stderr.flush()


def cmd_inject(args: argparse.Namespace) -> int:
    from gpumon import inject
    from gpumon.commands.args import progress
    try:
        with progress(f"loading the agent into process {args.pid}"):
            path = inject.inject(args.pid, timeout=args.timeout or inject.DEFAULT_TIMEOUT,
                                 source=args.source)
    except inject.InjectError as e:
        _err(str(e))
        return 1
    except inject.InjectInterrupted as e:  # Ctrl-C: what was finished or undone, in one line
        _err(str(e))
        return 130
    sys.stdout.write(f"{path}\n")
    owner = inject._uid_of(args.pid)
    if owner is not None and owner != os.geteuid():  # loaded as its owner (root named it)
        who = inject._user_name(owner)
        _err(f"the agent in process {args.pid} runs as {who} and serves them: view it as that "
             f"user (sudo -u {who} gpumon attach {args.pid}); `gpumon detach {args.pid}` "
             "takes it out")
    elif not path.exists():
        _err(f"the agent is loaded in process {args.pid}, waiting for the program's first CUDA "
             f"call; it serves at {path} then (`gpumon attach {args.pid}` shows it meanwhile)")
    return 0


def cmd_detach(args: argparse.Namespace) -> int:
    from gpumon import inject
    from gpumon.commands.args import progress
    try:
        with progress(f"stopping the agent in process {args.pid}"):
            inject.detach(args.pid, timeout=args.timeout or inject.DEFAULT_TIMEOUT)
    except inject.InjectError as e:
        _err(str(e))
        return 1
    sys.stdout.write(f"detached from process {args.pid}\n")
    return 0


def offer_inject(pid: int, stdin=None, stderr=None) -> bool:
    """`gpumon attach PID` on a terminal, PID without an agent: offer to inject one. True once
    it is loaded (serving, or waiting for the program's first CUDA call: the attach view
    follows it either way); False if declined, not injectable or failed (each said in one
    line), and the view shows NVML's figures."""
    from gpumon import inject
    stdin = stdin or sys.stdin
    stderr = stderr or sys.stderr
    if not (stdin.isatty() and stderr.isatty()):
        return False
    try:
        ver = inject.check_target(pid)
    except inject.InjectError as e:
        if "child processes" in str(e):  # a launcher (torchrun, a shell script): name its ranks
            _err(str(e))
        return False
    owner = inject._uid_of(pid)
    if owner is not None and owner != os.geteuid():
        return False  # another user's (root may attach): its agent would not serve this view
    how = ("sys.remote_exec" if ver >= inject.REMOTE_EXEC_VERSION
           else "gdb (the process pauses for well under a second)")
    stderr.write(f"process {pid} has no gpumon agent. Load one into it now through {how}? "
                 f"It keeps running; `gpumon detach {pid}` takes it out again. [y/N] ")
    stderr.flush()
    try:
        answer = stdin.readline().strip().lower()
    except OSError:
        answer = ""
    except KeyboardInterrupt:  # Ctrl-C at the question quits (130), it is not an answer
        stderr.write("\n")
        raise
    if answer not in ("y", "yes"):
        return False
    from gpumon.commands.args import progress
    try:
        with progress(f"loading the agent into process {pid}"):
            inject.inject(pid)
    except inject.InjectError as e:
        _err(str(e))
        return False
    except inject.InjectInterrupted as e:
        _err(str(e))
        raise SystemExit(130) from None
    return True
