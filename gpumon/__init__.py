"""gpumon: a live GPU memory monitor for PyTorch training.

In a training program: ``import gpumon; gpumon.start()`` (or run it under ``gpumon run``, or
set ``GPUMON=1``). This module stays light: it imports neither torch nor the UI, so starting the
agent costs the program nothing until it uses CUDA.
"""
from __future__ import annotations

import sys as _sys


def _default_sigint_if_gpumon_run() -> None:
    """In `gpumon run`'s own process only (python -m gpumon run / the gpumon script), first
    thing: Ctrl-C before the exec ends it by SIGINT, silently, as a Python program that has not
    started yet (see gpumon.cli). Never in a program that imports gpumon."""
    orig = list(getattr(_sys, "orig_argv", None) or [])
    via_m, i = False, 1
    while i < len(orig):  # the interpreter's own options, up to -m, -c or the script
        a = orig[i]
        if a == "-m":
            via_m = orig[i + 1:i + 3] == ["gpumon", "run"]
            break
        if not a.startswith("-") or a.startswith("-c") or a == "-":
            break
        i += 2 if a in ("-X", "-W") else 1
    argv = _sys.argv
    via_script = bool(argv) and argv[0].endswith("/gpumon") and argv[1:2] == ["run"]
    if via_m or via_script:
        import _signal
        if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
            _signal.signal(_signal.SIGINT, _signal.SIG_DFL)


_default_sigint_if_gpumon_run()

TYPE_CHECKING = False
if TYPE_CHECKING:  # (typing is not imported at run time: `gpumon run` execs sooner without it)
    from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "start", "stop", "mark", "phase", "watch"]


def start(rate_hz: float | None = None, source: Any = None, oom_snapshot: bool | None = None,
          **kw: Any):
    """Start the in-process agent (idempotent: a second call returns the running agent).

    rate_hz: samples per second (default ``$GPUMON_RATE`` or 10). source: ``"torch"`` (the
    default, from ``$GPUMON_SOURCE``), ``"simulated"``, or a source object. Never raises into
    the program: on an internal error it logs and returns None.
    """
    from gpumon.agent import core
    return core.start(rate_hz=rate_hz, source=source, oom_snapshot=oom_snapshot, **kw)


def stop() -> None:
    """Stop the agent and remove its socket."""
    from gpumon.agent import core
    core.stop()


def _phases():
    from gpumon.agent import phases  # the phases part; imported only when used
    return phases


def mark(name: str, **kw: Any) -> Any:
    """Mark the start of a user phase (e.g. "eval", "checkpoint")."""
    return _phases().mark(name, **kw)


def phase(name: str, **kw: Any) -> Any:
    """Context manager: ``with gpumon.phase("data"): ...``."""
    return _phases().phase(name, **kw)


def watch(model: Any = None, optimizer: Any = None, **kw: Any) -> Any:
    """Name the model and optimizer for the breakdown by role (optional)."""
    return _phases().watch(model, optimizer, **kw)
