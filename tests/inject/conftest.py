"""Targets for the injection tests: real Python processes started WITHOUT gpumon, that print a
deterministic sequence until told to stop, and report on exit what they saw in themselves."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from polling import wait_until  # noqa: F401  (the tests here import it from this conftest)

# The target: prints 0, 1, 2, ... (one line per tick) until STOP exists, then "done"; then
# writes what gpumon may have changed in it to REPORT. MODE "block" first holds the GIL in one
# C call until a byte arrives on its stdin.
TARGET = r'''
import json, os, sys, threading, time
stop, report, mode = sys.argv[1], sys.argv[2], sys.argv[3]
path0 = list(sys.path)
env0 = {k: v for k, v in os.environ.items() if k.startswith("GPUMON")}
if mode == "torch":
    # A real (tiny) training loop: its printed losses are the results gpumon must not change.
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 32), torch.randn(256, 1)
if mode == "nodump":
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: only CAP_SYS_PTRACE may attach
print("ready", flush=True)
if mode == "block":
    import ctypes
    # read(2) through PyDLL keeps the GIL: blocked in C until the test writes a byte to stdin.
    ctypes.PyDLL(None).read(0, ctypes.create_string_buffer(1), 1)
i = 0
while not os.path.exists(stop):
    if mode == "torch":
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(i, loss.item().hex(), flush=True)
    else:
        print(i, flush=True)
    i += 1
    time.sleep(0.02)
print("done", flush=True)
hooks = None  # every torch hook left in the program (global, per module, per optimizer)
if "torch" in sys.modules:
    mm = sys.modules["torch.nn.modules.module"]
    hooks = sum(len(getattr(mm, n)) for n in dir(mm)
                if n.startswith("_global_") and n.endswith("hooks"))
    if mode == "torch":
        for m in model.modules():
            hooks += sum(len(getattr(m, n, ())) for n in (
                "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))
        hooks += sum(len(getattr(opt, n, ())) for n in (
            "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"))
        import torch.optim.optimizer as oo
        hooks += sum(len(getattr(oo, n)) for n in dir(oo)
                     if n.startswith("_global_optimizer") and n.endswith("hooks"))
with open(report, "w") as f:
    json.dump({"torch": "torch" in sys.modules, "gpumon": "gpumon" in sys.modules,
               "sys_path_same": sys.path == path0, "hooks": hooks,
               # what the injection left changed in the environment: against what the program
               # started with, whatever GPUMON_* the runner has (tests/conftest.py's, the CI
               # leg's GPUMON_TORCH)
               "env_gpumon": sorted(k for k in set(os.environ) | set(env0) if k.startswith("GPUMON")
                                    and os.environ.get(k) != env0.get(k)),
               "threads": sorted(t.name for t in threading.enumerate())}, f)
'''


class Target:
    def __init__(self, proc: subprocess.Popen, stop: Path, report: Path) -> None:
        self.proc, self.stop_file, self.report_file = proc, stop, report
        self.pid = proc.pid

    def finish(self, timeout: float = 30.0) -> tuple[list[str], str, dict]:
        """Tell it to stop; return (stdout lines, stderr, report)."""
        self.stop_file.touch()
        # Read through the same buffered file that read the first line (communicate() would
        # bypass its buffer and lose what it already holds).
        out = getattr(self, "first_line", "") + self.proc.stdout.read()
        err = self.proc.stderr.read()
        self.proc.wait(timeout)
        report = json.loads(self.report_file.read_text()) if self.report_file.exists() else {}
        return out.splitlines(), err, report


def check_sequence(lines: list[str]) -> int:
    """The target's output is exactly ready, 0..n-1, done: nothing added, nothing lost."""
    assert lines[0] == "ready" and lines[-1] == "done", lines[:3] + lines[-3:]
    nums = [l.split(" ", 1)[0] for l in lines[1:-1]]
    assert nums == [str(i) for i in range(len(nums))]
    return len(nums)


def losses(lines: list[str]) -> list[str]:
    """The exact (hex) losses a torch-mode target printed, in order."""
    return [l.split(" ", 1)[1] for l in lines[1:-1]]


@pytest.fixture
def start_target(tmp_path):
    procs: list[subprocess.Popen] = []
    script = tmp_path / "target.py"
    script.write_text(TARGET)

    def start(mode: str = "plain", *extra: str, python: str = sys.executable,
              argv_prefix: tuple[str, ...] = (), env: dict | None = None, wait: bool = True,
              drop: tuple[str, ...] = (), **popen) -> Target:
        n = len(procs)
        stop, report = tmp_path / f"stop{n}", tmp_path / f"report{n}.json"
        e = dict(os.environ)
        for k in ("GPUMON", "GPUMON_SOURCE", "GPUMON_GDB", "GPUMON_INJECT_SOURCE", *drop):
            e.pop(k, None)
        e.update(env or {})
        proc = subprocess.Popen([python, *argv_prefix, str(script), str(stop), str(report), mode,
                                 *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=e, cwd=str(tmp_path), **popen)
        procs.append(proc)
        t = Target(proc, stop, report)
        if wait:
            line = proc.stdout.readline()  # blocks until the target is up (torch imported)
            assert line == "ready\n", (line, proc.stderr.read() if proc.poll() is not None else "")
            t.first_line = line
        return t

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        try:
            p.communicate(timeout=10)
        except Exception:
            pass


def old_python() -> str | None:
    """A real Python older than 3.10 on this machine, if there is one."""
    for name in ("python3.9", "python3.8", "python3.7"):
        p = shutil.which(name)
        if p:
            try:
                if subprocess.run([p, "-c", "pass"], capture_output=True, timeout=10).returncode == 0:
                    return p
            except Exception:
                pass
    for p in sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.[6-9]*/bin/python3.[6-9]"))):
        return p
    return None


def other_pythons() -> list[str]:
    """Real Pythons 3.10+ other than this one: one of each other version (PATH, pyenv builds on
    the dev machine), plus the distribution's own builds (/usr/bin/python3.X: no libpython, so
    the debugger finds the C API in the executable itself)."""
    def runs(c: str) -> bool:
        try:
            return subprocess.run([c, "-c", "pass"], capture_output=True, timeout=10).returncode == 0
        except Exception:
            return False
    me = os.path.realpath(sys.executable)
    found: list[str] = []
    for v in ("3.10", "3.11", "3.12", "3.13", "3.14", "3.15"):
        cands = [] if f"{sys.version_info[0]}.{sys.version_info[1]}" == v else (
            [p for p in [shutil.which(f"python{v}")] if p]
            + sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{v}.*/bin/python{v}"))))
        for c in cands:
            if os.path.realpath(c) != me and runs(c):
                found.append(c)
                break
        distro = f"/usr/bin/python{v}"
        if os.path.exists(distro) and os.path.realpath(distro) != me and distro not in found \
                and os.path.realpath(distro) not in map(os.path.realpath, found) and runs(distro):
            found.append(distro)
    return found


