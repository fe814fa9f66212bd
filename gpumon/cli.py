"""The `gpumon` command. Each feature registers its own subcommands from gpumon/commands/,
so this file stays a table; command modules import their heavy parts lazily."""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

COMMAND_MODULES = (
    "gpumon.commands.core",      # run, ls, attach, demo
    "gpumon.commands.snapshot",  # snapshot (capture on a running process)
    "gpumon.commands.modules",   # modules PID (per-module memory of a running process)
    "gpumon.commands.view",      # view FILE (explore a snapshot)
    "gpumon.commands.estimate",  # estimate
    "gpumon.commands.inject",    # detach (attach --inject lives in core's attach)
    "gpumon.commands.cluster",   # export, relay (attach --hosts/--slurm lives in core's attach)
)


# Commands whose module is known without importing the others: `gpumon view FILE` then imports
# only gpumon.commands.view (the view's first screen is measured against tools that start in
# ~0.1 s; registering every command costs 40 ms of imports). Anything else builds the full table.
FAST_COMMANDS = {"view": "gpumon.commands.view", "diff": "gpumon.commands.view",
                 "run": "gpumon.commands.core"}


class Parser(argparse.ArgumentParser):
    """argparse's refusals as every other gpumon error: one `gpumon: ` line, status 2 (argparse
    printed its usage block, then "gpumon: error: ..."). Subcommands' parsers are this class too
    (add_subparsers makes them of the parent's class)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"gpumon: {message} (see `{self.prog} --help`)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    from gpumon import __version__
    parser = Parser(
        prog="gpumon", description="Live GPU memory monitor for PyTorch training.")
    parser.add_argument("--version", action="version", version=f"gpumon {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in ((only,) if only else COMMAND_MODULES):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # a feature not built yet
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    first = (sys.argv[1:] if argv is None else argv)[:1]
    parser = build_parser(FAST_COMMANDS.get(first[0]) if first else None)
    args, rest = parser.parse_known_args(argv)
    if rest:  # named with the command's own help, not the top level's
        cmd = getattr(args, "command", None)
        parser.exit(2, f"gpumon: unrecognized arguments: {' '.join(rest)} (see `gpumon"
                       f"{' ' + cmd if cmd else ''} --help`)\n")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from gpumon.interrupt import interrupted
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt as e:  # the one interrupt rule (gpumon/interrupt.py)
        return interrupted(getattr(e, "outcome", None))
    except BrokenPipeError:
        return 0
    except Exception as e:
        # imported here, not above: `gpumon view` never touches the socket dir and starts
        # faster without it
        from gpumon.agent.paths import UnsafeDirectory
        if isinstance(e, UnsafeDirectory):  # a socket dir someone else made: the same line
            sys.stderr.write(f"gpumon: {e}\n")  # for every command
            return 1
        if isinstance(e, OSError) and e.errno in _FULL:  # a full disk (stdout on one): one line
            where = f"{e.filename}: " if e.filename else "the output: "
            sys.stderr.write(f"gpumon: cannot write {where}{e.strerror or e}\n")
            _drop_stdout()
            return 1
        raise


# Write errors that are the machine's, not gpumon's: said in one line by every command.
_FULL = {getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG", "EIO", "EROFS") if hasattr(errno, n)}


def _drop_stdout() -> None:
    """What stdout still buffers would fail again at exit (a second traceback): point it at
    /dev/null, as Python's docs do for a closed pipe."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
