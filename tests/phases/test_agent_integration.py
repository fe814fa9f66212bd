"""Through the real agent (simulated source), a real socket and a real client."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

from gpumon import client

PROG = textwrap.dedent("""
    import os, sys, time
    import gpumon
    gpumon.start(rate_hz=50)
    import torch  # imported after the agent started, like under `gpumon run`
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(m.parameters())
    print("ready", flush=True)
    while True:
        gpumon.mark("data")
        x = torch.randn(4, 8)
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            m(x)
        time.sleep(0.02)
""")


def wait_for(fn, timeout=30.0, what="condition"):
    end = time.monotonic() + timeout
    while True:
        try:
            v = fn()
        except client.AgentError:  # e.g. asked before the extensions registered their commands
            v = None
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def agent_proc():
    env = dict(os.environ, GPUMON_SOURCE="simulated")
    env.pop("GPUMON", None)
    p = subprocess.Popen([sys.executable, "-c", PROG], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        addrs = wait_for(lambda: client.discover(p.pid) or (p.poll() is not None and [None]),
                         what="agent")
        assert addrs != [None], p.communicate()[1].decode()[-2000:]
        p.address = addrs[0]
        yield p
    finally:
        p.kill()
        p.wait()


def test_step_and_breakdown_events_and_status(agent_proc):
    with client.AgentConnection.connect(agent_proc.address) as c:
        # listen from the start: the first steps are always measured and send their events;
        # later ones only one in N (the tracker's budget), which took 10 s more to come
        kinds = set()

        def got_events():
            m = c.recv(timeout=5)
            if m and m.get("type") == "event":
                kinds.add(m["kind"])
            return {"step", "breakdown"} <= kinds
        wait_for(got_events, what="step and breakdown events")

        def status():
            s = c.request("phases_status")
            return s if s.get("installed") and s["steps_done"] >= 3 else None
        st = wait_for(status, what="3 steps")
        assert st["roots"] == ["Sequential"] and st["optimizers"] == ["AdamW"]
        assert not st["discovery"]
        step = st["recent_steps"][-1]
        assert step["forwards"] == 1 and step["backwards"] == 1
        assert {"data", "forward", "backward", "optimizer", "eval"} <= set(step["phases"])
        bd = st["last_breakdown"]["devices"][0]
        assert bd["index"] == "cpu"
        n = 8 * 32 + 32 + 32 * 4 + 4
        assert bd["now"]["parameters"] == 4 * n
        assert bd["now"]["optimizer_state"] == 8 * n + 4 * 4  # + four 4-byte step counters
        now = c.request("phases_breakdown")
        assert now["devices"][0]["now"]["parameters"] == 4 * n


def test_simulated_samples_keep_their_scripted_phase(agent_proc):
    with client.AgentConnection.connect(agent_proc.address) as c:
        wait_for(lambda: c.request("phases_status").get("installed"), what="tracker")
        seen = set()

        def phases():
            m = c.recv(timeout=5)
            if m and m.get("type") == "sample":
                seen.add(m["phase"])
            return len(seen) >= 3
        wait_for(phases, what="sample phases")
        # the simulated memory script's phases, not the CPU loop's (they would not match)
        assert seen <= {"data", "forward", "backward", "optimizer", "zero_grad"}


LAST_STEP_PROG = textwrap.dedent("""
    import sys
    import gpumon
    gpumon.start(rate_hz=50)
    import torch
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(m.parameters())
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(4, 8)).sum().backward()
        opt.step()  # the run ends here: no hook comes after the last step
""")


def test_the_runs_last_step_is_reported_when_the_program_ends():
    """A step is closed at the first hook after its optimizer step; after the run's last step
    none comes, so it was never reported (seen on the GPU: 7 step events for 8 steps). The
    tracker closes it at exit, before the agent's exit event."""
    env = dict(os.environ, GPUMON_SOURCE="simulated", GPUMON_PHASES_BUDGET="0")
    env.pop("GPUMON", None)
    p = subprocess.Popen([sys.executable, "-c", LAST_STEP_PROG], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, stdin=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"ready\n", p.communicate()[1].decode()[-2000:]
        addr = wait_for(lambda: client.discover(p.pid), what="agent")[0]
        steps, ended = [], False
        with client.AgentConnection.connect(addr, timeout=10) as conn:
            wait_for(lambda: conn.request("phases_status").get("installed"), what="tracker")
            p.stdin.write(b"go\n")
            p.stdin.flush()
            while (msg := conn.recv(timeout=30)) is not None:
                if msg.get("type") == "event" and msg.get("kind") == "step":
                    steps.append(msg["step"])
                if msg.get("type") == "event" and msg.get("kind") == "exit":
                    ended = True
                    break
        assert ended and steps == [1, 2, 3], steps
        assert p.wait(timeout=30) == 0 and p.stderr.read() == b""
    finally:
        p.kill()
        p.wait()
