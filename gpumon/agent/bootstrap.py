"""How an agent gets started without changing the user's code.

``gpumon run -- CMD`` puts a directory holding the ``sitecustomize.py`` below first on
PYTHONPATH and sets ``GPUMON=1``, so every Python process the command spawns (torchrun's ranks
included) starts an agent at interpreter start-up. The agent then waits, at no cost, until the
program has imported torch and initialised CUDA; a process that never does never appears.
With the package installed, ``GPUMON=1`` alone does the same through ``gpumon-autostart.pth``
(a line in site-packages that does nothing unless the variable is set).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

PTH_NAME = "gpumon-autostart.pth"
# One line, run by site.py at every interpreter start: cheap (an env lookup) unless GPUMON is
# set, and silent even if gpumon is half-uninstalled (site.py would print a traceback).
# setup.py reads this constant to write the .pth into the wheel's root (site-packages).
PTH_LINE = ('import os; os.environ.get("GPUMON", "") not in ("", "0") and exec('
            '"try:\\n from gpumon.agent.bootstrap import autostart\\n autostart()\\n'
            'except Exception:\\n pass")\n')

SITECUSTOMIZE = '''\
# Written by `gpumon run`: starts the gpumon agent in this Python process when GPUMON=1, then
# runs any other sitecustomize that this one shadows, exactly as Python would have.
def _gpumon_bootstrap():
    import os, sys
    if os.environ.get("GPUMON", "") not in ("", "0"):
        try:
            try:
                from gpumon.agent import bootstrap
            except ImportError:
                home = os.environ.get("GPUMON_HOME")
                if not home:
                    raise
                sys.path.append(home)  # last, so it shadows nothing of the program's own
                from gpumon.agent import bootstrap
            bootstrap.autostart()
        except Exception:
            pass  # the program must run as if gpumon were not there


def _gpumon_chain():
    import os, sys
    here = os.path.dirname(os.path.abspath(__file__))
    import importlib.machinery, importlib.util
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = mod
        spec.loader.exec_module(mod)  # its errors are reported by site.py, as without gpumon


def _gpumon_release_sigint():
    # `gpumon run` blocked SIGINT across its exec (GPUMON_SIGINT_HELD): let it go now that
    # the interpreter has started. A Ctrl-C that came meanwhile ends the program as one
    # interrupted before it started: by SIGINT, silently (never a fatal start-up error).
    import os
    if os.environ.pop("GPUMON_SIGINT_HELD", None) != "1":
        return
    import signal
    if signal.SIGINT in signal.sigpending():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


try:
    _gpumon_bootstrap()
finally:
    _gpumon_release_sigint()
del _gpumon_bootstrap, _gpumon_release_sigint
_gpumon_chain()  # after the release: the program's own sitecustomize runs as without gpumon
del _gpumon_chain
'''


SIGINT_HELD = "GPUMON_SIGINT_HELD"  # set by `gpumon run` when it blocked SIGINT for the exec


def runs_our_sitecustomize(cmd: list[str], env: dict[str, str]) -> bool:
    """True if cmd starts a Python interpreter (directly, or a script whose #! line names
    one) that will import the sitecustomize on env's PYTHONPATH: not with -I, -S or -E."""
    import re
    import shutil
    exe = shutil.which(cmd[0], path=env.get("PATH")) if cmd else None
    if not exe:
        return False
    args = list(cmd[1:])
    try:
        with open(exe, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    if head.startswith(b"#!"):
        words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
        if not words:
            return False
        if os.path.basename(words[0]) == "env":
            words = [w for w in words[1:] if not w.startswith("-")]
            if not words:
                return False
            interp = shutil.which(words[0], path=env.get("PATH")) or words[0]
        else:
            interp = words[0]
        exe, args = interp, words[1:] + args
    if not re.fullmatch(r"python[0-9.]*", os.path.basename(exe)):
        return False
    for a in args:  # interpreter options up to the script, -m or -c
        if not a.startswith("-") or a in ("-", "--") or a.startswith("--"):
            break
        if a.startswith(("-m", "-c")):
            break
        if a.startswith(("-X", "-W")):
            continue
        if set(a[1:]) & set("ISE"):
            return False
    return True


def autostart() -> None:
    """Start the agent if GPUMON is set; never raises, never prints."""
    if os.environ.get("GPUMON", "") in ("", "0"):
        return
    try:
        from gpumon.agent import core
        core.start(origin="env")
    except Exception:
        pass


def bootstrap_dir() -> Path:
    """A directory with the sitecustomize.py above (written once per gpumon version)."""
    from gpumon import __version__
    from gpumon.agent.core import socket_dir
    d = socket_dir(create=True) / f"bootstrap-{__version__}"
    target = d / "sitecustomize.py"
    try:
        if target.read_text() == SITECUSTOMIZE:
            return d
    except OSError:
        pass
    from gpumon.agent import paths
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        pass
    # (through a checked descriptor of the folder: never into a link planted there)
    paths.write_file(str(target), lambda f: f.write(SITECUSTOMIZE.encode()), mode=0o600,
                     private=True, hint=paths.SOCKET_HINT)
    return d


def package_home() -> str:
    """The directory that holds the gpumon package (for a child whose sys.path lacks it)."""
    import gpumon
    return str(Path(gpumon.__file__).resolve().parent.parent)


def run_env(env: dict[str, str] | None = None, rate_hz: float | None = None,
            oom_snapshot: bool = False) -> dict[str, str]:
    """The environment for `gpumon run`'s command."""
    env = dict(os.environ if env is None else env)
    env["GPUMON"] = "1"
    env["GPUMON_RUN_PID"] = str(os.getpid())  # the command keeps this pid (exec): core.py
    if rate_hz is not None:
        env["GPUMON_RATE"] = repr(float(rate_hz))
    if oom_snapshot:
        env["GPUMON_OOM_SNAPSHOT"] = "1"
    parts = [str(bootstrap_dir())] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["GPUMON_HOME"] = package_home()
    return env


if __name__ == "__main__":  # pragma: no cover - a debugging aid
    sys.stdout.write(str(bootstrap_dir()) + "\n")
