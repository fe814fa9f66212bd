"""`gpumon ls`, `gpumon attach --json/--once`, bad pids, `gpumon demo --once`, and a fake
launcher with two simulated ranks (the core side of multi-GPU runs), all as real commands."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from gpumon import client

from .conftest import gpumon_cmd, wait_for


def lines_of(r):
    return r.stdout.splitlines()


def test_ls_lists_agents_with_their_columns(spawn):
    p = spawn(rate=20, env={"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"})
    q = spawn(rate=20)
    r = gpumon_cmd("ls")
    assert r.returncode == 0 and r.stderr == ""
    head, *rows = lines_of(r)
    assert head.split() == ["PID", "RANK", "DEVICES", "STATE", "AGE", "COMMAND"]
    by_pid = {int(row.split()[0]): row.split() for row in rows}
    assert set(by_pid) == {p.pid, q.pid}
    assert by_pid[p.pid][1:4] == ["3/8", "1", "(sim)"]  # LOCAL_RANK picks the simulated device
    assert by_pid[q.pid][1:4] == ["-", "0", "(sim)"]
    assert by_pid[p.pid][4] in ("sleeping", "running", "disk-sleep")
    assert "python" in by_pid[p.pid][6]
    js = json.loads(gpumon_cmd("ls", "--json").stdout)
    row = next(x for x in js if x["pid"] == p.pid)
    assert (row["rank"], row["local_rank"], row["world_size"], row["devices"]) == (3, 1, 8, [1])
    assert row["source"] == "simulated" and row["error"] is None and row["age"] >= 0


def test_ls_with_no_agents_says_where_it_looked():
    r = gpumon_cmd("ls")
    assert r.returncode == 0 and "no gpumon agents" in r.stdout and os.environ["GPUMON_DIR"] in r.stdout
    assert json.loads(gpumon_cmd("ls", "--json").stdout) == []


def test_attach_json_streams_one_object_per_sample_until_ctrl_c(spawn):
    p = spawn(rate=50)
    wait_for(lambda: client.AgentConnection.connect(p.address).request("status")["seq"] > 10,
             what="some history")
    a = subprocess.Popen([sys.executable, "-m", "gpumon", "attach", str(p.pid), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        msgs = [json.loads(a.stdout.readline()) for _ in range(40)]
    finally:
        a.send_signal(signal.SIGINT)
        rc = a.wait(20)
        err = a.stderr.read()
        a.stdout.close(), a.stderr.close()
    samples = [m for m in msgs if m["type"] == "sample"]
    seqs = [m["seq"] for m in samples]
    assert len(samples) >= 35 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert seqs[0] == 0  # the history came first
    assert all(m["pid"] == p.pid and "rank" in m for m in msgs)
    assert samples[-1]["devices"][0]["allocated"] > 0
    assert rc == 130 and err == "gpumon: interrupted (Ctrl-C); nothing to undo\n"


def test_attach_once_prints_the_figures_and_exits(spawn):
    p = spawn(rate=50)
    r = gpumon_cmd("attach", str(p.pid), "--once")
    assert r.returncode == 0 and r.stderr == ""
    out = r.stdout
    assert out.startswith(f"pid {p.pid}  rank -  ")
    assert "source simulated" in out and "cuda:0  Simulated GPU (no CUDA)" in out
    for label in ("allocated", "reserved", "active", "cache (reserved - allocated)",
                  "device used (NVML)", "this process (NVML)", "alloc retries / OOMs"):
        assert f"  {label}" in out, label
    assert "GiB" in out and "agent cost" in out


def test_attach_once_fits_80_columns_without_losing_words():
    """`attach --once` printed the source line at 127 characters (the demo's note, torch, the
    allocator and the rate on one line) and the pid line at 92 (the command cut at 60 whatever
    came before it). Every line fits 80; the command is cut between words, the rest wraps."""
    import time
    from gpumon.commands.core import format_once
    note = "simulated workload (torch is not installed), GPU memory scripted to look like a run"
    hello = {"pid": 4242, "rank": 3, "world_size": 8, "start_time": time.time() - 75,
             "argv": ["/home/someone/.venvs/project/bin/python3", "-m", "train_my_model",
                      "--config", "configs/llama-7b-long-context.yaml"],
             "source": "simulated", "demo": note, "torch": "2.13.0+cpu", "rate_hz": 10.0,
             "allocator": {"backend": "native", "expandable_segments": False},
             "nvml": "x" * 10}
    sample = {"devices": [{"index": 0, "allocated": 1 << 30, "reserved": 2 << 30,
                           "nvml_total": 24 << 30, "alloc_retries": 0, "ooms": 0}],
              "phase": "forward", "step": 3, "cost_us": 70.1}
    out = format_once(hello, sample)
    long = [ln for ln in out.splitlines() if len(ln) > 80]
    assert not long, long
    first = out.splitlines()[0]
    assert first.startswith("pid 4242  rank 3/8  running  up 1m15s  /home/someone"), first
    cmd = first.split("  ")[-1]
    assert cmd.endswith("…") and cmd[:-1].split() == " ".join(hello["argv"]).split()[
        :len(cmd[:-1].split())], cmd  # whole words, then the ellipsis
    words = " ".join(out.split())
    assert f"source simulated ({note})" in words  # wrapped, not cut
    assert "expandable_segments False 10.0 Hz" in words


def test_a_command_line_argparse_refuses_is_one_gpumon_line_and_status_2():
    """argparse's refusals printed its usage block and then "gpumon: error: ...": several lines
    where every other error is one. Each is one `gpumon: ` line naming the command's --help."""
    from gpumon.cli import main
    import contextlib
    import io
    cases = {("ls", "--bogus"): "gpumon ls --help", ("attach", "1", "--bogus"): "gpumon attach",
             ("bogus",): "gpumon --help", ("view",): "gpumon view --help",
             ("attach", "--hosts"): "gpumon attach --help",
             ("snapshot", "1", "--seconds", "abc"): "gpumon snapshot --help",
             ("estimate", "--batch", "x"): "gpumon estimate --help"}
    for argv, names in cases.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            with pytest.raises(SystemExit) as e:
                main(list(argv))
        lines = err.getvalue().splitlines()
        assert e.value.code == 2, (argv, e.value.code)
        assert len(lines) == 1 and lines[0].startswith("gpumon: ") and names in lines[0], (
            argv, lines)


