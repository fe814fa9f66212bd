"""What /proc says about a process, for the client: alive or not, its parent and children, Python
or not, started under gpumon or not, and how it ended while it is a zombie. Cheap reads only
(the target polls these a few times a second); psutil for process trees.
"""
from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass

from gpumon.client.connection import AttachError

_LIBPYTHON = re.compile(rb"/libpython\d+\.\d+[a-z]*\.so")
_PYTHON_EXE = re.compile(r"python[0-9.]*[a-z]*")


@dataclass(frozen=True)
class Exit:
    """How a process ended, as far as it can be known. status: the exit status; signal: the
    signal that killed it; how: "exit" | "exception" | "signal" | "unknown"; line: one
    sentence for the user, that says what is not known rather than guessing."""
    status: int | None
    signal: int | None
    how: str
    line: str


def stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state first), or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data.rsplit(b")", 1)[1].decode(errors="replace").split()


def name_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def alive(pid: int) -> bool:
    """True while pid runs; a zombie (ended, not yet collected by its parent) is not alive."""
    f = stat_fields(pid)
    if f is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return f[0] not in ("Z", "X")


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: with the pid, it names one process
    (pids are reused)."""
    f = stat_fields(pid)
    try:
        return int(f[19]) if f else None
    except (IndexError, ValueError):
        return None


def start_time(pid: int) -> float | None:
    """The process's start time in unix seconds (the agent's hello and marker use the same)."""
    ticks = start_ticks(pid)
    if ticks is None:
        return None
    try:
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError):
        return None


def parent_of(pid: int) -> int | None:
    f = stat_fields(pid)
    try:
        return int(f[1]) if f else None
    except (IndexError, ValueError):
        return None


def zombie_exit(pid: int) -> tuple[int | None, int | None] | None:
    """(status, signal) of a zombie, read from /proc/PID/stat's exit_code (Linux 3.5+); None if
    the process is not a zombie (running, or already collected by its parent)."""
    f = stat_fields(pid)
    if not f or f[0] != "Z" or len(f) < 50:
        return None
    try:
        code = int(f[49])
    except ValueError:
        return None
    return decode_wait_status(code)


def decode_wait_status(code: int) -> tuple[int | None, int | None]:
    if os.WIFSIGNALED(code):
        return None, os.WTERMSIG(code)
    if os.WIFEXITED(code):
        return os.WEXITSTATUS(code), None
    return None, None


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def descendants(pid: int) -> list[int]:
    import psutil
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    env = {}
    for it in items:
        k, sep, v = it.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def env_int(env: dict[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


_python_cache: dict[tuple[int, str], bool] = {}


def is_python(pid: int) -> bool:
    """Maps a libpython, or its executable is called python*: no subprocess. Remembered per
    (pid, executable): a target polls it, and a torch process maps thousands of files."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = ""
    key = (pid, exe)
    if key in _python_cache:
        return _python_cache[key]
    found = bool(_PYTHON_EXE.fullmatch(os.path.basename(exe)))
    if not found:
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                found = any(_LIBPYTHON.search(line) for line in f)
        except OSError:
            return False
    if len(_python_cache) > 4096:
        _python_cache.clear()
    _python_cache[key] = found
    return found


def argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def nspids(pid: int) -> set[int]:
    """pid in every pid namespace we can see (NVML may report a host pid in a container)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return {int(x) for x in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def check_pid(pid: int) -> None:
    """Raise AttachError with one clear line if pid does not exist, has ended, or is another
    user's."""
    import psutil
    try:
        p = psutil.Process(pid)
        uid = p.uids().real
        if p.status() == psutil.STATUS_ZOMBIE:
            raise AttachError(f"process {pid} has exited (zombie)")
    except psutil.NoSuchProcess:
        raise AttachError(f"no process with pid {pid}") from None
    except psutil.AccessDenied:
        raise AttachError(f"process {pid} belongs to another user: run gpumon as that user") from None
    me = os.getuid()
    if uid != me and me != 0:
        try:
            import pwd
            who = pwd.getpwuid(uid).pw_name
        except Exception:
            who = f"uid {uid}"
        raise AttachError(f"process {pid} belongs to {who}: run gpumon as that user")
