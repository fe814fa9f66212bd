"""The `gpumon` command. Each feature registers its own subcommands from gpumon/commands/,
so this file stays a table; command modules import their heavy parts lazily."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "gpumon.commands.core",      # run, ls, attach, demo
    "gpumon.commands.snapshot",  # snapshot (capture on a running process)
    "gpumon.commands.view",      # view FILE (explore a snapshot)
    "gpumon.commands.estimate",  # estimate
    "gpumon.commands.inject",    # detach (attach --inject lives in core's attach)
    "gpumon.commands.cluster",   # export, relay (attach --hosts/--slurm lives in core's attach)
)


def build_parser() -> argparse.ArgumentParser:
    from gpumon import __version__
    parser = argparse.ArgumentParser(
        prog="gpumon", description="Live GPU memory monitor for PyTorch training.")
    parser.add_argument("--version", action="version", version=f"gpumon {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # a feature not built yet
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from gpumon.agent.paths import UnsafeDirectory
    try:
        return int(args.func(args) or 0)
    except UnsafeDirectory as e:  # a socket dir someone else made: the same line for every command
        sys.stderr.write(f"gpumon: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
