"""Shared by view_speed.py and view_vs_ptmem.py: run a terminal program in a pseudo-terminal and
time how long it takes to put a screen up, as a user sees it (from starting the process).

`first_screen(cmd, marks, ...)` starts `cmd` in an 80x24 pty and reads what it writes until
every byte string of `marks` has appeared `times` times (times=2: gpumon view's plain first
frame, then Textual's frame drawn over it); then kills it. Returns (seconds, CPU seconds of the
child: user + sys) or None when the marks never came.

`bench_env()` is the environment both benchmarks run the tools in: the repository (and any
extra folders) on PYTHONPATH, a colour terminal, and compiled bytecode kept in a cache folder
outside the repository (`PYTHONPYCACHEPREFIX`), as an installed package has it: with
PYTHONDONTWRITEBYTECODE set, every run would compile gpumon's sources again (~30 ms).
`precompile(folders, env)` fills that cache once, before timing.
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PYC = os.path.join(tempfile.gettempdir(), "gpumon-bench-pyc")


def bench_env(*extra_paths: str) -> dict:
    env = {**os.environ, "TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "PYTHONPYCACHEPREFIX": _PYC}
    env.pop("NO_COLOR", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *[p for p in extra_paths if p]])
    return env


def precompile(folders, env: dict) -> None:
    subprocess.run([sys.executable, "-m", "compileall", "-q", *folders], env=env,
                   capture_output=True)
    # and the imports of a first run (site-packages already have theirs)
    subprocess.run([sys.executable, "-c", "import gpumon.cli"], env=env, cwd=ROOT,
                   capture_output=True)


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def first_screen(cmd: list[str], marks: tuple[bytes, ...], env: dict, times: int = 1,
                 cols: int = 80, rows: int = 24, timeout: float = 300,
                 cwd: str = ROOT) -> tuple[float, float] | None:
    import fcntl
    import pty
    import select
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    c0, t0 = children_cpu(), time.perf_counter()
    p = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                         close_fds=True)
    os.close(slave)
    out, took = b"", None
    try:
        while time.perf_counter() - t0 < timeout and p.poll() is None:
            if select.select([master], [], [], 0.02)[0]:
                try:
                    out += os.read(master, 1 << 16)
                except OSError:
                    break
                if all(out.count(m) >= times for m in marks):
                    took = time.perf_counter() - t0
                    break
        p.kill()  # the CPU it used to get here is what counts; no quit key to wait for
        p.wait(20)
    except (OSError, subprocess.TimeoutExpired):
        p.kill()
    finally:
        os.close(master)
    return (took, children_cpu() - c0) if took is not None else None


def first_key(cmd: list[str], marks: tuple[bytes, ...], env: dict, cursor_at,
              cols: int = 80, rows: int = 24, timeout: float = 300,
              cwd: str = ROOT) -> tuple[float, float] | None:
    """Ready for keys, as a user meets it: start `cmd` in a cols x rows pty; as soon as its
    first frame is up (every byte string of `marks` has appeared), type the right arrow (as
    the terminal sends it: ESC O C once the program asked for application cursor keys, else
    ESC [ C), and time until the screen shows the cursor moved: `cursor_at(lines)`, the event
    at the cursor read from the screen (rendered by pyte, a terminal emulator: curses redraws
    only the cells that change), differs from the first frame's. What comes after the key is
    read and time-stamped as it arrives, the program is stopped (SIGSTOP) once it has been
    quiet for 20 ms, and only then is the screen worked out (pyte's own time is not the
    tool's); if the cursor has not moved yet the program goes on. Returns (seconds from the
    start until the bytes that moved it came, CPU seconds of the child until it was stopped)
    or None when the marks never came or the key changed nothing."""
    import fcntl
    import pty
    import select
    import signal
    import struct
    import termios

    import pyte
    screen = pyte.Screen(cols, rows)
    stream = pyte.ByteStream(screen)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    c0, t0 = children_cpu(), time.perf_counter()
    p = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                         close_fds=True)
    os.close(slave)
    out, took, cpu, before = b"", None, None, None
    after: list[tuple[float, bytes]] = []
    try:
        while time.perf_counter() - t0 < timeout and p.poll() is None:
            quiet = before is not None and after
            if not select.select([master], [], [], 0.02 if quiet else 0.005)[0]:
                if not quiet:
                    continue
                p.send_signal(signal.SIGSTOP)   # its CPU stops here; the screen, worked out
                cpu = children_cpu_of(p)
                for t, b in after:
                    stream.feed(b)
                    now = cursor_at(screen.display)
                    if now is not None and now != before:
                        took = t - t0
                        break
                after = []
                if took is not None:
                    break
                p.send_signal(signal.SIGCONT)
                continue
            try:
                b = os.read(master, 1 << 16)
            except OSError:
                break
            if before is None:
                out += b
                if all(m in out for m in marks):
                    os.write(master, b"\x1bOC" if b"\x1b[?1h" in out else b"\x1b[C")
                    stream.feed(out)
                    before = cursor_at(screen.display)
                    if before is None:
                        break
                continue
            after.append((time.perf_counter(), b))
        p.kill()
        p.wait(20)
    except (OSError, subprocess.TimeoutExpired):
        p.kill()
    finally:
        os.close(master)
    if took is None:
        return None
    return took, (cpu if cpu is not None else children_cpu() - c0)


def children_cpu_of(p) -> float | None:
    """CPU seconds (user + sys) of a running child, from /proc (None where there is none)."""
    try:
        with open(f"/proc/{p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
