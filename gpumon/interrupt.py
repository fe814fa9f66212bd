"""gpumon's one interrupt rule: Ctrl-C (SIGINT) ends every command and every screen with
status 130, after the command has undone or finished what it started, and one stderr line
says which. Standard library only: cli.main, the commands and the Textual apps all use it.

A command with nothing to undo lets KeyboardInterrupt reach cli.main. One that cleaned up
raises ``Interrupted("what it did")`` (or returns ``interrupted("...")``); a Textual app
exits with INTERRUPTED and sets ``interrupt_outcome``, and its runner raises
``Interrupted(app.interrupt_outcome)``."""
from __future__ import annotations

import sys

INTERRUPTED = 130  # 128 + SIGINT, as shells report a program that Ctrl-C ended
NOTHING = "nothing to undo"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, once the side effects the command started are undone or finished; outcome says
    what happened to them, in a few words ("the recording was saved to X")."""

    def __init__(self, outcome: str | None = None) -> None:
        super().__init__(outcome)
        self.outcome = outcome


def line(outcome: str | None = None) -> str:
    return f"gpumon: interrupted (Ctrl-C); {outcome or NOTHING}"


def interrupted(outcome: str | None = None) -> int:
    """Say the interrupt line on stderr; the status to exit with (130)."""
    try:
        sys.stderr.write(line(outcome) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed or a broken pipe: the status still says it
        pass
    return INTERRUPTED
