"""Real programs for the client's tests: started as a user would (`gpumon run -- python ...`),
with the simulated source waiting, as the torch source waits for CUDA, until the program
imports torch; the test decides when (it touches a file)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from gpumon import client
from polling import wait_for  # noqa: F401 (tests import it from here)

# Waits for GO to exist, then imports torch (the simulated source's stand-in for the first
# CUDA call; GO "-": neither), then runs until STOP exists; then ends as END says: "exit:N",
# "raise", or (anything else) a normal end.
PROGRAM = textwrap.dedent("""
    import os, sys, time
    go, stop, end = sys.argv[1], sys.argv[2], sys.argv[3]
    print("started", flush=True)
    if go != "-":
        while not os.path.exists(go):
            time.sleep(0.02)
        import torch
        print("imported torch", flush=True)
    while not os.path.exists(stop):
        time.sleep(0.02)
    if end == "raise":
        raise ValueError("boom")
    if end.startswith("exit:"):
        sys.exit(int(end[5:]))
""")


class Program:
    def __init__(self, proc: subprocess.Popen, go, stop) -> None:
        self.proc, self.go, self.stop = proc, go, stop
        self.pid = proc.pid

    def import_torch(self) -> None:
        self.go.touch()

    def end(self) -> None:
        self.stop.touch()


@pytest.fixture
def program(tmp_path):
    """start(end="run", env=None, wait=True): the program under `gpumon run`, its agent
    loaded and waiting (its marker there) when wait."""
    started: list[Program] = []

    def start(end: str = "run", env: dict | None = None, wait: bool = True,
              under: list[str] | None = None, torch: bool = True) -> Program:
        """torch=False: the agent serves at once and the program never imports torch."""
        if torch:
            pytest.importorskip("torch")
        n = len(started)
        go, stop = tmp_path / f"go{n}", tmp_path / f"stop{n}"
        e = dict(os.environ, GPUMON_SOURCE="simulated", GPUMON_RATE="20",
                 GPUMON_SIM_READY="torch" if torch else "now")
        e.update(env or {})
        cmd = [sys.executable, "-m", "gpumon", "run", "--", sys.executable, "-c", PROGRAM,
               str(go) if torch else "-", str(stop), end]
        proc = subprocess.Popen((under or []) + cmd, env=e, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                cwd=tmp_path)  # its snapshots land here, not in the checkout
        p = Program(proc, go, stop)
        started.append(p)
        if wait and under is None:
            assert proc.stdout.readline() == "started\n", proc.stderr.read()
            wait_for(lambda: client.scan().get(proc.pid), what="its agent's file")
        return p

    yield start
    for p in started:
        p.stop.touch()
        p.go.touch()
        if p.proc.poll() is None:
            p.proc.kill()
        p.proc.wait(20)
        for f in (p.proc.stdout, p.proc.stderr):
            f.close()


def gpumon(*args, timeout=60, env=None, **kw):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "gpumon", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=e,
                          stdin=kw.pop("stdin", subprocess.DEVNULL), **kw)


def gpumon_popen(*args, env=None, **kw):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "gpumon", *map(str, args)], env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, **kw)


class JsonLines:
    """`attach --json` output, read by a thread; until(pred) waits for a matching line."""

    def __init__(self, proc: subprocess.Popen) -> None:
        import queue
        import threading
        self.proc = proc
        self.seen: list[dict] = []
        self._q: queue.Queue = queue.Queue()

        def read() -> None:
            for line in proc.stdout:
                self._q.put(json.loads(line))
            self._q.put(None)
        threading.Thread(target=read, daemon=True).start()

    def until(self, pred, timeout: float = 60.0, what: str = "a line") -> dict:
        import queue
        end = time.monotonic() + timeout
        while True:
            try:
                m = self._q.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {what} within {timeout} s; last: {self.seen[-3:]}")
            if m is None:
                raise AssertionError(f"EOF before {what}; last: {self.seen[-3:]}")
            self.seen.append(m)
            if pred(m):
                return m

    def rest(self, timeout: float = 30.0) -> list[dict]:
        """Everything until EOF (the command ends by itself)."""
        import queue
        out = []
        end = time.monotonic() + timeout
        while True:
            try:
                m = self._q.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no EOF within {timeout} s; last: {out[-3:]}")
            if m is None:
                return out
            self.seen.append(m)
            out.append(m)


def fake_nvml(path, processes: dict | None = None, used: int = 5 << 30) -> str:
    """A file for GPUMON_FAKE_NVML: one 80 GiB GPU; processes: {pid: bytes on GPU 0}."""
    path.write_text(json.dumps({
        "gpus": [{"name": "Fake H100", "total": 80 << 30, "used": used}],
        "processes": {str(pid): {"0": b} for pid, b in (processes or {}).items()}}))
    return str(path)
