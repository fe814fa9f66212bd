"""Injection into real Python processes started without gpumon: the agent arrives, serves real
samples over its real socket, leaves again, and the target's output is exactly what it would
have been. Every failure is one clear line and leaves the target running."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from gpumon import client, inject
from gpumon.inject import InjectError

from .conftest import check_sequence, losses, old_python, other_pythons, wait_until

def _debugger() -> tuple[str | None, str]:
    """The debugger gpumon would use here ($GPUMON_GDB, gdb, cuda-gdb) and can call with on this
    CPU, or None and why not."""
    try:
        gdb = inject.find_debugger()
        inject._check_gdb_can_call(gdb)  # gdb < 14 on an AMX CPU: gpumon refuses it, so skip
        return gdb, ""
    except InjectError as e:
        return None, f"{e} (GPUMON_GDB=a gdb from scripts/make_gdb_bundle.sh)"


DEBUGGER, NO_DEBUGGER = _debugger()
needs_gdb = pytest.mark.skipif(DEBUGGER is None, reason=NO_DEBUGGER)
is_root = os.geteuid() == 0


def read_samples(path, n=5, timeout=10.0):
    with client.AgentConnection.connect(path, timeout=timeout) as conn:
        got = []
        for s in conn.samples(timeout=timeout):
            got.append(s)
            if len(got) >= n:
                break
        return conn.hello, got


@needs_gdb
def test_inject_read_detach_into_torch_process(start_target, gpumon_dir):
    ref = start_target("torch")  # the same training, never injected: its losses are the truth
    # Without GPUMON_DIR of its own, the agent is told where the client looks, and detach puts
    # the environment back as it was.
    t = start_target("torch", drop=("GPUMON_DIR",))
    sock = inject.inject(t.pid, timeout=15, source="simulated")
    assert sock == gpumon_dir / f"{t.pid}.sock" and sock.exists()
    with client.AgentConnection.connect(sock, timeout=10) as conn:
        # The phases part hooks the model while the agent is in (torch is imported).
        st = wait_until(lambda: conn.request("phases_status", timeout=10).get("installed"))
        assert st, conn.request("phases_status", timeout=10)
    hello, samples = read_samples(sock, n=5)
    assert hello["pid"] == t.pid and hello["source"] == "simulated"
    assert "detach" in hello["commands"]
    assert len(samples) == 5 and all(s["devices"] for s in samples)
    seqs = [s["seq"] for s in samples]
    assert seqs == sorted(seqs)
    assert inject.inject(t.pid, timeout=15) == sock  # a second inject finds the same agent
    inject.detach(t.pid)
    assert not sock.exists()
    assert client.discover(t.pid) == []
    # It keeps running after the detach, and its output is exactly its own.
    time.sleep(0.2)
    assert t.proc.poll() is None
    lines, err, report = t.finish()
    ref_lines, ref_err, _ = ref.finish()
    n = min(check_sequence(lines), check_sequence(ref_lines))
    assert n >= 10
    assert losses(lines)[:n] == losses(ref_lines)[:n]  # bit for bit
    assert err == "" and ref_err == ""
    assert report["sys_path_same"] and report["env_gpumon"] == []
    assert report["hooks"] == 0, "detach must take out every torch hook"
    assert not [n for n in report["threads"] if n.startswith("gpumon")], report["threads"]
    assert not [f for f in os.listdir(gpumon_dir) if ".inject-" in f]  # no leftovers


@needs_gdb
def test_cli_attach_inject_json_then_detach(start_target, gpumon_dir):
    t = start_target("plain")
    env = dict(os.environ, GPUMON_INJECT_SOURCE="simulated")
    p = subprocess.Popen([sys.executable, "-m", "gpumon", "attach", str(t.pid), "--inject", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = json.loads(p.stdout.readline())
        lines = [json.loads(p.stdout.readline()) for _ in range(3)]
    finally:
        p.kill()
        _, err = p.communicate(timeout=10)
    assert (first["kind"], first["state"], first["pid"]) == ("state", "serving", t.pid), err
    assert [m.get("type") for m in lines] == ["sample"] * 3, err
    r = subprocess.run([sys.executable, "-m", "gpumon", "detach", str(t.pid)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not (gpumon_dir / f"{t.pid}.sock").exists()
    r = subprocess.run([sys.executable, "-m", "gpumon", "detach", str(t.pid)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "has no gpumon agent" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    lines, err, report = t.finish()
    check_sequence(lines)
    assert err == "" and not report["torch"], "the injected agent must not import torch"


@needs_gdb
def test_reinject_after_detach(start_target, gpumon_dir):
    t = start_target("plain")
    for _ in range(2):
        sock = inject.inject(t.pid, timeout=15, source="simulated")
        hello, samples = read_samples(sock, n=2)
        assert hello["pid"] == t.pid and samples
        inject.detach(t.pid)
        assert not sock.exists()
    lines, err, _ = t.finish()
    check_sequence(lines)
    assert err == ""


def _version_param(python: str):
    v = tuple(int(x) for x in os.path.basename(python)[len("python"):].split("."))
    how = "sys.remote_exec" if v >= inject.REMOTE_EXEC_VERSION else "gdb"
    marks = [needs_gdb] if how == "gdb" else []
    where = "distro" if python.startswith("/usr/bin/") else "other"
    return pytest.param(python, marks=marks, id=f"{v[0]}.{v[1]}-{where}-{how}")


@pytest.mark.parametrize("python", [_version_param(p) for p in other_pythons()] or [
    pytest.param(None, marks=pytest.mark.skip(reason="no other Python 3.10+ on this machine"))])
def test_inject_other_python_versions(start_target, python):
    """A real interpreter of each version found: gdb for 3.10-3.13, sys.remote_exec for 3.14+
    (run with that interpreter itself)."""
    t = start_target("plain", python=python)
    sock = inject.inject(t.pid, timeout=15, source="simulated")
    hello, samples = read_samples(sock, n=2)
    assert hello["python"].rsplit(".", 1)[0] == os.path.basename(python)[len("python"):]
    inject.detach(t.pid)
    lines, err, _ = t.finish()
    check_sequence(lines)
    assert err == ""


def test_detach_refuses_an_agent_that_was_not_injected(tmp_path):
    code = ("import gpumon, sys, time; gpumon.start(source='simulated'); print('up', flush=True); "
            "sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "up\n"
        sock = wait_until(lambda: client.discover(p.pid))
        assert sock
        assert inject.inject(p.pid) == sock[0].path  # it has an agent: nothing to inject
        with pytest.raises(InjectError, match="was not injected"):
            inject.detach(p.pid)
        assert sock[0].path.exists()
    finally:
        p.kill()
        p.communicate()


# -- failures: one line each, target untouched ------------------------------------------------
def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def test_no_such_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    with pytest.raises(InjectError, match=f"no process with pid {p.pid}") as e:
        inject.inject(p.pid)
    one_line(e)
    with pytest.raises(InjectError, match="no process"):
        inject.detach(p.pid)


@pytest.mark.skipif(not is_root, reason="needs root to start a process of another user")
def test_another_users_process():
    """Named exactly by root (who may attach to it), another user's process gets past the
    owner check to the next one (here: it is not Python). As nobody: tests/inject/
    test_inject_safety.py."""
    p = subprocess.Popen(["sleep", "30"], user=65534, group=65534)
    try:
        with pytest.raises(InjectError, match="is not a Python process") as e:
            inject.inject(p.pid)
        one_line(e)
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_not_a_python_process():
    p = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(InjectError, match="is not a Python process") as e:
            inject.inject(p.pid)
        one_line(e)
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_launcher_names_its_python_children(tmp_path, start_target):
    sh = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(30)' & wait"])
    try:
        kids = wait_until(lambda: inject._python_children(sh.pid))
        assert kids
        with pytest.raises(InjectError, match=f"its Python child processes: {kids[0]}"):
            inject.inject(sh.pid)
    finally:
        for k in kids or []:
            try:
                os.kill(k, 9)
            except OSError:
                pass
        sh.kill()
        sh.wait()


def test_python_too_old(start_target, monkeypatch):
    old = old_python()
    if old:  # a real old interpreter
        t = start_target("plain", python=old)
    else:  # CI has one Python: fake the version probe of a real target
        t = start_target("plain")
        monkeypatch.setattr(inject, "python_version_of", lambda pid: (3, 9))
    with pytest.raises(InjectError, match=r"runs Python 3\.\d, too old") as e:
        inject.inject(t.pid)
    one_line(e)
    lines, err, _ = t.finish()
    check_sequence(lines)


def test_no_debugger(start_target, monkeypatch, tmp_path):
    t = start_target("plain")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.delenv("GPUMON_GDB", raising=False)
    monkeypatch.setattr(inject, "find_debugger", _no_cuda_gdb(inject.find_debugger))
    with pytest.raises(InjectError, match="no debugger found") as e:
        inject.inject(t.pid)
    assert "install gdb" in one_line(e)
    lines, err, _ = t.finish()
    check_sequence(lines)
    assert err == ""


def _no_cuda_gdb(real):
    def find():
        if os.access("/usr/local/cuda/bin/cuda-gdb", os.X_OK):  # pragma: no cover
            pytest.skip("this machine has cuda-gdb at its fixed path")
        return real()
    return find


@needs_gdb
@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX only")
def test_ptrace_not_permitted(start_target, tmp_path):
    """A non-dumpable target can only be traced with CAP_SYS_PTRACE. As root, drop that
    capability from the injecting process (as in a container without SYS_PTRACE)."""
    t = start_target("nodump")
    code = ("import sys\nfrom gpumon import inject\n"
            "try:\n    inject.inject(int(sys.argv[1]), source='simulated')\n"
            "except inject.InjectError as e:\n    print(e)\n")
    setpriv = shutil.which("setpriv")
    if is_root and not setpriv:
        pytest.skip("root without setpriv cannot drop CAP_SYS_PTRACE")
    prefix = [setpriv, "--bounding-set", "-sys_ptrace"] if is_root else []
    r = subprocess.run(prefix + [sys.executable, "-c", code, str(t.pid)], capture_output=True,
                       text=True, timeout=60)
    assert "not permitted to attach a debugger" in r.stdout, (r.stdout, r.stderr)
    assert "SYS_PTRACE" in r.stdout and len(r.stdout.strip().splitlines()) == 1
    lines, err, report = t.finish()
    check_sequence(lines)
    assert err == "" and not report["gpumon"]


def test_ptrace_denied_message_names_yama(monkeypatch):
    for scope, want in ((1, "ptrace_scope=0"), (2, "admin only"), (3, "until reboot")):
        monkeypatch.setattr(inject, "_ptrace_scope", lambda s=scope: s)
        assert want in str(inject._ptrace_denied(123))


@needs_gdb
def test_main_thread_blocked_in_c(start_target, gpumon_dir):
    """The main thread holds the GIL inside one C call: the script cannot run; we say so after
    the timeout, and when the call returns later the expired script does nothing."""
    t = start_target("block")
    with pytest.raises(InjectError, match="main thread is blocked outside Python") as e:
        inject.inject(t.pid, timeout=3, source="simulated")
    one_line(e)
    assert t.proc.poll() is None
    t.proc.stdin.write("x")  # the C call returns; the queued script runs now, and must do nothing
    t.proc.stdin.flush()
    assert t.proc.stdout.readline() == "0\n"
    time.sleep(0.3)
    lines, err, report = t.finish()
    check_sequence(lines[:1] + ["0"] + lines[1:])
    assert err == ""
    assert not report["gpumon"] and "gpumon-inject" not in report["threads"]
    assert not (gpumon_dir / f"{t.pid}.sock").exists()


@needs_gdb
def test_debugger_timeout_leaves_target_running(start_target, tmp_path, monkeypatch):
    """A debugger that hangs is stopped at the timeout; the target never noticed."""
    fake = tmp_path / "hung-gdb"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv("GPUMON_GDB", str(fake))
    t = start_target("plain")
    with pytest.raises(InjectError, match="did not finish .* within 1 s") as e:
        inject.inject(t.pid, timeout=1, source="simulated")
    one_line(e)
    lines, err, _ = t.finish()
    check_sequence(lines)


@needs_gdb
def test_torch_source_waits_for_cuda_and_detach_removes_it(start_target, gpumon_dir):
    """With the real (torch) source the agent serves only once the program uses CUDA: inject
    returns with the agent loaded and waiting (its marker says so, `ls` lists it), and `gpumon
    detach` takes out that agent, which has no socket (it said "no agent" before), and what it
    changed in the program's environment."""
    t = start_target("plain", drop=("GPUMON_DIR",))
    sock = inject.inject(t.pid, timeout=3)
    assert sock == gpumon_dir / f"{t.pid}.sock" and not sock.exists()
    marker = gpumon_dir / f"{t.pid}.waiting"
    assert json.loads(marker.read_text())["origin"] == "inject"
    r = subprocess.run([sys.executable, "-m", "gpumon", "ls"], capture_output=True, text=True,
                       timeout=60)
    assert (f"pid {t.pid}: gpumon's agent is loaded, waiting for the program's first CUDA "
            "call") in r.stdout.splitlines()
    r = subprocess.run([sys.executable, "-m", "gpumon", "detach", str(t.pid)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == f"detached from process {t.pid}\n", r.stderr
    assert not marker.exists() and not sock.exists()
    assert not [f for f in os.listdir(gpumon_dir) if f.startswith(str(t.pid))]
    time.sleep(0.5)  # the snapshot part's wait for torch ends at its next poll (0.1 s)
    lines, err, report = t.finish()
    check_sequence(lines)
    assert err == "" and not report["torch"]
    assert not [n for n in report["threads"] if n.startswith("gpumon")], report["threads"]
    assert report["env_gpumon"] == []


@pytest.mark.parametrize("how", ["env", "flag"])
def test_remote_debug_disabled_on_314(start_target, monkeypatch, how):
    """Python 3.14's opt-outs (PEP 768) are read from the target itself; this machine's Python
    is older, so only the version probe is faked."""
    if how == "env":
        t = start_target("plain", env={"PYTHON_DISABLE_REMOTE_DEBUG": "1"})
    else:
        t = start_target("plain", argv_prefix=("-X", "disable_remote_debug"))
    monkeypatch.setattr(inject, "python_version_of", lambda pid: (3, 14))
    with pytest.raises(InjectError, match="remote debugging disabled") as e:
        inject.inject(t.pid)
    one_line(e)
    lines, _, _ = t.finish()
    check_sequence(lines)


def test_bootstrap_binds_nothing_and_expires(tmp_path):
    """The script binds no name in the namespace it runs in, and does nothing without its ticket
    (cancelled by the client that gave up)."""
    status = tmp_path / "s.json"
    code = inject.bootstrap_code({"deadline": time.time() + 60, "ticket": str(tmp_path / "no-ticket"),
                                  "status": str(status),
                                  "package": str(inject.PACKAGE_DIR), "socket_dir": str(tmp_path),
                                  "source": "simulated", "rate_hz": None})
    ns = {"__builtins__": __builtins__}
    exec(code, ns)
    assert set(ns) == {"__builtins__"} and not status.exists()


# -- Python 3.14+: sys.remote_exec, through gpumon's own interpreter of that version ---------------
def _fake_interpreter(tmp_path, body: str):
    """An executable standing in for python3.14 on gpumon's PATH: `-I -S -c CODE` runs `body`
    (shell) instead, so each answer of sys.remote_exec can be replayed on any machine."""
    exe = tmp_path / "python3.14"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.parametrize("answer, want", [
    ("echo 'GPUMON_ERR PermissionError [Errno 1] Operation not permitted'",
     "not permitted to attach a debugger"),
    ("echo 'GPUMON_ERR ProcessLookupError [Errno 3] No such process'", "it exited"),
    ("echo \"GPUMON_ERR FileNotFoundError [Errno 2] No such file or directory: '/proc/$$/maps'\"",
     None),
    ("echo 'GPUMON_ERR RuntimeError Remote debugging support has not been compiled in'",
     "built without remote debugging"),
    ("echo 'GPUMON_ERR RuntimeError Remote debugging is not enabled in the remote process'",
     "remote debugging disabled"),
    ("echo 'Segmentation fault' >&2; exit 139", "sys.remote_exec into process"),
    ("exec sleep 30", "sys.remote_exec did not finish with process .* within 1 s"),
])
def test_remote_exec_answers_are_one_line(start_target, monkeypatch, tmp_path, gpumon_dir,
                                          answer, want):
    t = start_target("plain")
    if want is None:  # CPython's own wording names the pid's /proc file
        answer, want = answer.replace("$$", str(t.pid)), "it exited"
    monkeypatch.setattr(inject, "python_version_of", lambda pid: (3, 14))
    monkeypatch.setattr(inject, "remote_exec_interpreter",
                        lambda pid, ver: _fake_interpreter(tmp_path, answer))
    with pytest.raises(InjectError, match=want) as e:
        inject.inject(t.pid, timeout=1, source="simulated")
    one_line(e)
    # The script was never read: it stays (a missing file would make a real 3.14 target print
    # an error if it ran it later), and its ticket is cancelled, so that late run does nothing.
    left = [f for f in os.listdir(gpumon_dir) if ".inject-" in f]
    assert [f for f in left if f.endswith(".py")] and not [f for f in left if "ticket" in f]
    lines, err, report = t.finish()
    check_sequence(lines)
    assert err == "" and not report["gpumon"]


def test_remote_exec_is_called_with_the_script(start_target, monkeypatch, tmp_path, gpumon_dir):
    """What the real sys.remote_exec gets: the target's pid and a script that compiles and that
    does nothing once its ticket is gone."""
    t = start_target("plain")
    log = tmp_path / "argv"
    monkeypatch.setattr(inject, "python_version_of", lambda pid: (3, 14))
    monkeypatch.setattr(inject, "remote_exec_interpreter", lambda pid, ver: _fake_interpreter(
        tmp_path, f'printf "%s" "$4" > {log}; echo "GPUMON_SCHEDULED 0"'))
    with pytest.raises(InjectError, match="did not run the injected code within 1 s"):
        inject.inject(t.pid, timeout=1, source="simulated")
    code = log.read_text()
    assert f"sys.remote_exec({t.pid}, " in code
    (script,) = [f for f in os.listdir(gpumon_dir) if f.endswith(".py")]
    assert str(gpumon_dir / script) in code
    ns = {"__builtins__": __builtins__}
    exec(compile((gpumon_dir / script).read_text(), "late", "exec"), ns)  # a late run: no-op
    assert set(ns) == {"__builtins__"} and not wait_until(lambda: client.discover(), timeout=0.5)
    lines, err, _ = t.finish()
    check_sequence(lines)


def test_a_zombie_is_a_dead_process():
    p = subprocess.Popen(["true"])
    assert wait_until(lambda: inject._status_fields(p.pid).get("State", "").startswith("Z"))
    try:
        with pytest.raises(InjectError, match=f"process {p.pid} .* has exited") as e:
            inject.inject(p.pid)
        one_line(e)
    finally:
        p.wait()


@pytest.mark.parametrize("argv", [["attach", "--inject", "--once"], ["inject"], ["detach"]])
def test_cli_errors_are_one_line(argv):
    p = subprocess.Popen(["sleep", "30"])
    try:
        r = subprocess.run([sys.executable, "-m", "gpumon", *argv, str(p.pid)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stdout == ""
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith("gpumon: ") and (
            "is not a Python process" in line or "has no gpumon agent" in line), line
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


@needs_gdb
def test_own_agent_serving_elsewhere_is_named(tmp_path, gpumon_dir):
    """The program started its own agent, in another socket dir than the one gpumon looks in:
    inject finds it, starts nothing, and says where to look."""
    other = tmp_path / "other-dir"
    code = ("import gpumon, sys, time, os; gpumon.start(source='simulated'); print('up', flush=True)\n"
            "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n")
    stop = tmp_path / "stop"
    p = subprocess.Popen([sys.executable, "-c", code, str(stop)], stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, GPUMON_DIR=str(other)))
    try:
        assert p.stdout.readline() == "up\n"
        served = other / f"gpumon-{os.getuid()}"  # GPUMON_DIR's private folder
        assert wait_until(lambda: (served / f"{p.pid}.sock").exists())
        with pytest.raises(InjectError, match=f"serving in {served}, not in {gpumon_dir}") as e:
            inject.inject(p.pid, timeout=15, source="simulated")
        assert f"GPUMON_DIR={other} gpumon attach {p.pid}" in one_line(e)
        assert (served / f"{p.pid}.sock").exists() and not (gpumon_dir / f"{p.pid}.sock").exists()
    finally:
        stop.touch()
        p.wait(30)
    assert p.returncode == 0


# -- `gpumon attach PID` on a terminal offers the injection ---------------------------------------
class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@needs_gdb
def test_offer_inject_yes_injects_and_no_leaves_it(start_target, gpumon_dir, monkeypatch, capsys):
    from gpumon.commands.inject import offer_inject
    monkeypatch.setenv("GPUMON_INJECT_SOURCE", "simulated")
    t = start_target("plain")
    err = _Tty()
    assert offer_inject(t.pid, stdin=_Tty("\n"), stderr=err) is False  # the default is no
    assert "[y/N]" in err.getvalue() and f"gpumon detach {t.pid}" in err.getvalue()
    assert not (gpumon_dir / f"{t.pid}.sock").exists()
    assert offer_inject(t.pid, stdin=io.StringIO("y\n"), stderr=_Tty()) is False  # no tty
    assert offer_inject(t.pid, stdin=_Tty("y\n"), stderr=_Tty()) is True
    assert (gpumon_dir / f"{t.pid}.sock").exists()
    inject.detach(t.pid)
    lines, err, _ = t.finish()
    check_sequence(lines)
    assert err == ""


def test_a_launcher_names_its_ranks_not_its_workers(capsys):
    """A Python launcher (torchrun) whose children got a RANK is refused with the ranks named;
    a training process whose Python children are its own workers (same environment) is not."""
    from gpumon.commands.inject import offer_inject
    code = ("import os, subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'import time; time.sleep(30)'], env=dict(os.environ, **{sys.argv[1]: '0'}))")
    launcher = subprocess.Popen([sys.executable, "-c", code, "RANK"])
    parent = subprocess.Popen([sys.executable, "-c", code, "SOME_VAR"])
    kids = []
    try:
        kids = wait_until(lambda: inject._python_children(launcher.pid))
        kids2 = wait_until(lambda: inject._python_children(parent.pid))
        kids += kids2 or []
        assert kids and kids2
        out = _Tty()
        assert offer_inject(launcher.pid, stdin=_Tty("y\n"), stderr=out) is False
        assert out.getvalue() == ""  # nothing asked
        line = capsys.readouterr().err.strip()
        assert f"gpumon attach {kids[0]} --inject" in line and "\n" not in line
        assert "is a launcher" in line
        with pytest.raises(InjectError, match="is a launcher"):
            inject.inject(launcher.pid)
        assert inject.check_target(parent.pid) == sys.version_info[:2]  # workers: still a target
        assert inject.check_target(kids[0]) == sys.version_info[:2]  # a rank itself: a target
    finally:
        for k in kids or []:
            try:
                os.kill(k, 9)
            except OSError:
                pass
        for q in (launcher, parent):
            q.kill()
            q.wait()


@needs_gdb
def test_attach_on_a_terminal_asks_then_injects(start_target, gpumon_dir):
    """The real command in a pseudo-terminal: it asks, 'y' injects, and the live view opens on
    the injected agent."""
    import pty
    t = start_target("plain")
    master, slave = pty.openpty()
    env = dict(os.environ, GPUMON_INJECT_SOURCE="simulated", TERM="xterm-256color")
    p = subprocess.Popen([sys.executable, "-m", "gpumon", "attach", str(t.pid)], stdin=slave,
                         stdout=slave, stderr=slave, env=env, close_fds=True,
                         start_new_session=True)
    os.close(slave)
    seen = b""
    try:
        end = time.monotonic() + 60
        while b"[y/N]" not in seen and time.monotonic() < end and p.poll() is None:
            import select
            if select.select([master], [], [], 0.5)[0]:
                seen += os.read(master, 65536)
        assert b"[y/N]" in seen, seen[-2000:]
        os.write(master, b"y\n")
        assert wait_until(lambda: (gpumon_dir / f"{t.pid}.sock").exists(), timeout=60)
        assert wait_until(lambda: p.poll() is None and _connected(t.pid), timeout=60)
    finally:
        p.kill()
        p.wait()
        os.close(master)
    inject.detach(t.pid)
    lines, err, _ = t.finish()
    check_sequence(lines)
    assert err == ""


def _connected(pid: int) -> bool:
    """The attach process is one of the agent's clients."""
    addrs = client.discover(pid)
    if not addrs:
        return False
    with client.AgentConnection.connect(addrs[0], timeout=5) as conn:
        return len(conn.request("status", timeout=5).get("clients", [])) >= 2


def test_a_stopped_process_is_named(start_target):
    import signal
    t = start_target("plain")
    os.kill(t.pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: inject._status_fields(t.pid)["State"].startswith("T"))
        with pytest.raises(InjectError, match=f"is stopped .*kill -CONT {t.pid}") as e:
            inject.inject(t.pid)
        one_line(e)
    finally:
        os.kill(t.pid, signal.SIGCONT)
    lines, err, _ = t.finish()
    check_sequence(lines)


@needs_gdb
def test_a_process_under_another_debugger_is_named(start_target, tmp_path):
    """Only one tracer at a time: with gdb already attached, say who holds it."""
    t = start_target("plain")
    gate = tmp_path / "gate"
    holder = subprocess.Popen(
        [DEBUGGER, "-nx", "-q", "-batch", "-iex", "set auto-solib-add off",
         "-p", str(t.pid), "-ex", f"shell touch {gate}", "-ex", "shell sleep 30"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: gate.exists(), timeout=60)
        with pytest.raises(InjectError, match=f"being traced by process {holder.pid} \\(gdb") as e:
            inject.inject(t.pid)
        one_line(e)
    finally:
        holder.kill()  # the kernel detaches a killed tracer; the target runs on
        holder.wait()
    assert wait_until(lambda: inject._status_fields(t.pid).get("TracerPid") == "0")
    lines, err, _ = t.finish()
    check_sequence(lines)


def _fake_gdb(tmp_path, monkeypatch, body: str) -> None:
    """GPUMON_GDB pointing at a shell script; "$PID" is the target's pid (gdb's -p argument)."""
    fake = tmp_path / "fake-gdb"
    # --version first: on an AMX CPU gpumon asks the debugger's version before it attaches
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "GNU gdb (fake) 16.3"; exit 0; }\n'
                    'PID=""\nwhile [ $# -gt 0 ]; do [ "$1" = -p ] && PID=$2; shift; done\n'
                    + body + "\n")
    fake.chmod(0o755)
    monkeypatch.setenv("GPUMON_GDB", str(fake))


def test_a_debugger_stopped_while_attaching_leaves_the_target_running(start_target, tmp_path,
                                                                       monkeypatch):
    """A debugger that hangs in its attach leaves the kernel's SIGSTOP behind when it is
    stopped (here: it stops the target itself, then hangs): the target is continued."""
    _fake_gdb(tmp_path, monkeypatch, 'kill -STOP "$PID"; exec sleep 60')
    t = start_target("plain")
    with pytest.raises(InjectError, match="did not finish with process .* within 1 s .*attaching"):
        inject.inject(t.pid, timeout=1, source="simulated")
    assert wait_until(lambda: not inject._status_fields(t.pid)["State"].startswith("T"), 5)
    lines, err, _ = t.finish()
    check_sequence(lines)


def test_ctrl_c_waits_for_the_debugger_to_finish(start_target, tmp_path, monkeypatch, gpumon_dir):
    """Ctrl-C on `gpumon inject` while gdb is in the target: gpumon lets it finish (so it
    never dies halfway through a call in the target) and then exits."""
    done, started = tmp_path / "gdb-finished", tmp_path / "gdb-started"
    _fake_gdb(tmp_path, monkeypatch,
              f'touch {started}; sleep 1.5; touch {done}; echo "GPUMON_SCHEDULED 0"')
    t = start_target("plain")
    p = subprocess.Popen([sys.executable, "-m", "gpumon", "inject", str(t.pid), "--timeout", "20"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ))
    # Ctrl-C while the debugger works (on a loaded machine gpumon takes a while to start it)
    assert wait_until(lambda: started.exists() or p.poll() is not None, 30)
    assert p.poll() is None
    p.send_signal(2)
    p.communicate(timeout=60)
    assert done.exists(), "gpumon exited while its debugger was still working"
    assert not [f for f in os.listdir(gpumon_dir) if ".inject-" in f and "ticket" in f]
    lines, err, report = t.finish()
    check_sequence(lines)
    assert err == "" and not report["gpumon"]


def test_gdb_that_cannot_write_xsave_state_is_one_clear_line():
    # Seen on the H200 host with Debian's gdb 13.1: the call into the target is refused.
    out = ("[New LWP 1219]\nError in sourced command file:\n"
           "Couldn't write extended state status: Bad address.\n"
           "[Inferior 1 (process 1203) detached]\n")
    with pytest.raises(inject.InjectError) as e:
        inject._check_gdb_output(1203, out)
    msg = str(e.value)
    assert "\n" not in msg and "gdb 14" in msg and "gpumon run" in msg


@pytest.mark.parametrize("ver,amx,refused", [((13, 1), True, True), ((14, 2), True, False),
                                              ((13, 1), False, False), (None, True, False)])
def test_old_gdb_on_an_amx_cpu_is_refused_before_attaching(monkeypatch, ver, amx, refused):
    monkeypatch.setattr(inject, "gdb_version", lambda gdb: ver)
    monkeypatch.setattr(inject, "_cpu_has_amx", lambda: amx)
    if refused:
        with pytest.raises(inject.InjectError, match="AMX"):
            inject._check_gdb_can_call("gdb")
    else:
        inject._check_gdb_can_call("gdb")


def test_gdb_version_reads_the_real_gdb():
    gdb = shutil.which("gdb")
    if not gdb:
        pytest.skip("no gdb here")
    v = inject.gdb_version(gdb)
    assert v is not None and v[0] >= 7
