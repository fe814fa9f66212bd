"""Running one program plainly and with gpumon, to compare what the program itself sees.

Shared by tests/compat/ (the model operations of victim.py; the process side reuses ``run_mode``
and ``compare`` with a script of its own). Imports nothing of gpumon at module level: a script
run by it may import ``start_if_asked`` / ``wait_if_asked`` from here and stay gpumon-free.

Modes (MODES): ``plain`` (no gpumon: the reference), ``run`` (``gpumon run -- python SCRIPT``),
``start`` (the script calls ``gpumon.start(source="simulated")`` first: COMPAT_START=1, which a
script of its own must honour, e.g. with ``start_if_asked()``), ``inject`` (the script is started
plainly, waits at COMPAT_WAIT, and ``gpumon inject`` puts the agent in meanwhile; needs gdb: see
``inject_skip()``). Every run gets the simulated memory source, a clean environment (no GPUMON*,
COMPAT* of the caller) and its own report file ($COMPAT_REPORT).

``compare(ref, got)`` says what differs: exit status, stdout (line by line), stderr (after
dropping the parts that differ between any two runs: torch's log prefixes with time and pid).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VICTIM = Path(__file__).with_name("victim.py")
MODES = ("plain", "run", "start", "inject")


def inject_skip() -> str:
    """Why inject mode can't run here ("" when it can): the debugger gpumon would use."""
    try:
        from gpumon import inject
        gdb = inject.find_debugger()
        inject._check_gdb_can_call(gdb)
        if os.path.basename(gdb) == "cuda-gdb":  # the H100 machine: did not finish in 60 s
            return "only cuda-gdb here (too slow to attach within the suite's 60 s; docs/inject.md)"
        return ""
    except Exception as e:
        return f"gpumon inject can't run here: {e}"



@dataclass
class Outcome:
    mode: str
    rc: int
    stdout: str
    stderr: str
    report: dict | None          # what the script wrote to $COMPAT_REPORT (None: nothing)
    seconds: float
    notes: list = field(default_factory=list)

    def lines(self) -> list[str]:
        return self.stdout.splitlines()


def clean_env(extra: dict | None = None) -> dict:
    """The caller's environment without gpumon's or the suite's variables, with the checkout
    first on PYTHONPATH and the simulated source."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("GPUMON", "COMPAT"))}
    if "GPUMON_DIR" in os.environ:  # the tests' own socket folder (tests/conftest.py)
        e["GPUMON_DIR"] = os.environ["GPUMON_DIR"]
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)])
    e["GPUMON_SIM_READY"] = "now"
    e.update(extra or {})
    return e


def run_mode(mode: str, args: list[str], workdir: Path, *, script: Path = VICTIM,
             env: dict | None = None, timeout: float = 300.0) -> Outcome:
    """Run ``python SCRIPT ARGS`` in ``mode``; its outcome. ``workdir`` is its cwd."""
    workdir.mkdir(parents=True, exist_ok=True)
    report = workdir / f"report-{mode}.json"
    e = clean_env(env)
    e["COMPAT_REPORT"] = str(report)
    py = [sys.executable, str(script), *args]
    notes: list = []
    t0 = time.monotonic()
    if mode == "plain":
        argv = py
    elif mode == "run":
        argv = [sys.executable, "-m", "gpumon", "run", "--", *py]
        e["GPUMON_SOURCE"] = "simulated"
    elif mode == "start":
        argv = py
        e["COMPAT_START"] = "1"
    elif mode == "inject":
        return _run_injected(py, e, workdir, report, timeout, t0)
    else:
        raise ValueError(mode)
    r = subprocess.run(argv, env=e, cwd=str(workdir), capture_output=True, text=True,
                       timeout=timeout)
    return Outcome(mode, r.returncode, r.stdout, r.stderr, _read(report),
                   time.monotonic() - t0, notes)


def _run_injected(py: list, e: dict, workdir: Path, report: Path, timeout: float,
                  t0: float) -> Outcome:
    from gpumon import inject
    go = workdir / "go"
    e["COMPAT_WAIT"] = str(go)
    p = subprocess.Popen(py, env=e, cwd=str(workdir), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    notes = []
    try:
        ready = Path(str(go) + ".ready")
        end = time.monotonic() + 120
        while not ready.exists() and p.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        if p.poll() is None:
            sock = inject.inject(p.pid, timeout=60, source="simulated")
            notes.append(f"injected: {sock}")
    finally:
        go.touch()  # the script goes on, injected or not (the comparison then says why)
    out, err = p.communicate(timeout=timeout)
    return Outcome("inject", p.returncode, out, err, _read(report), time.monotonic() - t0, notes)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# torch's own log lines carry a time and a pid ("W1206 13:57:04.898000 26030 torch/...")
_TORCH_LOG = re.compile(r"^([DIWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")


def normal_stderr(text: str) -> list[str]:
    return [_TORCH_LOG.sub(r"\1 ", line) for line in text.splitlines()]


def compare(ref: Outcome, got: Outcome) -> list[str]:
    """What the program saw differently with gpumon (empty: nothing)."""
    diffs = []
    if got.rc != ref.rc:
        diffs.append(f"exit status {got.rc} (plain: {ref.rc})")
    a, b = ref.lines(), got.lines()
    for i in range(max(len(a), len(b))):
        la = a[i] if i < len(a) else "<none>"
        lb = b[i] if i < len(b) else "<none>"
        if la != lb:
            diffs.append(f"stdout line {i + 1}: {lb!r} (plain: {la!r})")
    sa, sb = normal_stderr(ref.stderr), normal_stderr(got.stderr)
    if sa != sb:
        extra = [l for l in sb if l not in sa][:5]
        lost = [l for l in sa if l not in sb][:5]
        diffs.append(f"stderr differs: added {extra}, lost {lost}")
    return diffs


def start_if_asked() -> None:
    """For a script of one's own: start the agent as a program would (COMPAT_START=1), with the
    simulated source unless COMPAT_SOURCE names another (``torch``: a GPU test's real one)."""
    if os.environ.get("COMPAT_START") == "1":
        import gpumon
        gpumon.start(source=os.environ.get("COMPAT_SOURCE", "simulated"))


def wait_if_asked(suffix: str = "") -> None:
    """For a script of one's own: stop at COMPAT_WAIT until the injection is done (a second
    stop: another ``suffix``, its own file)."""
    wait = os.environ.get("COMPAT_WAIT")
    if wait:
        wait += suffix
        open(wait + ".ready", "w").close()
        end = time.time() + 120
        while not os.path.exists(wait) and time.time() < end:
            time.sleep(0.02)