@pytest.mark.parametrize("flag", ["--once", "--json", None])
def test_attach_to_a_pid_that_does_not_exist_is_one_line(flag, python):
    dead = subprocess.Popen([python, "-c", "pass"])
    dead.wait()
    r = gpumon_cmd("attach", str(dead.pid), *([flag] if flag else []))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == f"gpumon: no process with pid {dead.pid}\n"


def test_attach_to_a_zombie_is_one_line(python):
    # A child that exited but was not reaped: the process is dead, its pid still there.
    parent = subprocess.Popen([python, "-c", textwrap.dedent("""
        import os, sys, time
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        print(pid, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        zpid = int(parent.stdout.readline())
        r = gpumon_cmd("attach", str(zpid), "--once")
        assert r.returncode == 1 and r.stderr == f"gpumon: process {zpid} has exited (zombie)\n"
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_attach_to_a_process_without_agent_and_without_nvml(python, tmp_path):
    fake = tmp_path / "nvml.json"  # the client's fake NVML, saying NVML can't be used
    fake.write_text(json.dumps({"error": "NVML unavailable: libnvidia-ml.so.1 not found"}))
    p = subprocess.Popen([python, "-c", "import time; time.sleep(60)"])
    try:
        for flag in ("--once", "--json"):
            r = gpumon_cmd("attach", str(p.pid), flag, env={"GPUMON_FAKE_NVML": str(fake)})
            assert r.returncode == 1 and r.stdout == ""
            assert r.stderr == (f"gpumon: no gpumon agent in process {p.pid}, and NVML "
                                "unavailable: libnvidia-ml.so.1 not found\n")
    finally:
        p.kill()
        p.wait()


def test_attach_without_a_terminal_says_what_to_do(spawn):
    p = spawn(rate=20)
    r = gpumon_cmd("attach", str(p.pid))  # stdout is a pipe here
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--json" in r.stderr and "srun --pty" in r.stderr


def test_a_peer_of_another_uid_is_refused(monkeypatch):
    """SO_PEERCRED says another user: the agent answers one error line and closes."""
    from gpumon.agent import core, server
    from gpumon.agent.sources import SimulatedSource

    real = server.peer_credentials
    monkeypatch.setattr(server, "peer_credentials",
                        lambda s: (real(s)[0], os.getuid() + 4242, 0))
    a = core.Agent(SimulatedSource(devices=[0]), rate_hz=20)
    a.start()
    try:
        wait_for(lambda: a.serving.is_set(), what="serving")
        with pytest.raises(client.AttachError, match="refused: permission denied: not the same user"):
            client.AgentConnection.connect(a.socket_path)
        assert a.status()["clients"] == []
    finally:
        a.stop()


def test_socket_dir_is_private(tmp_path, monkeypatch):
    from gpumon.agent.core import socket_dir
    base = tmp_path / "sockets"
    monkeypatch.setenv("GPUMON_DIR", str(base))
    d = base / f"gpumon-{os.getuid()}"
    assert socket_dir(create=True) == d and (d.stat().st_mode & 0o777) == 0o700
    assert (base.stat().st_mode & 0o777) == 0o700  # a GPUMON_DIR that did not exist is made private
    d.chmod(0o775)
    with pytest.raises(PermissionError, match="writable by others"):
        socket_dir(create=True)
    assert (d.stat().st_mode & 0o777) == 0o775  # refused, never chmod'ed


def test_demo_once_trains_on_the_cpu_with_simulated_gpu_memory():
    pytest.importorskip("torch")
    r = gpumon_cmd("demo", "--once", "--cpu", timeout=180)
    assert r.returncode == 0, r.stderr
    assert "source simulated (training on the CPU; GPU memory simulated (no CUDA here))" in r.stdout
    assert "allocated" in r.stdout and "phase" in r.stdout
    assert client.discover() == []  # the workload was stopped, its socket removed


# -- a launcher with two simulated ranks (torchrun's shape) -----------------------------------
LAUNCHER = r"""
import os, signal, subprocess, sys
rank_prog = "import time\n" + ("import gpumon; gpumon.start(rate_hz=20)\n" if sys.argv[1] == "start" else "") + "time.sleep(120)"
kids = []
for r in range(2):
    env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
               GPUMON_SOURCE="simulated")
    kids.append(subprocess.Popen([sys.executable, "-c", rank_prog], env=env))

def stop(*a):
    for k in kids:
        k.terminate()
    os._exit(0)  # not k.wait(): the main thread is inside it, holding its lock

signal.signal(signal.SIGTERM, stop)
print(" ".join(str(k.pid) for k in kids), flush=True)
for k in kids:
    k.wait()
"""


@pytest.fixture
def launcher(python):
    started = []

    def start(how):
        cmd = [python, "-c", LAUNCHER, how]
        if how == "run":  # every rank gets its agent from `gpumon run`'s bootstrap
            cmd = [python, "-m", "gpumon", "run", "--"] + cmd
        env = {k: v for k, v in os.environ.items() if k not in ("GPUMON", "GPUMON_SOURCE")}
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        started.append(p)
        p.ranks = [int(x) for x in p.stdout.readline().split()]
        wait_for(lambda: len(client.discover(p.pid)) == 2, what="two rank agents")
        return p

    yield start
    for p in started:
        p.terminate()
        p.wait(20)
        p.stdout.close()


@pytest.mark.parametrize("how", ["start", "run"])
def test_discover_a_launcher_finds_its_ranks_in_rank_order(launcher, how):
    p = launcher(how)
    found = client.discover(p.pid)
    assert [a.pid for a in found] == p.ranks  # rank 0 first; the launcher itself serves nothing
    hellos = []
    for a in found:
        with client.AgentConnection.connect(a) as c:
            hellos.append((c.hello["rank"], c.hello["local_rank"], c.hello["world_size"],
                           [d["index"] for d in c.hello["devices"]]))
    assert hellos == [(0, 0, 2, [0]), (1, 1, 2, [1])]


def test_ls_and_attach_show_every_rank(launcher):
    p = launcher("start")
    rows = {int(l.split()[0]): l.split()[1] for l in lines_of(gpumon_cmd("ls"))[1:]}
    assert rows == {p.ranks[0]: "0/2", p.ranks[1]: "1/2"}
    r = gpumon_cmd("attach", str(p.pid), "--once")
    assert r.returncode == 0, r.stderr
    blocks = r.stdout.split("\n\n")
    assert [b.split()[1] for b in blocks] == [str(x) for x in p.ranks]
    assert "rank 0/2" in blocks[0] and "cuda:0" in blocks[0]
    assert "rank 1/2" in blocks[1] and "cuda:1" in blocks[1]
    # --json of the launcher: both ranks' samples, each tagged with its pid and rank.
    a = subprocess.Popen([sys.executable, "-m", "gpumon", "attach", str(p.pid), "--json"],
                         stdout=subprocess.PIPE, text=True)
    seen = set()
    try:
        while seen != {0, 1}:
            m = json.loads(a.stdout.readline())
            seen.add(m["rank"])
    finally:
        a.send_signal(signal.SIGINT)
        a.wait(20)
        a.stdout.close()


def test_a_rank_that_dies_leaves_the_others(launcher):
    p = launcher("start")
    os.kill(p.ranks[1], signal.SIGKILL)
    wait_for(lambda: [a.pid for a in client.discover(p.pid)] == [p.ranks[0]],
             what="the dead rank gone from discovery")
    r = gpumon_cmd("attach", str(p.pid), "--once")
    assert r.returncode == 0 and "rank 0/2" in r.stdout and "rank 1/2" not in r.stdout


def test_another_users_process_is_one_clear_line(monkeypatch, python):
    """check_pid, as a non-root user would see a process of root (this test may run as root:
    it pretends to be uid 4242 looking at a process it started)."""
    p = subprocess.Popen([python, "-c", "import time; time.sleep(60)"])
    try:
        real_uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real_uid + 4242)
        with pytest.raises(client.AttachError) as e:
            client.check_pid(p.pid)
        msg = str(e.value)
        assert msg.startswith(f"process {p.pid} belongs to ") and "run gpumon as that user" in msg
        assert "\n" not in msg
    finally:
        p.kill()
        p.wait()


def test_attach_where_textual_is_missing_is_one_line(spawn, monkeypatch, capsys):
    """The GPU node may have torch but not Textual: the live view says so, in one line."""
    from gpumon import cli
    p = spawn(rate=20)
    monkeypatch.setitem(sys.modules, "gpumon.tui.attach_app", None)  # import fails
    import gpumon.tui  # ... also where an earlier test imported it (the package attribute)
    monkeypatch.delattr(gpumon.tui, "attach_app", raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert cli.main(["attach", str(p.pid)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install textual" in err and "--json" in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("cmd", [["estimate", "--params", "1e9", "--batch", "1", "--seq", "128"],
                                 ["ls"]])
def test_a_full_disk_under_stdout_is_one_line_and_status_1(cmd):
    """`gpumon ... > file` on a full disk: one `gpumon:` line, exit 1, no traceback (it was a
    traceback through sys.stdout.write, and a second one at exit for what stdout still held)."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "gpumon", *cmd], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == ["gpumon: cannot write the output: No space left on device"]
