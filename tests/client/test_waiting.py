"""Attached before the program's first CUDA call (here: before it imports torch, the simulated
source's stand-in), every front end says the agent waits, then switches to the agent's stream
by itself, history included. Issue 16: `attach --json` stayed on NVML for the whole run,
`--once` said "no GPU memory in use", `snapshot` and `ls` said there was no agent."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gpumon import client

from .conftest import JsonLines, gpumon, gpumon_popen, wait_for

WAITING = "pid {pid}: gpumon's agent is loaded, waiting for the program's first CUDA call"


def test_json_waits_then_streams_the_agent_then_says_how_it_ended(program):
    p = program()
    a = gpumon_popen("attach", p.pid, "--json")
    js = JsonLines(a)
    first = js.until(lambda m: m.get("kind") == "state", what="a state event")
    assert (first["type"], first["state"], first["pid"]) == ("event", "waiting", p.pid)
    assert first["line"] == WAITING.format(pid=p.pid)
    time.sleep(2)  # attached well before the first CUDA call
    p.import_torch()
    js.until(lambda m: m.get("kind") == "state" and m["state"] == "serving", what="serving")
    s = js.until(lambda m: m["type"] == "sample", what="the agent's first sample")
    assert s["seq"] == 0 and s["pid"] == p.pid  # its history, from its first sample on
    assert s["devices"][0]["allocated"] > 0 and s.get("source") != "nvml"
    before = js.seen[:js.seen.index(s)]
    assert not [m for m in before if m["type"] == "sample" and m.get("source") != "nvml"]
    js.until(lambda m: m["type"] == "sample" and m["seq"] >= 5, what="live samples")
    os.kill(p.pid, signal.SIGTERM)
    ex = js.until(lambda m: m.get("kind") == "exit", what="the exit event")
    assert (ex["pid"], ex["signal"], ex["status"], ex["how"]) == (p.pid, signal.SIGTERM, None,
                                                                  "signal")
    assert ex["line"] == f"pid {p.pid} was killed by SIGTERM"
    rest = js.rest()
    assert [m["state"] for m in rest if m.get("kind") == "state"] == ["exited"]
    assert a.wait(30) == 0
    err = a.stderr.read()
    assert err == f"gpumon: {WAITING.format(pid=p.pid)}\ngpumon: {client.NO_CUDA_YET}\n"


def test_once_waits_for_the_agent(program):
    p = program()
    a = gpumon_popen("attach", p.pid, "--once", "--wait", "60")
    time.sleep(1.5)
    assert a.poll() is None  # still waiting for the agent
    p.import_torch()
    out, err = a.communicate(timeout=90)
    assert a.returncode == 0, err
    assert out.startswith(f"pid {p.pid}  rank -  ") and "source simulated" in out
    assert "  allocated  " in out and "GiB" in out and "NVML only" not in out


def test_once_after_its_wait_prints_nvml_with_the_waiting_line(program, tmp_path):
    from .conftest import fake_nvml
    p = program()
    nv = fake_nvml(tmp_path / "nvml.json", used=7 << 30)
    r = gpumon("attach", p.pid, "--once", "--wait", "0.5", env={"GPUMON_FAKE_NVML": nv})
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0] == WAITING.format(pid=p.pid)
    assert lines[1].startswith("  this program has not used CUDA yet")  # and what to try:
    assert "gpumon demo" in r.stdout and "GPUMON_SOURCE=simulated" in r.stdout
    assert lines[lines.index(f"pid {p.pid} (NVML only)"):] == [
        f"pid {p.pid} (NVML only)",
        "  no GPU memory in use by this process",
        "cuda:0  Fake H100  device used 7.00 GiB of 80.00 GiB (other processes)"]


def test_once_wait_0_where_nvml_does_not_answer_is_quick_and_claims_nothing(program, tmp_path):
    """Issue 32 item 8: `--wait 0` took 5.3 s (a reading NVML never sends was waited for),
    then said "no GPU memory in use" with NVML unavailable."""
    p = program()
    nv = tmp_path / "nvml.json"
    nv.write_text('{"error": "no NVIDIA driver here (NVML\'s library is not found)"}')
    t0 = time.monotonic()
    r = gpumon("attach", p.pid, "--once", "--wait", "0", env={"GPUMON_FAKE_NVML": str(nv)})
    took = time.monotonic() - t0
    assert r.returncode == 0 and took < 3.0, (took, r.stderr)  # 5.3 s before; ~0.15 s now
    assert "no GPU memory in use" not in r.stdout
    assert r.stdout.splitlines()[-1] == "  NVML: no NVIDIA driver here (NVML's library is not found)"


def test_ls_snapshot_and_estimate_check_name_the_waiting_agent(program):
    p = program()
    r = gpumon("ls")
    assert r.returncode == 0
    row = next(line.split() for line in r.stdout.splitlines()[1:] if line.split()[0] == str(p.pid))
    assert row[3] == "waiting"
    assert WAITING.format(pid=p.pid) in r.stdout.splitlines()
    for argv in (["snapshot", p.pid, "--status"],
                 ["estimate", "--params", "1e6", "--check", p.pid]):
        r = gpumon(*argv)
        assert r.returncode != 0 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("gpumon") and WAITING.format(pid=p.pid) in r.stderr


def test_modules_waits_for_the_first_cuda_call_and_says_so(program):
    """`gpumon modules PID` on an agent waiting for CUDA told the user to start the program
    with `gpumon run`, which they had done. It now waits (within --wait) and says what for."""
    p = program()
    r = gpumon("modules", p.pid, "--wait", "1")
    assert r.returncode == 1 and "gpumon run" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [
        f"pid {p.pid}: waiting for the program's first CUDA call; the measurement starts once "
        "it serves (at most --wait 1 s; Ctrl-C: cancel)",
        f"gpumon: {WAITING.format(pid=p.pid)}"]
    # it serves during the wait: the agent is asked (this program trains nothing)
    m = gpumon_popen("modules", p.pid, "--wait", "4")
    time.sleep(1)
    p.import_torch()
    out, err = m.communicate(timeout=60)
    assert m.returncode == 1 and err.splitlines()[-1] == (
        "gpumon: no training step came within 4 s (a step ends with optimizer.step(); the "
        "measurement starts after two of them): cancelled"), err


async def test_the_live_view_waits_then_shows_the_agents_history(program):
    from gpumon.tui.attach_app import AttachApp
    p = program()
    app = AttachApp(client.LocalTarget(p.pid), fps=10)
    loop = asyncio.get_running_loop()

    async def until(cond, timeout=60.0):
        end = loop.time() + timeout
        while not cond():
            assert loop.time() < end, "condition not met in time"
            await pilot.pause(0.05)

    async with app.run_test(size=(100, 30)) as pilot:
        box = app.query_one("#waiting")
        await until(lambda: WAITING.format(pid=p.pid) in str(box.render()))
        await until(lambda: "NVML" in str(box.render()))  # what NVML says (or why not)
        assert not app.panes
        await pilot.press("m")  # per module: it said "older gpumon" of a waiting agent
        said = [n.message for n in app._notifications]
        assert any("waits for the program's first CUDA call: press m once it serves" in m
                   for m in said) and not any("older gpumon" in m for m in said), said
        p.import_torch()
        await until(lambda: app.panes)
        proc = next(iter(app.panes.values())).proc
        await until(lambda: proc.samples >= 3)
        assert proc.source == "simulated" and proc.pid == p.pid
        assert proc.devices[0].series["allocated"].peak > 0
        await until(lambda: app.query_one("#notice").has_class("hidden"))
        os.kill(p.pid, signal.SIGKILL)
        await until(lambda: proc.state.value == "exited")
        assert proc.state_detail == "killed by SIGKILL"


def test_waiting_marker_of_a_killed_agent_is_ignored_and_cleaned(program):
    from gpumon.agent import server
    p = program()
    marker = client.socket_dir() / f"{p.pid}.waiting"
    assert marker.exists()
    os.kill(p.pid, signal.SIGKILL)
    p.proc.wait(10)
    assert marker.exists()  # nothing ran in the program to remove it...
    assert p.pid not in client.scan()  # ...but clients skip it
    assert str(marker) in server.remove_stale_sockets(str(client.socket_dir()))
    assert not marker.exists()


def test_attach_at_once_after_gpumon_run(program, tmp_path):
    """`gpumon run -- python prog.py &` then at once `gpumon attach $!`: the pid may still be
    gpumon run itself (it execs the command a moment later). Seen: --json said "no gpumon agent,
    and NVML unavailable" and gave up."""
    nv = tmp_path / "nvml.json"
    nv.write_text('{"error": "NVML unavailable: NVMLError_LibraryNotFound"}')
    p = program(wait=False, env={"GPUMON_FAKE_NVML": str(nv)})
    a = gpumon_popen("attach", p.pid, "--json", env={"GPUMON_FAKE_NVML": str(nv)})
    js = JsonLines(a)
    first = js.until(lambda m: m.get("kind") == "state", what="a state event")
    assert first["state"] == "waiting", first
    if first["line"] != WAITING.format(pid=p.pid):  # (its agent may have loaded before our poll)
        js.until(lambda m: m.get("kind") == "state" and m["line"] == WAITING.format(pid=p.pid),
                 what="the agent's waiting marker")
    p.import_torch()
    js.until(lambda m: m["type"] == "sample" and m.get("source") != "nvml", what="samples")
    a.terminate()
    a.wait(30)


