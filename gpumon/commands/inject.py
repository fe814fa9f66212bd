"""`gpumon inject PID` and `gpumon detach PID`: load gpumon's agent into a Python process that was
started without it, and take it out again. (`gpumon attach PID --inject` is core's attach, which
calls gpumon.inject.inject.)"""
from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inject", help="load the agent into a running Python process started without gpumon",
        description="Load gpumon's agent into the running Python process PID (sys.remote_exec on "
        "Python 3.14+, gdb on 3.10-3.13) and print its socket path; the program keeps running. "
        "Then: gpumon attach PID. Undo with: gpumon detach PID.")
    p.add_argument("pid", type=int)
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds allowed for each step: debugger, script run, socket (default 5)")
    # Tests without CUDA: the injected agent serves the simulated source.
    p.add_argument("--source", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_inject)

    p = sub.add_parser(
        "detach", help="stop an agent that was injected with --inject",
        description="Stop the agent that `gpumon attach PID --inject` (or `gpumon inject PID`) "
        "loaded into PID and remove its socket. The program keeps running, its output unchanged.")
    p.add_argument("pid", type=int)
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds to wait for the agent (default 5)")
    p.set_defaults(func=cmd_detach)


def _err(msg: str) -> None:
    sys.stderr.write(f"gpumon: {msg}\n")
    sys.stderr.flush()


def cmd_inject(args: argparse.Namespace) -> int:
    from gpumon import inject
    try:
        path = inject.inject(args.pid, timeout=args.timeout or inject.DEFAULT_TIMEOUT,
                             source=args.source)
    except inject.InjectError as e:
        _err(str(e))
        return 1
    sys.stdout.write(f"{path}\n")
    return 0


def cmd_detach(args: argparse.Namespace) -> int:
    from gpumon import inject
    try:
        inject.detach(args.pid, timeout=args.timeout or inject.DEFAULT_TIMEOUT)
    except inject.InjectError as e:
        _err(str(e))
        return 1
    sys.stdout.write(f"detached from process {args.pid}\n")
    return 0


def offer_inject(pid: int, stdin=None, stderr=None) -> list:
    """`gpumon attach PID` on a terminal, PID without an agent: offer to inject one. Returns the
    agent's address(es) once it serves, or [] (declined, not injectable, or failed: each said
    in one line), and the caller goes on with the NVML-only view."""
    from gpumon import client, inject
    stdin = stdin or sys.stdin
    stderr = stderr or sys.stderr
    if not (stdin.isatty() and stderr.isatty()):
        return []
    try:
        ver = inject.check_target(pid)
    except inject.InjectError as e:
        if "child processes" in str(e):  # a launcher (torchrun, a shell script): name its ranks
            _err(str(e))
        return []
    how = ("sys.remote_exec" if ver >= inject.REMOTE_EXEC_VERSION
           else "gdb (the process pauses for well under a second)")
    stderr.write(f"process {pid} has no gpumon agent. Load one into it now through {how}? "
                 f"It keeps running; `gpumon detach {pid}` takes it out again. [y/N] ")
    stderr.flush()
    try:
        answer = stdin.readline().strip().lower()
    except (OSError, KeyboardInterrupt):
        answer = ""
    if answer not in ("y", "yes"):
        return []
    try:
        path = inject.inject(pid)
    except inject.InjectError as e:
        _err(str(e))
        return []
    return [a for a in client.discover(pid) if a.pid == pid] or [client.AgentAddress(pid, path)]
