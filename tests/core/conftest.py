"""Helpers: real agent processes (simulated source) and polling without fixed sleeps."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from gpumon import client
from polling import wait_for

AGENT_PROG = """
import os, sys, time, signal
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
import gpumon
a = gpumon.start(rate_hz=float(os.environ.get("T_RATE", "50")), **eval(os.environ.get("T_KW", "{}")))
{body}
while True:
    time.sleep(0.1)
"""




class Spawner:
    def __init__(self):
        self.procs = []

    def __call__(self, body="", rate=50, env=None, kw=None, wait=True, source="simulated",
                 argv=None):
        e = dict(os.environ)
        e["GPUMON_SOURCE"] = source
        e["T_RATE"] = str(rate)
        e["T_KW"] = repr(kw or {})
        e.pop("GPUMON", None)
        e.update(env or {})
        cmd = argv or [sys.executable, "-c", AGENT_PROG.replace("{body}", textwrap.dedent(body))]
        p = subprocess.Popen(cmd, env=e, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        self.procs.append(p)
        if wait:
            addrs = wait_for(lambda: client.discover(p.pid) or (p.poll() is not None and [None]),
                             what=f"agent of pid {p.pid}")
            if addrs == [None]:
                out, err = p.communicate()
                raise AssertionError(f"agent process died: {err.decode()[-2000:]}")
            p.address = addrs[0]
        return p

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for f in (p.stdout, p.stderr):
                if f:
                    f.close()


@pytest.fixture
def spawn():
    s = Spawner()
    yield s
    s.close()


def recv_type(conn, typ, timeout=10.0):
    end = time.monotonic() + timeout
    while True:
        m = conn.recv(timeout=max(0.01, end - time.monotonic()))
        assert m is not None, "EOF before a message of type " + typ
        if m["type"] == typ:
            return m


def read_history(conn, timeout=10.0):
    samples = []
    while True:
        m = recv_type(conn, "history", timeout)
        samples.extend(m["samples"])
        if m["last"]:
            return samples


def gpumon_cmd(*args, timeout=60, env=None, **kw):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "gpumon", *args], capture_output=True,
                          text=True, timeout=timeout, env=e, **kw)