def test_gpumon_run_before_its_exec_is_a_start_not_a_process_without_agent(monkeypatch):
    """The moment between `gpumon run`'s start and its exec (the test above may miss it):
    the process is Python, without GPUMON=1 yet, and is no plain process without an agent."""
    import subprocess
    import sys
    from gpumon.client import procs, target
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert target.classify(p.pid)[0] == client.NO_AGENT
        monkeypatch.setattr(procs, "argv", lambda pid: [sys.executable, "-m", "gpumon", "run",
                                                        "--", "python", "train.py"])
        assert target.classify(p.pid) == (client.WAITING,
                                           f"pid {p.pid} is gpumon run, starting its command")
    finally:
        p.kill()
        p.wait()


def test_once_on_a_program_that_ends_while_waiting_says_it_ended(program):
    """A CPU-only program under gpumon run (its agent waits for CUDA for ever) that ended while
    attach --once waited: it said "its agent did not start" (the agent removes its marker at
    exit, a moment before the process is gone) and printed an NVML table of a dead process."""
    p = program(env={"GPUMON_SOURCE": "torch"})
    p.import_torch()  # a CPU build: never a CUDA call
    a = gpumon_popen("attach", p.pid, "--once", "--wait", "60")
    time.sleep(1.0)
    p.end()
    out, err = a.communicate(timeout=60)
    assert a.returncode == 1 and out == "", (out, err)
    assert err.startswith(f"gpumon: pid {p.pid} exited with status 0; it never used CUDA"), err
    assert err.count("\n") == 1


