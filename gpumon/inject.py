"""Bring gpumon's agent into a Python process that was started without it.

How (the safest way we know, per Python version):

* Python 3.14+: ``sys.remote_exec(pid, script)`` (PEP 768), run with the *target's own*
  interpreter (``/proc/PID/exe``) so the versions match. The target runs the script itself at
  its next eval-loop safe point, on its main thread, like a signal handler.
* Python 3.10 to 3.13: gdb (or cuda-gdb). gdb stops the target, and on its main thread calls only
  two things that are safe at any instruction: ``mmap`` (a bare system call, so no malloc lock
  can deadlock us, unlike gdb string literals or pyrasite's approach) to hold the script, and
  ``Py_AddPendingCall(PyRun_SimpleString, script)``, which is documented to need neither the GIL
  nor a thread state. gdb then detaches at once (the target is stopped 0.2-0.5 s, measured in
  benchmarks/inject_pause.py; gdb reads the symbols of libc and libpython only). The
  interpreter itself runs the script later, between two bytecodes on its main thread,
  holding the GIL: the same safe point as ``sys.remote_exec`` and signal handlers.
  Trade-off: memray/pyrasite call ``PyGILState_Ensure`` + ``PyRun_SimpleString`` from the
  debugger, which works even while the main thread is stuck in C, but runs Python code
  wherever the thread was interrupted (inside malloc, inside the interpreter holding the GIL);
  we prefer never running Python code at an unknown point, at the cost that a main thread
  blocked in C (a hung collective) never gets to the script: we then say so after the timeout,
  and cancel the script's ticket (a file both sides rename; one wins), so it does nothing if it
  runs later.

The script itself (``_BOOTSTRAP``) only takes its ticket, writes a status file, and starts
a new thread; that thread loads this gpumon package from its directory (no change to
``sys.path``; gpumon need not be installed in the target), calls ``gpumon.start()`` exactly as
``gpumon run`` would, registers a ``detach`` command and reports back. It never imports torch
(the agent takes it from ``sys.modules``). Injecting twice is harmless: ``start`` is idempotent.

Every failure is an ``InjectError`` whose message is one line that says what to do. Standard
library only at import time: the target imports this module too (``_target_start``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

MIN_VERSION = (3, 10)
REMOTE_EXEC_VERSION = (3, 14)
DEFAULT_TIMEOUT = 5.0
PACKAGE_DIR = Path(__file__).resolve().parent  # .../gpumon
DEBUGGERS = ("gdb", "cuda-gdb")
_MAP_SIZE = 1 << 16  # the mmap that holds the script in the target (page-aligned, zeroed)


class InjectError(Exception):
    """Injection failed; ``str()`` is one line with the fix. The target was left as it was."""


# -- what the target is -------------------------------------------------------------------------
def _status_fields(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except FileNotFoundError:
        raise InjectError(f"no process with pid {pid}") from None
    except OSError as e:
        raise InjectError(f"cannot read /proc/{pid}/status: {e.strerror}") from None


def _user_name(uid: int) -> str:
    try:
        import pwd
        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return f"uid {uid}"


def python_version_of(pid: int) -> tuple[int, int] | None:
    """The target's Python version, or None if it is not a Python process.

    Only by reading, never by running anything found in the target's tree (a binary named
    python3 in another user's process would run as us): the libpython it maps (shared
    builds), else the interpreter's name (python3.12), else its executable's ELF (the
    ``Py_Version`` symbol, 3.11+, or the version string beside the C API's symbols)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                m = re.search(r"/libpython(\d+)\.(\d+)[a-z]*\.so", line)
                if m:
                    return int(m.group(1)), int(m.group(2))
    except PermissionError:
        # Reading maps takes the same permission as ptrace (a non-dumpable process, Yama).
        raise _ptrace_denied(pid) from None
    except OSError:
        pass
    exe = _exe(pid)
    name = os.path.basename(exe or "")
    m = re.fullmatch(r"python(\d+)\.(\d+)[a-z]*", name)
    if m:
        return int(m.group(1)), int(m.group(2))
    # /proc/PID/exe opens the very file the process runs (even deleted or replaced since).
    return elf_python_version(f"/proc/{pid}/exe")


ELF_READ_MAX = 256 * 1024 * 1024  # a static Python is ~7-30 MB; nothing larger is read


def elf_python_version(path: str) -> tuple[int, int] | None:
    """The Python version an executable embeds, read from its bytes (never run), or None if
    it holds no Python interpreter: the ``Py_Version`` symbol's value (PY_VERSION_HEX, 3.11+),
    else a dynamic dependency on libpython3.X, else (3.10) its version string, if the
    executable exports the C API gpumon calls."""
    import mmap
    import struct
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not 64 <= size <= ELF_READ_MAX:
                return None
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    try:
        if data[:4] != b"\x7fELF":
            return None
        m = re.search(rb"\x00libpython(\d+)\.(\d+)[a-z]*\.so", data)
        if m:
            return int(m.group(1)), int(m.group(2))
        if data.find(b"\x00PyRun_SimpleString\x00") < 0:
            return None  # no C API to call into: not a Python (or one gpumon cannot use)
        if data[4] == 2 and data[5] == 1:  # ELF64, little-endian: read the symbol
            try:
                v = _elf64_symbol_u32(data, b"Py_Version", struct)
            except (struct.error, IndexError, ValueError):
                v = None
            if v is not None and v >> 24 == 3:
                return 3, (v >> 16) & 0xFF
        found = {int(x) for x in re.findall(rb"\x003\.(\d{1,2})\.\d{1,2}(?:(?:a|b|rc)\d+)?\+?\x00",
                                              data)}
        found = {x for x in found if x >= 6}
        return (3, max(found)) if found else None
    finally:
        data.close()


def _elf64_symbol_u32(data: Any, name: bytes, struct: Any) -> int | None:
    """The 4 bytes a dynamic symbol of a little-endian ELF64 file points at, or None."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    for sh in sections:
        if sh[1] != 11:  # SHT_DYNSYM
            continue
        strtab = sections[sh[6]]
        entsize = sh[9] or 24
        for off in range(sh[4], sh[4] + sh[5], entsize):
            st_name, _info, _other, _shndx, value, _size = struct.unpack_from("<IBBHQQ", data, off)
            start = strtab[4] + st_name
            if data[start:start + len(name) + 1] != name + b"\x00" or not value:
                continue
            for sec in sections:  # the section whose addresses hold the value
                addr, offset, length = sec[3], sec[4], sec[5]
                if sec[1] != 8 and addr <= value < addr + length:  # not SHT_NOBITS (.bss)
                    return struct.unpack_from("<I", data, offset + value - addr)[0]
            return None
    return None


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _environ(pid: int) -> dict[str, str]:
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


def _uid_of(pid: int) -> int | None:
    try:
        return int(_status_fields(pid).get("Uid", "-1").split()[0])
    except (InjectError, ValueError, IndexError):
        return None


def _descendants(pid: int) -> tuple[list[int], list[tuple[int, int]]]:
    """pid's descendants: this user's, and (pid, uid) of those that belong to another user.
    Another user's are never offered for injection, nor looked into beyond their owner: only
    a pid named exactly may be another user's (check_target)."""
    try:
        import psutil
        kids = [k.pid for k in psutil.Process(pid).children(recursive=True)]
    except Exception:
        return [], []
    me = os.geteuid()
    owners = [(k, _uid_of(k)) for k in kids]
    return ([k for k, u in owners if u == me],
            [(k, u) for k, u in owners if u is not None and u != me])


def _own_descendants(pid: int) -> list[int]:
    return _descendants(pid)[0]


def _others_refused(pid: int) -> str:
    """The clause that names pid's descendants of other users, refused (or "")."""
    others = _descendants(pid)[1]
    if not others:
        return ""
    named = ", ".join(f"{k} ({_user_name(u)}'s)" for k, u in others[:8])
    return (f"; processes under it that belong to another user are not offered: {named} "
            "(gpumon injects into another user's process only when you name its pid and may "
            "attach to it)")


def _python_children(pid: int) -> list[int]:
    out = []
    for k in _own_descendants(pid):
        try:
            if python_version_of(k) is not None:
                out.append(k)
        except Exception:
            pass
    return out


def _name_of(pid: int) -> str:
    try:
        return _status_fields(pid).get("Name", "?")
    except InjectError:
        return "exited"


_RANK_VARS = ("LOCAL_RANK", "RANK")


def _rank_children(pid: int) -> list[int]:
    """Python descendants that a launcher gave a rank the process itself has not (a training
    process's own DataLoader workers inherit its environment, so they are never listed)."""
    if any(k in _environ(pid) for k in _RANK_VARS):
        return []
    kids = _own_descendants(pid)
    ranked = [k for k in kids if any(v in _environ(k) for v in _RANK_VARS)]
    out = []
    for k in ranked:  # few; the Python check reads their executables, so it comes last
        try:
            if python_version_of(k) is not None:
                out.append(k)
        except Exception:
            pass
    return out


def check_target(pid: int) -> tuple[int, int]:
    """Raise InjectError (one line) unless pid is a live process of this user running a Python
    recent enough; returns its version."""
    if pid <= 0:
        raise InjectError(f"no process with pid {pid}")
    st = _status_fields(pid)
    name = st.get("Name", "?")
    if st.get("State", "").startswith(("Z", "X")):
        raise InjectError(f"process {pid} ({name}) has exited")
    if st.get("State", "").startswith("T"):
        raise InjectError(f"process {pid} ({name}) is stopped (Ctrl-Z or SIGSTOP): resume it "
                          f"(kill -CONT {pid}, or fg in its shell), then retry")
    tracer = int(st.get("TracerPid", "0") or 0)
    if tracer:
        raise InjectError(f"process {pid} ({name}) is being traced by process {tracer} "
                          f"({_name_of(tracer)}: a debugger, strace or a profiler): stop that "
                          "first, then retry")
    uid = int(st.get("Uid", "-1").split()[0])
    if uid != os.geteuid():
        # a pid named exactly (this one) may be another user's when we may attach to it
        why = attach_refused(uid)
        if why:
            who = _user_name(uid)
            raise InjectError(
                f"process {pid} ({name}) belongs to {who}, not to you, and {why}: run gpumon as "
                f"that user (sudo -u {who} gpumon attach --inject {pid})")
    if pid == os.getpid():
        raise InjectError("that is gpumon's own process: in your program, call gpumon.start()")
    ver = python_version_of(pid)
    if ver is None:
        kids = _python_children(pid)
        hint = (f"; its Python child processes: {', '.join(map(str, kids[:8]))}: inject into one"
                if kids else "")
        raise InjectError(f"process {pid} ({name}) is not a Python process{hint}"
                          f"{_others_refused(pid)}")
    ranks = _rank_children(pid)
    if ranks:  # torchrun, accelerate, deepspeed: the launcher holds no CUDA memory itself
        raise InjectError(
            f"process {pid} ({name}) is a launcher; its ranks are its Python child processes "
            f"{', '.join(map(str, ranks[:8]))}: inject into one (gpumon attach {ranks[0]} --inject)")
    if ver < MIN_VERSION:
        raise InjectError(
            f"process {pid} runs Python {ver[0]}.{ver[1]}, too old for gpumon's agent "
            f"(needs {MIN_VERSION[0]}.{MIN_VERSION[1]}+): start it on a newer Python")
    return ver


# -- the socket dir as the client sees it -------------------------------------------------------
def _socket_dir() -> Path:
    from gpumon.agent.core import socket_dir
    return socket_dir(create=True)


def _socket_live(path: Path) -> bool:
    import socket as _socket
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


# -- the script the target runs ------------------------------------------------------------------
# Runs in the target's __main__ namespace (PyRun_SimpleString), so it binds no names there: all
# of it is one exec() of a string in a fresh dict. It must never raise (a pending call that
# returns -1 would surface as an error in the program), never print, never import torch.
_BOOTSTRAP = r'''
import os, time
def _take_ticket():
    # The client cancels by renaming the same file: exactly one of us wins, so a script that
    # runs after the client gave up does nothing. The deadline is a backstop for a dead client.
    if time.time() > _p["deadline"]:
        return False
    try:
        os.rename(_p["ticket"], _p["ticket"] + ".taken")
        return True
    except OSError:
        return False
if _take_ticket():
    def _status(d):
        # Through a descriptor of the (private) socket folder, checked as opened: never
        # through a link planted there, never into a folder of someone else's.
        import json
        dfd = os.open(os.path.dirname(_p["status"]),
                      os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(dfd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                return
            name = os.path.basename(_p["status"])
            fd = os.open(name + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            with os.fdopen(fd, "w") as f:
                json.dump(d, f)
            os.replace(name + ".tmp", name, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
    _status({"stage": "ran", "pid": os.getpid()})
    def _boot():
        try:
            import sys
            if "gpumon" not in sys.modules:
                import importlib.util
                pkg = _p["package"]
                spec = importlib.util.spec_from_file_location(
                    "gpumon", os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg])
                mod = importlib.util.module_from_spec(spec)
                sys.modules["gpumon"] = mod
                try:
                    spec.loader.exec_module(mod)
                except BaseException:
                    sys.modules.pop("gpumon", None)
                    raise
            from gpumon import inject
            inject._target_start(_p, _status)
        except BaseException as e:
            try:
                _status({"stage": "error", "error": "%s: %s" % (type(e).__name__, e)})
            except BaseException:
                pass
    import threading
    threading.Thread(target=_boot, name="gpumon-inject", daemon=True).start()
'''


def bootstrap_code(params: dict[str, Any]) -> str:
    """The text handed to the target: one exec() in a private namespace, all errors swallowed."""
    body = repr(_BOOTSTRAP)
    code = ("try:\n"
            f"    exec({body}, {{'_p': {params!r}, '__builtins__': __builtins__}})\n"
            "except BaseException:\n"
            "    pass\n")
    compile(code, "<gpumon-inject>", "exec")  # ours: a syntax error here is a gpumon bug
    return code


def _target_start(p: dict[str, Any], status: Any) -> None:
    """In the target, on the injected thread: start the agent as `gpumon run` would."""
    import gpumon
    from gpumon.agent import core
    # Serve where the client that injected us looks (the target's environment may lack
    # XDG_RUNTIME_DIR, e.g. a Slurm job versus an ssh shell). Only the agent reads it.
    global _env_before
    running = core.current_agent()
    already = running is not None and running.alive
    if already:  # the program's own agent (gpumon.start, GPUMON=1): report where it serves
        status({"stage": "started", "already": True, "source": running.source.kind,
                "socket": str(running.socket_path or core.socket_dir() / f"{os.getpid()}.sock")})
        return
    want = p.get("socket_dir")
    if want and str(core.socket_dir()) != want:
        if _env_before is None:  # detach puts the program's own value back
            _env_before = {"GPUMON_DIR": os.environ.get("GPUMON_DIR")}
        os.environ["GPUMON_DIR"] = os.path.dirname(want)  # the agent serves in its gpumon-<uid>
    agent = gpumon.start(rate_hz=p.get("rate_hz"), source=p.get("source"), origin="inject")
    if agent is None:
        status({"stage": "error", "error": "gpumon.start() failed: see the agent log "
                f"{os.path.join(str(core.socket_dir()), 'agent.log')}"})
        return
    core.register_command("detach", _cmd_detach)
    status({"stage": "started", "already": False, "source": agent.source.kind,
            "socket": str(core.socket_dir() / f"{os.getpid()}.sock")})


def _cmd_detach(args: dict, ctx: Any) -> dict:
    """Agent command: stop this (injected) agent and remove its socket, after the reply."""
    import threading
    from gpumon.agent import core
    agent = ctx.agent

    def later() -> None:
        time.sleep(0.1)  # let the reply leave first
        core._commands.pop("detach", None)
        if core.current_agent() is agent:
            core.stop()
            _undo_extensions()
        _restore_env()

    threading.Thread(target=later, name="gpumon-detach", daemon=True).start()
    return {"detached": True, "pid": os.getpid()}


_env_before: dict[str, str | None] | None = None  # in the target: what _target_start changed


def _restore_env() -> None:
    global _env_before
    before, _env_before = _env_before, None
    for k, v in (before or {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _undo_extensions() -> None:
    """In the target, after the injected agent stopped: take out what the agent's extensions
    put into the program, so it runs exactly as before the injection: the phases part's torch
    hooks, and an allocation recording (a client's, saved as a snapshot, or the OOM flight
    recorder's). Each step on its own: one that fails (logged) does not stop the next."""
    import sys as _sys
    from gpumon.agent import core
    log = core.get_logger()
    phases = _sys.modules.get("gpumon.agent.phases")
    if phases is not None:
        try:
            phases.uninstall()
        except Exception:
            log.exception("detach: removing the phase hooks failed")
    snap = _sys.modules.get("gpumon.agent.snapshot")
    rec = snap.recorder() if snap is not None else None
    if rec is not None:
        try:
            if getattr(rec, "session", None) is not None:
                rec.stop({}, "detach")  # the user's recording is saved, not lost
        except Exception:
            log.exception("detach: stopping the recording failed")
        try:
            rec.oom_enabled = False
            if getattr(rec, "flight_ours", False):
                rec.flight_ours = False
                rec.backend.stop()
        except Exception:
            log.exception("detach: stopping the OOM flight recorder failed")
        rec._closed = True  # its OOM observer (torch cannot remove one) does nothing from now


# -- driving the debugger ------------------------------------------------------------------------
def find_debugger() -> str:
    override = os.environ.get("GPUMON_GDB")
    if override:
        path = shutil.which(override)
        if path:
            return path
        raise InjectError(f"GPUMON_GDB={override} is not an executable: point it at gdb")
    for name in DEBUGGERS:
        path = shutil.which(name)
        if path:
            return path
    cuda = "/usr/local/cuda/bin/cuda-gdb"
    if os.access(cuda, os.X_OK):
        return cuda
    raise InjectError("no debugger found (gdb or cuda-gdb is needed to inject into Python "
                      "3.10-3.13): install gdb (apt-get install gdb, dnf install gdb, "
                      "conda install -c conda-forge gdb) or start the program under gpumon run")


def _ptrace_scope() -> int | None:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


CAP_SYS_PTRACE = 19  # its bit in /proc/PID/status's capability masks (linux/capability.h)


def _has_cap_sys_ptrace() -> bool:
    """CAP_SYS_PTRACE in this process's effective set, read from /proc/self/status."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def attach_refused(uid: int) -> str | None:
    """Why this process may not attach a debugger to a process of user ``uid`` (a clause of
    one line), or None. Decided by reading only: another user's process needs CAP_SYS_PTRACE
    (root has it) and a yama ptrace_scope below 3; this user's own is left to the debugger,
    whose refusal _ptrace_denied explains (yama's scope 1 allows only a parent)."""
    if uid == os.geteuid():
        return None
    if not _has_cap_sys_ptrace():
        return ("attaching to another user's process needs CAP_SYS_PTRACE (root), which "
                "gpumon has not")
    if _ptrace_scope() == 3:
        return "kernel.yama.ptrace_scope is 3 (attaching disabled until reboot)"
    return None


def _ptrace_denied(pid: int) -> InjectError:
    scope = _ptrace_scope()
    if scope == 3:
        fix = "kernel.yama.ptrace_scope is 3 (attaching disabled until reboot): start it under gpumon run"
    elif scope == 2:
        fix = ("kernel.yama.ptrace_scope is 2 (admin only): run gpumon with CAP_SYS_PTRACE "
               "(as root), or start it under gpumon run")
    elif scope == 1:
        fix = ("kernel.yama.ptrace_scope is 1 (only a parent may attach): "
               "sudo sysctl kernel.yama.ptrace_scope=0, or run gpumon with CAP_SYS_PTRACE; "
               "in a container add the SYS_PTRACE capability")
    else:
        fix = ("in a container, add the SYS_PTRACE capability (docker run --cap-add SYS_PTRACE; "
               "Kubernetes securityContext.capabilities.add: [SYS_PTRACE]); a process that made "
               "itself non-dumpable needs CAP_SYS_PTRACE (root)")
    return InjectError(f"not permitted to attach a debugger to process {pid}: {fix}")


def _stop_debugger(proc: subprocess.Popen) -> None:
    """Stop a debugger that ran over its time without hurting the target: SIGINT makes gdb stop
    the inferior call and unwind it (unwindonsignal), then batch mode detaches on exit.
    SIGKILL is the last resort, for a gdb that answers neither SIGINT nor SIGTERM (the kernel
    then detaches; _resume_if_left_stopped undoes a stop it leaves)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=5.0)
            return
        except subprocess.TimeoutExpired:
            continue


def _gdb_commands(code_file: str) -> str:
    # Each line runs only if the one before it worked (gdb stops a sourced file at the first
    # error), and batch mode detaches from an attached process when it exits, whatever happened.
    return "\n".join([
        'printf "GPUMON_ATTACHED\\n"',
        "set unwindonsignal on",
        f"set $gpumon_buf = (char *) mmap(0, {_MAP_SIZE}, 3, 0x22, -1, 0)",
        'if $gpumon_buf == (char *) -1\n  printf "GPUMON_MMAP_FAILED\\n"\nend',
        f"restore {code_file} binary $gpumon_buf",
        "set $gpumon_rc = (int) Py_AddPendingCall((void *) PyRun_SimpleString, (void *) $gpumon_buf)",
        'printf "GPUMON_SCHEDULED %d\\n", $gpumon_rc',
        "detach",
        "",
    ])


XSAVE_FIX = ("gdb 14 or newer knows this CPU's register layout (XSAVE with AMX etc.); "
             "or start the program under gpumon run")


def gdb_version(gdb: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([gdb, "--version"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^GNU gdb .*?(\d+)\.(\d+)", out, re.M)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return " amx_tile" in line
    except OSError:
        pass
    return False


def _check_gdb_can_call(gdb: str) -> None:
    """gdb before 14 assumes a fixed XSAVE layout. Where the CPU's differs (AMX: Sapphire
    Rapids and later) it cannot write the registers back around a call into the target
    ("Couldn't write extended state status: Bad address", seen with gdb 13.1 on an H200 host),
    so refuse before attaching rather than leave a call half done."""
    if not _cpu_has_amx():  # first: reading /proc/cpuinfo is cheaper than running gdb
        return
    ver = gdb_version(gdb)
    if ver is not None and ver < (14, 0):
        raise InjectError(f"gdb {ver[0]}.{ver[1]} cannot restore this CPU's registers around a "
                          f"call (AMX): {XSAVE_FIX}")


def _run_gdb(pid: int, code: str, timeout: float, work: Path) -> None:
    gdb = find_debugger()
    _check_gdb_can_call(gdb)
    data = code.encode()
    if len(data) >= _MAP_SIZE:
        raise InjectError("internal error: the injected script is too long")
    code_file = work / f"{pid}.inject-{uuid.uuid4().hex[:8]}.code"
    cmd_file = code_file.with_suffix(".gdb")
    out_file = code_file.with_suffix(".out")
    from gpumon.agent import paths
    paths.write_private(str(code_file), data)
    paths.write_private(str(cmd_file), _gdb_commands(str(code_file)).encode())
    argv = [gdb, "-nx", "-q", "-batch",
            "-iex", "set debuginfod enabled off", "-iex", "set auto-load off",
            # Read symbols of libc and libpython only: with torch loaded, reading every library
            # takes seconds, and the target is stopped all that time.
            "-iex", "set auto-solib-add off",
            "-p", str(pid),
            "-ex", r"sharedlibrary libc\.", "-ex", "sharedlibrary libc.musl",
            "-ex", "sharedlibrary libpython",
            "-x", str(cmd_file)]
    proc = None
    try:
        # gdb writes to a file, not a pipe, and runs in its own session: if we die (Ctrl-C,
        # a closed ssh), it is neither signalled nor SIGPIPEd halfway through a call in the
        # target, and finishes and detaches by itself.
        with os.fdopen(paths.create_new(str(out_file)), "w") as out_f:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out_f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_debugger(proc)
            out = _read_text(out_file)
            _resume_if_left_stopped(pid)
            raise InjectError(
                f"the debugger did not finish with process {pid} within {timeout:g} s "
                f"({'attached' if 'GPUMON_ATTACHED' in out else 'attaching'}); it was stopped "
                f"and detached: retry with a longer --timeout") from None
        except BaseException:
            # Ctrl-C: let gdb finish what it does in the target (well under a second) first.
            try:
                proc.wait(timeout=timeout)
            except BaseException:
                _stop_debugger(proc)
                _resume_if_left_stopped(pid)
            raise
        out = _read_text(out_file)
    finally:
        if proc is None or proc.poll() is not None:
            for f in (code_file, cmd_file, out_file):
                try:
                    f.unlink()
                except OSError:
                    pass
    _check_gdb_output(pid, out)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _resume_if_left_stopped(pid: int) -> None:
    """A debugger stopped before it saw the target stop leaves the kernel's SIGSTOP of the
    attach pending, and the target then stops for good. check_target refused a target that was
    stopped before, so a stopped, untraced target now is our doing: continue it."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            st = _status_fields(pid)
        except InjectError:
            return
        if st.get("TracerPid", "0") != "0":
            time.sleep(0.02)  # the kernel is still detaching the stopped debugger
            continue
        if st.get("State", "").startswith("T"):
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
            return
        time.sleep(0.05)  # a pending SIGSTOP may take effect a moment later


def _check_gdb_output(pid: int, out: str) -> None:
    m = re.search(r"GPUMON_SCHEDULED (-?\d+)", out)
    if m and int(m.group(1)) == 0:
        return
    if m:
        raise InjectError(f"process {pid}'s queue of pending calls is full: retry in a moment")
    low = out.lower()
    if "operation not permitted" in low or "could not attach" in low:
        raise _ptrace_denied(pid)
    if "no such process" in low:
        raise InjectError(f"no process with pid {pid} (it exited)")
    if "GPUMON_MMAP_FAILED" in out or 'no symbol "mmap"' in low:
        raise InjectError(f"could not map memory in process {pid} (libc symbols not found "
                          "by the debugger): start it under gpumon run")
    if "couldn't write extended state" in low:
        raise InjectError(f"the debugger could not write process {pid}'s extended registers "
                          f"(gpumon stopped there and detached): {XSAVE_FIX}")
    if "py_addpendingcall" in low or "pyrun_simplestring" in low:
        raise InjectError(f"the debugger found no Python C API symbols in process {pid} "
                          "(a stripped or unusual interpreter?): start it under gpumon run")
    last = [l for l in out.splitlines() if l.strip() and not l.startswith("[")]
    detail = last[-1].strip() if last else "no output"
    raise InjectError(f"the debugger could not inject into process {pid}: {detail}")


# -- Python 3.14+: sys.remote_exec ----------------------------------------------------------------
def remote_debug_disabled(pid: int) -> bool:
    """True if the target was started with remote debugging off (PEP 768 opt-outs)."""
    if _environ(pid).get("PYTHON_DISABLE_REMOTE_DEBUG"):
        return True
    argv = _cmdline(pid)
    for i, a in enumerate(argv[1:], 1):
        if a == "-X" and i + 1 < len(argv) and argv[i + 1] == "disable_remote_debug":
            return True
        if a == "-Xdisable_remote_debug":
            return True
    return False


def remote_exec_interpreter(pid: int, ver: tuple[int, int]) -> str:
    """The interpreter that calls sys.remote_exec (it must be the target's major.minor):
    gpumon's own, else ``python3.X`` on gpumon's own PATH. Never the target's executable: a
    binary found in a process tree (another user's, or one they can write) is not run."""
    import sys
    if tuple(sys.version_info[:2]) == tuple(ver):
        return sys.executable
    found = shutil.which(f"python{ver[0]}.{ver[1]}")
    if found:
        return found
    raise InjectError(f"process {pid} runs Python {ver[0]}.{ver[1]} and sys.remote_exec must "
                      f"be called from the same version: put python{ver[0]}.{ver[1]} on your "
                      f"PATH, or run gpumon with it")


def _run_remote_exec(pid: int, code: str, timeout: float, script: Path,
                     ver: tuple[int, int] = REMOTE_EXEC_VERSION) -> None:
    if remote_debug_disabled(pid):
        raise InjectError(
            f"process {pid} was started with remote debugging disabled "
            "(PYTHON_DISABLE_REMOTE_DEBUG or -X disable_remote_debug): restart it without that, "
            "or under gpumon run")
    exe = remote_exec_interpreter(pid, ver)
    # The target reads this file when it runs the script, maybe after we gave up: then it stays
    # (a missing file would make the target print an error; its cancelled ticket makes the late
    # run a no-op), and is removed once the pid is gone. After a run, inject() removes it.
    from gpumon.agent import paths
    paths.write_private(str(script), code.encode())
    # -I: the caller's own PYTHON_DISABLE_REMOTE_DEBUG (CPython checks the sender too) and
    # PYTHONPATH do not apply; -S: no site, so nothing of the target's environment runs here.
    argv = [exe, "-I", "-S", "-c",
            "import sys\n"
            "try:\n"
            f"    sys.remote_exec({pid}, {str(script)!r})\n"
            "except BaseException as e:\n"
            "    print('GPUMON_ERR', type(e).__name__, str(e).replace(chr(10), ' '))\n"
            "else:\n"
            "    print('GPUMON_SCHEDULED 0')\n"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise InjectError(f"sys.remote_exec did not finish with process {pid} within "
                          f"{timeout:g} s: retry with a longer --timeout") from None
    text = out.stdout + out.stderr
    if "GPUMON_SCHEDULED 0" in text:
        return
    m = re.search(r"GPUMON_ERR (\w+) (.*)", text)
    kind, msg = (m.group(1), m.group(2).strip()) if m else ("", text.strip()[-200:])
    low = msg.lower()
    if kind == "PermissionError" or "operation not permitted" in low:
        raise _ptrace_denied(pid)
    if "remote debug" in low and ("disabled" in low or "not enabled" in low):
        raise InjectError(f"process {pid} has remote debugging disabled: restart it without "
                          "PYTHON_DISABLE_REMOTE_DEBUG / -X disable_remote_debug, or under gpumon run")
    if "not been compiled in" in low or "not supported on this platform" in low:
        raise InjectError(f"process {pid}'s Python was built without remote debugging "
                          "(--without-remote-debug): start it under gpumon run")
    if kind == "ProcessLookupError" or (kind == "FileNotFoundError" and f"/proc/{pid}/" in msg):
        raise InjectError(f"no process with pid {pid} (it exited)")
    # One line, the fix-less rest of what CPython said (e.g. a version it cannot read).
    raise InjectError(f"sys.remote_exec into process {pid} failed: {kind} {msg}".strip())


def _clean_leftovers(work: Path) -> None:
    """Remove injection files of processes that no longer exist."""
    try:
        names = os.listdir(work)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(r"(\d+)\.inject-[0-9a-f]+\.(py|code|gdb|out|json|json\.tmp|ticket.*)",
                         name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            try:
                os.unlink(work / name)
            except OSError:
                pass


# -- the entry points ----------------------------------------------------------------------------
def _read_status(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def inject(pid: int, timeout: float = DEFAULT_TIMEOUT, *, source: str | None = None,
           rate_hz: float | None = None) -> Path:
    """Load gpumon's agent into the running Python process pid and return its socket path once
    it exists. Each step (debugger, script run, socket) gets up to ``timeout`` seconds.
    ``source``: the agent's memory source as in ``gpumon run`` (None: the torch source, or the
    target's ``GPUMON_SOURCE``); ``"simulated"`` for tests without CUDA (also from
    ``$GPUMON_INJECT_SOURCE``, so `gpumon attach --inject` can be tested without CUDA).
    Raises InjectError (one line with the fix); the target is left running as before."""
    if source is None:
        source = os.environ.get("GPUMON_INJECT_SOURCE") or None
    ver = check_target(pid)
    owner = _uid_of(pid)
    if owner is not None and owner != os.geteuid():
        # named exactly and we may attach (check_target): the agent runs as its owner and
        # serves in the owner's socket folder, so the whole injection is done as the owner
        return Path(_as_owner(pid, owner, "inject", timeout,
                              ["--source", source] if source else []))
    work = _socket_dir()
    sock = work / f"{pid}.sock"
    # An agent already there (gpumon run, GPUMON=1, an earlier inject) is said at once, from
    # what the socket folder and /proc show: no debugger, the target is not stopped.
    if sock.exists() and _socket_live(sock):
        return sock
    from gpumon.client.discovery import scan
    found = scan(work).get(pid)
    if found is not None:
        return sock  # loaded, waiting for the program's first CUDA call
    elsewhere = agent_socket_elsewhere(pid)
    if elsewhere is not None and os.path.dirname(elsewhere) != str(work):
        raise InjectError(_serving_elsewhere(pid, Path(elsewhere).parent, sock.parent))
    _clean_leftovers(work)
    base = str(work / f"{pid}.inject-{uuid.uuid4().hex[:8]}")
    status_path, ticket = Path(base + ".json"), Path(base + ".ticket")
    from gpumon.agent import paths
    paths.write_private(str(ticket), b"")
    # Backstop only (a client killed before it could cancel): the ticket decides.
    deadline = time.time() + 3 * timeout + 30
    params = {"deadline": deadline, "ticket": str(ticket), "status": str(status_path),
              "package": str(PACKAGE_DIR), "socket_dir": str(work), "source": source,
              "rate_hz": rate_hz}
    code = bootstrap_code(params)
    script = Path(base + ".py")
    try:
        try:
            if ver >= REMOTE_EXEC_VERSION:
                _run_remote_exec(pid, code, timeout, script, ver)
            else:
                _run_gdb(pid, code, timeout, work)
            return _await_agent(pid, status_path, ticket, sock, timeout)
        except KeyboardInterrupt:
            raise InjectInterrupted(_undo_interrupted(pid, ticket, status_path, timeout)) from None
    finally:
        # Whatever happened (even Ctrl-C): a late run must do nothing. If the script has run
        # already (it took its ticket), the target has read its file too.
        _cancel(ticket)
        taken = Path(str(ticket) + ".taken")
        ran = taken.exists()  # else we cancelled it, now or before
        for p in [status_path, Path(base + ".json.tmp"), taken] + ([script] if ran else []):
            try:
                p.unlink()
            except OSError:
                pass


def _as_owner(pid: int, owner: int, command: str, timeout: float, extra: list[str]) -> str:
    """``gpumon inject|detach PID`` run as the owner of another user's process (named exactly,
    and check_target found that we may attach to it): gpumon's own interpreter, never a binary
    of the target's, switched to the owner's uid and gid (root only: su's job, done by
    subprocess) with the owner's socket folder (their XDG_RUNTIME_DIR / GPUMON_DIR, read from
    the target's environment). The agent then serves where the owner's gpumon looks, and the
    owner's own check applies to its clients. Returns what it printed; InjectError (its line)."""
    import sys
    who = _user_name(owner)
    if os.geteuid() != 0:
        raise InjectError(
            f"process {pid} belongs to {who}: you may attach to it, but its agent must be loaded "
            f"as {who} (only root can switch to them): run gpumon as that user "
            f"(sudo -u {who} gpumon {command} {pid})")
    try:
        gid = int(_status_fields(pid).get("Gid", "").split()[0])
    except (ValueError, IndexError):
        raise InjectError(f"cannot read the group of process {pid}") from None
    # only what gpumon needs of ours: the rest of root's environment (tokens, keys) is not
    # handed to a process that user can read
    keep = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "GPUMON_GDB", "GPUMON_INJECT_SOURCE")
    env = {k: v for k, v in os.environ.items() if k in keep}
    theirs = _environ(pid)
    for k in ("XDG_RUNTIME_DIR", "GPUMON_DIR", "TMPDIR"):
        if theirs.get(k):
            env[k] = theirs[k]  # used as a folder by a process of theirs: theirs to choose
    try:
        import pwd
        pw = pwd.getpwuid(owner)
        env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
    except (KeyError, ImportError):
        env["HOME"] = "/"
    # this gpumon and its libraries, as this interpreter found them (our paths, not theirs)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(PACKAGE_DIR.parent)] + [p for p in sys.path if p and os.path.isdir(p)])
    argv = [sys.executable, "-m", "gpumon", command, str(pid), "--timeout", f"{timeout:g}", *extra]
    try:
        proc = subprocess.Popen(argv, env=env, cwd="/", user=owner, group=gid, extra_groups=[],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    except PermissionError:
        raise InjectError(
            f"process {pid} belongs to {who}, and gpumon's interpreter {sys.executable} cannot "
            f"be run as {who} (a folder on its path is closed to them): install gpumon where "
            f"they can run it, or run gpumon as that user (sudo -u {who} gpumon {command} "
            f"{pid})") from None
    except OSError as e:
        raise InjectError(f"could not run gpumon as {who}: {e.strerror or e}") from None
    try:
        out, err = proc.communicate()
    except KeyboardInterrupt:  # it got the Ctrl-C too: it finishes or undoes, and says which
        out, err = proc.communicate()
        raise InjectInterrupted(_last_line(err, f"interrupted: see process {pid}")) from None
    if proc.returncode == 0:
        return out.strip().splitlines()[0] if out.strip() else ""
    raise InjectError(_last_line(err, f"gpumon {command} as {who} failed (exit status "
                                      f"{proc.returncode})"))


def _last_line(text: str, default: str) -> str:
    """gpumon's own one line from what the owner's gpumon printed, else ``default`` with the
    last line it printed (an import error: gpumon not readable by them)."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    ours = [l for l in lines if l.startswith("gpumon: ")]
    if ours:
        return ours[-1][len("gpumon: "):]
    return f"{default}: {lines[-1]}" if lines else default


class InjectInterrupted(KeyboardInterrupt):
    """Ctrl-C during inject, after gpumon finished or undid what it had started; ``str()`` is
    the one line that says which (the command exits 130)."""


def _undo_interrupted(pid: int, ticket: Path, status_path: Path, timeout: float) -> str:
    """After Ctrl-C (the debugger, if any, has finished and detached): cancel the script if it
    has not run, else wait for the agent it started and take it out again (as gpumon detach).
    A second Ctrl-C meanwhile is ignored: this is bounded by ``timeout``. Returns the line."""
    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        old = None
    try:
        if _cancel(ticket):
            return f"interrupted: nothing was loaded into process {pid}"
        until = time.time() + timeout
        st: dict[str, Any] = {}
        while time.time() < until and os.path.exists(f"/proc/{pid}"):
            st = _read_status(status_path) or st
            if st.get("stage") in ("started", "error"):
                break
            time.sleep(0.02)
        stage = st.get("stage")
        if stage == "error" or not os.path.exists(f"/proc/{pid}"):
            return f"interrupted: nothing was loaded into process {pid}"
        if st.get("already"):
            return (f"interrupted: process {pid} already had an agent (gpumon run, GPUMON=1 or "
                    "gpumon.start()); nothing was changed")
        if stage != "started":
            return (f"interrupted: the agent may still be loading in process {pid}: check with "
                    f"gpumon ls, and take it out with gpumon detach {pid}")
        try:
            sock = Path(st.get("socket") or "")
            deadline = time.time() + timeout
            while not sock.exists() and not _waiting_marker(pid).exists() \
                    and time.time() < deadline:
                time.sleep(0.02)
            detach(pid, timeout=timeout)
        except InjectError as e:
            return (f"interrupted: the agent stays loaded in process {pid} ({e}): take it out "
                    f"with gpumon detach {pid}")
        return f"interrupted: the agent loaded into process {pid} was taken out again"
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)


def agent_socket_elsewhere(pid: int) -> str | None:
    """The path of a gpumon agent socket that pid listens on, whatever folder it is in (its
    GPUMON_DIR or XDG_RUNTIME_DIR may differ from ours), read from /proc: the process's socket
    inodes against the kernel's table of bound Unix sockets. None if it has none (or we may not
    look)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return None
    if not inodes:
        return None
    names = (f"{pid}.sock", f".{pid}.new")  # the bind name stays in the table after the rename
    try:
        with open("/proc/net/unix") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) >= 8 and parts[6] in inodes:
                    path = parts[7]
                    if os.path.basename(path) in names and \
                            os.path.basename(os.path.dirname(path)).startswith("gpumon-"):
                        return os.path.join(os.path.dirname(path), f"{pid}.sock")
    except OSError:
        return None
    return None


def _serving_elsewhere(pid: int, where: Path, here: Path) -> str:
    return (f"process {pid} already runs a gpumon agent (gpumon run, GPUMON=1 or "
            f"gpumon.start()), serving in {where}, not in {here} where you look: attach with "
            f"GPUMON_DIR={where.parent} gpumon attach {pid}")


def _cancel(ticket: Path) -> bool:
    """True if we cancelled the script before it ran; False if it has run (or is running)."""
    try:
        os.rename(ticket, str(ticket) + ".cancelled")
    except OSError:
        return False
    try:
        os.unlink(str(ticket) + ".cancelled")
    except OSError:
        pass
    return True


def _await_agent(pid: int, status_path: Path, ticket: Path, sock: Path, timeout: float) -> Path:
    scheduled_at = time.time()
    taken_at = None  # when we found that the script had taken its ticket
    st = None
    while st is None:  # 1. the target runs the script
        st = _read_status(status_path)
        if st is not None:
            break
        if not os.path.exists(f"/proc/{pid}"):
            raise InjectError(f"process {pid} exited before it ran the injected code")
        now = time.time()
        if taken_at is None and now > scheduled_at + timeout:
            if _cancel(ticket):
                raise InjectError(
                    f"process {pid} did not run the injected code within {timeout:g} s: its "
                    "main thread is blocked outside Python (in C code: a hung collective, a long "
                    "GPU sync, a wait on a lock or a thread); nothing was changed, and the code "
                    "will not run later: retry once it runs Python code again, or use a longer "
                    "--timeout")
            taken_at = now  # it took the ticket just now: its status file follows at once
        elif taken_at is not None and now > taken_at + timeout:
            raise InjectError(
                f"process {pid} ran the injected code but wrote no status within {timeout:g} s "
                f"(is {status_path.parent} writable and not full?): see the agent log there")
        time.sleep(0.02)
    until = time.time() + timeout
    while True:  # 2. the agent thread starts the agent; 3. the agent creates its socket
        if st.get("stage") == "error":
            raise InjectError(f"the agent failed to start in process {pid}: {st.get('error')}")
        if st.get("stage") == "started":
            path = Path(st.get("socket") or sock)
            if st.get("already") and path.parent != sock.parent:
                raise InjectError(_serving_elsewhere(pid, path.parent, sock.parent))
            if path.exists():
                return path
            if _waiting_marker(pid).exists():
                return sock  # loaded, waiting for the program's first CUDA call
        if not os.path.exists(f"/proc/{pid}"):
            raise InjectError(f"process {pid} exited while the agent was starting")
        if time.time() > until:
            break
        time.sleep(0.02)
        st = _read_status(status_path) or st
    if st.get("stage") == "started" and _waiting_marker(pid).exists():
        return sock  # loaded, waiting for the program's first CUDA call: the socket comes then
    raise InjectError(f"the agent in process {pid} did not start serving within {timeout:g} s "
                      f"(stage: {st.get('stage')}): see the agent log in {sock.parent}")


def _waiting_marker(pid: int) -> Path:
    from gpumon.agent.core import WAITING_SUFFIX
    return _socket_dir() / f"{pid}{WAITING_SUFFIX}"


def _detach_waiting(pid: int, marker: Path, timeout: float) -> None:
    """An injected agent that never served (the program has made no CUDA call) has no socket:
    ask it through a <pid>.detach file, which it looks for while it waits."""
    from gpumon.agent.core import DETACH_SUFFIX
    from gpumon.client.discovery import _read_marker
    m = _read_marker(marker) or {}
    if m.get("origin") != "inject":
        raise InjectError(
            f"the agent in process {pid} was not injected (it was started by gpumon run, "
            "GPUMON=1 or gpumon.start()): it stops when the program ends")
    request = marker.with_suffix(DETACH_SUFFIX)
    from gpumon.agent import paths
    paths.write_private(str(request), b"")
    until = time.time() + timeout
    while marker.exists():
        if not os.path.exists(f"/proc/{pid}"):
            break
        if time.time() > until:
            try:
                request.unlink()
            except OSError:
                pass
            raise InjectError(f"the agent in process {pid} did not answer the detach request "
                              f"within {timeout:g} s")
        time.sleep(0.02)


def detach(pid: int, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Stop the agent that ``inject`` started in pid and remove its socket (or, if it never
    served, its waiting marker); the program keeps running untouched. Raises InjectError
    (one line)."""
    from gpumon import client
    st = _status_fields(pid) if pid > 0 else None
    if st is None:
        raise InjectError(f"no process with pid {pid}")
    owner = _uid_of(pid)
    if owner is not None and owner != os.geteuid():
        why = attach_refused(owner)
        if why:
            who = _user_name(owner)
            raise InjectError(f"process {pid} belongs to {who}, not to you, and {why}: run "
                              f"gpumon as that user (sudo -u {who} gpumon detach {pid})")
        _as_owner(pid, owner, "detach", timeout, [])  # its agent serves in the owner's folder
        return
    sock = _socket_dir() / f"{pid}.sock"
    if not sock.exists():
        marker = _waiting_marker(pid)
        if marker.exists():
            _detach_waiting(pid, marker, timeout)
            return
        raise InjectError(f"process {pid} has no gpumon agent (nothing to detach)")
    try:
        conn = client.AgentConnection.connect(client.AgentAddress(pid, sock), timeout=timeout)
    except client.AttachError as e:
        raise InjectError(str(e)) from None
    try:
        conn.request("detach", timeout=timeout)
    except client.AgentError as e:
        if "unknown command" in str(e):
            raise InjectError(
                f"the agent in process {pid} was not injected (it was started by gpumon run, "
                "GPUMON=1 or gpumon.start()): it stops when the program ends") from None
        if "went away" not in str(e):
            raise InjectError(f"detach failed: {e}") from None
    finally:
        conn.close()
    until = time.time() + timeout
    while sock.exists():
        if time.time() > until:
            raise InjectError(f"the agent in process {pid} did not remove its socket within "
                              f"{timeout:g} s")
        time.sleep(0.02)