def test_a_program_that_ends_without_using_cuda_is_said_to_have_never_used_it(program):
    """Issue 32 item 1: the program ended and nothing said why there were never figures."""
    p = program(end="exit:0", torch=False, env={"GPUMON_SIM_READY": "torch"})  # never ready
    a = gpumon_popen("attach", p.pid, "--json")
    js = JsonLines(a)
    js.until(lambda m: m.get("kind") == "state" and m["state"] == "waiting", what="waiting")
    p.end()  # it ends without ever importing torch (the simulated source's first CUDA call)
    ex = js.until(lambda m: m.get("kind") == "exit", what="the exit event")
    assert ex["line"].startswith(f"pid {p.pid} ")
    assert "it never used CUDA, so gpumon had no figures of it" in ex["line"]
    assert a.wait(30) == 0


TRAINS_AFTER_GO = """
import os, sys, time
go = sys.argv[1]
print("started", flush=True)
while not os.path.exists(go):
    time.sleep(0.02)
import torch  # the simulated source's first CUDA call
print("ready", time.time(), flush=True)
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(600):
    model(torch.ones(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)
"""


def test_snapshot_steps_before_cuda_is_armed_and_records_the_first_steps(tmp_path):
    """Issue 32 item 2: `gpumon snapshot PID --steps 1` while the program builds its model
    refused (status 1); it waits, armed and saying so, and records the first steps."""
    pytest.importorskip("torch")
    go = tmp_path / "go"
    env = dict(os.environ, GPUMON_SOURCE="simulated", GPUMON_RATE="20", GPUMON_SIM_READY="torch")
    prog = subprocess.Popen([sys.executable, "-m", "gpumon", "run", "--", sys.executable, "-c",
                             TRAINS_AFTER_GO, str(go)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=tmp_path)
    try:
        assert prog.stdout.readline() == "started\n"
        wait_for(lambda: client.scan().get(prog.pid), what="its waiting agent")
        out = tmp_path / "first.pickle"
        a = gpumon_popen("snapshot", prog.pid, "--steps", "2", "-o", out)
        time.sleep(1.5)
        assert a.poll() is None  # armed, waiting
        go.touch()
        stdout, err = a.communicate(timeout=90)
        assert a.returncode == 0, err
        assert err.startswith(f"pid {prog.pid}: waiting for the program's first CUDA call; "
                              "the recording is armed and starts then"), err
        assert stdout.strip() == str(out)
        meta = json.loads(out.with_name(out.name + ".json").read_text())
        assert meta["steps"] == 2
        ready = float(prog.stdout.readline().split()[1])
        print(f"recording started {meta['since'] - ready:.2f} s after the first CUDA call")
    finally:
        prog.kill()
        prog.wait(10)
        prog.stdout.close()
