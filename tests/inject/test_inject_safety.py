"""Injection never surprises: it runs nothing it finds in a process tree (a binary named
python3 of another user's would run as us), offers nobody else's processes, checks every usage
before its first side effect, says at once when an agent is already there, and a Ctrl-C in the
middle finishes or undoes what it started and says which."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from gpumon import inject
from gpumon.inject import InjectError

from .conftest import check_sequence, wait_until
from .test_inject import needs_gdb

FAKE_PYTHON_C = r'''
#include <stdio.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--serve") == 0) { sleep(60); return 0; }
    FILE *f = fopen(MARKER, "w");   /* run by anyone else: leave the proof */
    if (f) { fputs("ran\n", f); fclose(f); }
    return 0;
}
'''


@pytest.fixture
def fake_python3(tmp_path):
    """A binary named python3 that leaves a marker file whenever it is run other than as
    `python3 --serve` (how the test starts it)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake python3")
    src, exe, marker = tmp_path / "fake.c", tmp_path / "bin" / "python3", tmp_path / "RAN"
    exe.parent.mkdir()
    src.write_text(FAKE_PYTHON_C)
    subprocess.run([cc, f'-DMARKER="{marker}"', "-o", str(exe), str(src)], check=True)
    os.chmod(tmp_path, 0o755)  # so another uid can run it
    return exe, marker


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:
        pass
    p.wait()


@pytest.mark.parametrize("other_user", [False, True])
def test_a_found_python3_binary_is_never_run(fake_python3, other_user):
    """A launcher (sh) whose child runs a binary named python3: before, gpumon ran that binary
    (`python3 -I -S -c ...`) to learn its version, as root for another user's child."""
    if other_user and os.geteuid() != 0:
        pytest.skip("needs root to start a child as another user")
    exe, marker = fake_python3
    child = f"{exe} --serve"
    if other_user:
        child = f"setpriv --reuid=65534 --regid=65534 --clear-groups {child}"
    sh = subprocess.Popen(["sh", "-c", f"{child} & wait"], start_new_session=True)
    try:
        assert wait_until(lambda: any(os.path.basename(inject._exe(k) or "") == "python3"
                                      for k in _kids(sh.pid)), 10)
        (kid,) = _kids(sh.pid)
        assert inject.python_version_of(kid) is None  # read its ELF: no Python in it
        with pytest.raises(InjectError, match="is not a Python process") as e:
            inject.inject(sh.pid)
        msg = str(e.value)
        assert "its Python child processes" not in msg  # not offered
        if other_user:  # named as refused, with its owner
            assert f"{kid} (nobody's)" in msg and "not offered" in msg
        else:
            assert str(kid) not in msg
        assert not marker.exists(), "gpumon ran a binary it found in the process tree"
    finally:
        _kill(sh)


def _kids(pid: int) -> list[int]:
    import psutil
    return [k.pid for k in psutil.Process(pid).children(recursive=True)]


def _nobodys_python(pid: int) -> bool:
    """nobody's, and already Python: setpriv changes the uid before it execs the interpreter,
    so the uid alone can be seen while the process is still setpriv (a failure CI met)."""
    return inject._uid_of(pid) == 65534 and inject.python_version_of(pid) is not None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a child as another user")
def test_another_users_python_child_is_not_offered():
    """A shell of ours whose Python child belongs to someone else: gpumon names only our own
    processes (it would not inject into that one either)."""
    sh = subprocess.Popen(["sh", "-c", "setpriv --reuid=65534 --regid=65534 --clear-groups "
                           f"{sys.executable} -c 'import time; time.sleep(30)' & wait"],
                          start_new_session=True)
    try:
        assert wait_until(lambda: any(_nobodys_python(k) for k in _kids(sh.pid)), 10)
        assert inject._python_children(sh.pid) == []
        with pytest.raises(InjectError) as e:
            inject.inject(sh.pid)
        assert "child processes" not in str(e.value)
    finally:
        _kill(sh)


def test_version_is_read_from_the_executable_never_run():
    """The ELF reader finds the version of real interpreters: ours (a libpython dependency
    or the Py_Version symbol) and the distribution's static builds (Py_Version)."""
    exes = {os.path.realpath(sys.executable): tuple(sys.version_info[:2])}
    for v in ("3.10", "3.11", "3.12", "3.13", "3.14"):
        p = f"/usr/bin/python{v}"
        if os.path.exists(p):
            exes[os.path.realpath(p)] = tuple(map(int, v.split(".")))
    for exe, ver in exes.items():
        assert inject.elf_python_version(exe) == ver, exe
    assert inject.elf_python_version("/bin/sh") is None
    assert inject.elf_python_version(__file__) is None  # not an ELF


def test_remote_exec_runs_our_interpreter_never_the_targets(monkeypatch):
    mine = tuple(sys.version_info[:2])
    assert inject.remote_exec_interpreter(1, mine) == sys.executable
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(InjectError, match=r"Python 3\.99 .*put python3\.99 on your PATH"):
        inject.remote_exec_interpreter(1, (3, 99))


def _fake_gdb(tmp_path, monkeypatch, ran):
    fake = tmp_path / "fake-gdb"
    fake.write_text(f"#!/bin/sh\ntouch {ran}\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("GPUMON_GDB", str(fake))


def test_attach_inject_without_a_terminal_stops_before_the_debugger(start_target, tmp_path,
                                                                     monkeypatch):
    """issue 32: `attach PID --inject </dev/null | cat` ran gdb (the target stopped, the agent
    loaded) and only then said stdout is not a terminal."""
    ran = tmp_path / "gdb-ran"
    _fake_gdb(tmp_path, monkeypatch, ran)
    t = start_target("plain")
    r = subprocess.run([sys.executable, "-m", "gpumon", "attach", str(t.pid), "--inject"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "stdout is not a terminal" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not ran.exists(), "the debugger ran before the usage check"
    lines, err, report = t.finish()
    check_sequence(lines)
    assert not report["gpumon"]


@needs_gdb
def test_already_loaded_is_said_at_once_without_a_debugger(start_target, tmp_path, monkeypatch,
                                                           gpumon_dir):
    """An agent waiting for CUDA (here: the torch-less target's torch source) and then a second
    inject: it answers from the socket folder, no debugger (a fake one would leave a mark)."""
    t = start_target("plain")
    t0 = time.monotonic()
    path = inject.inject(t.pid, timeout=20)  # the torch source: waits for CUDA, never serves
    first = time.monotonic() - t0
    assert not path.exists() and (gpumon_dir / f"{t.pid}.waiting").exists()
    ran = tmp_path / "gdb-ran"
    _fake_gdb(tmp_path, monkeypatch, ran)
    t0 = time.monotonic()
    assert inject.inject(t.pid, timeout=20) == path
    second = time.monotonic() - t0
    assert not ran.exists()
    # Before: 5.5 s each (the waiting agent was only recognised at the 5 s timeout).
    assert first < 4.0 and second < 1.0, (first, second)
    inject.detach(t.pid)
    lines, err, report = t.finish()
    check_sequence(lines)
    assert err == ""


def _inject_files(d) -> list[str]:
    return [f for f in os.listdir(d) if ".inject-" in f]


@needs_gdb
def test_ctrl_c_before_the_script_ran_cancels_it(start_target, gpumon_dir):
    """Ctrl-C after gdb queued the script but before the target (blocked in C) ran it: one
    line says nothing was loaded, 130, and the script does nothing when it runs later."""
    t = start_target("block")
    p = subprocess.Popen([sys.executable, "-m", "gpumon", "inject", str(t.pid), "--timeout", "30",
                          "--source", "simulated"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)

    def traced() -> bool:  # gdb attached to the target (then detached: the call is queued)
        return inject._status_fields(t.pid).get("TracerPid", "0") != "0"
    assert wait_until(traced, 30, interval=0.002), "the debugger never attached"
    assert wait_until(lambda: not traced(), 30, interval=0.01)
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and out == ""
    assert err.strip().splitlines() == [f"gpumon: interrupted: nothing was loaded into process "
                                        f"{t.pid}"]
    t.proc.stdin.write("x")  # the C call returns; the queued script runs and must do nothing
    t.proc.stdin.flush()
    time.sleep(0.5)
    lines, err, report = t.finish()
    assert not report["gpumon"] and err == ""
    assert not [f for f in _inject_files(gpumon_dir) if re.search(r"\.(json|ticket)", f)]


@needs_gdb
def test_ctrl_c_after_the_script_ran_takes_the_agent_out(start_target, gpumon_dir):
    """Ctrl-C while the target loads the agent: gpumon waits for it, takes it out again
    (as gpumon detach), says so in one line, exits 130 and leaves no PID.inject-*.json."""
    for attempt in range(4):
        t = start_target("plain")
        p = subprocess.Popen([sys.executable, "-m", "gpumon", "inject", str(t.pid), "--timeout",
                              "30", "--source", "simulated"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)

        def ran() -> bool:  # the script took its ticket: the agent is being loaded now
            return any(f.endswith(".taken") for f in _inject_files(gpumon_dir))
        wait_until(lambda: ran() or p.poll() is not None, 30, interval=0.002)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        if p.returncode == 0:  # the load finished before the signal: try again
            inject.detach(t.pid)
            t.finish()
            continue
        assert p.returncode == 130, err
        assert err.strip().splitlines() == [
            f"gpumon: interrupted: the agent loaded into process {t.pid} was taken out again"]
        assert not (gpumon_dir / f"{t.pid}.sock").exists()
        assert not [f for f in _inject_files(gpumon_dir) if re.search(r"\.json", f)]
        lines, err, report = t.finish()
        check_sequence(lines)
        assert "gpumon-agent" not in report["threads"] and err == ""
        return
    pytest.skip("the agent loaded before every Ctrl-C (a fast machine): nothing to undo")


# -- another user's processes: only a pid named exactly, by someone allowed to attach to it ----
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root (and setpriv) to start another user's process")
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@needs_root
def test_a_named_pid_of_another_user_passes_the_owner_check_for_root():
    """Root (CAP_SYS_PTRACE) names another user's Python process: the owner check lets it
    through to the next checks (it is Python, recent enough); before, 'belongs to nobody'."""
    p = subprocess.Popen(NOBODY + SLEEPER)
    try:
        assert wait_until(lambda: _nobodys_python(p.pid), 10)
        assert inject.check_target(p.pid) == tuple(sys.version_info[:2])
        assert inject.attach_refused(65534) is None
        # `gpumon attach PID` on a terminal does not offer it: the agent would serve nobody
        from gpumon.commands.inject import offer_inject
        from .test_inject import _Tty
        asked = _Tty()
        assert offer_inject(p.pid, stdin=_Tty("y\n"), stderr=asked) is False
        assert asked.getvalue() == ""
        assert p.poll() is None
    finally:
        _kill_proc(p)


@needs_root
@needs_gdb
def test_root_injects_a_named_pid_of_another_user_as_that_user(tmp_path):
    """The whole injection runs as the owner (their uid, their socket folder): the agent
    serves nobody in nobody's folder, and detach takes it out again, the target running on.
    gpumon's interpreter must be one the owner can run: the system's, with this checkout."""
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    exe = f"/usr/bin/python{ver}"
    if not os.access(exe, os.X_OK):
        pytest.skip(f"no {exe} that nobody may run")
    site = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    root = os.path.dirname(os.path.dirname(inject.PACKAGE_DIR / "x"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GPUMON") and k not in ("XDG_RUNTIME_DIR", "TMPDIR")}
    env.update(PYTHONPATH=os.pathsep.join([root] + site), GPUMON_SIM_READY="now")
    probe = subprocess.run([exe, "-c", "import gpumon.inject, psutil"], env=env, cwd="/",
                           user=65534, group=65534, extra_groups=[], capture_output=True,
                           text=True, timeout=60)
    if probe.returncode:  # CI's venv lives in a private temp folder
        pytest.skip(f"nobody cannot import this checkout's gpumon with {exe}: "
                    f"{probe.stderr.strip().splitlines()[-1:]}")
    target = subprocess.Popen(NOBODY + [sys.executable, "-c", "import time\n"
                              "for _ in range(1200): time.sleep(0.05)"], env=env, cwd="/")
    try:
        assert wait_until(lambda: _nobodys_python(target.pid), 10)
        r = subprocess.run([exe, "-m", "gpumon", "inject", str(target.pid), "--source",
                            "simulated"], env=env, capture_output=True, text=True, timeout=90)
        assert r.returncode == 0, r.stderr
        sock = r.stdout.strip()
        folder = os.path.dirname(sock)
        assert os.stat(folder).st_uid == 65534 and sock.endswith(f"/{target.pid}.sock")
        assert "runs as nobody" in r.stderr and "sudo -u nobody gpumon attach" in r.stderr
        assert wait_until(lambda: any(n.startswith(str(target.pid)) for n in os.listdir(folder)),
                          10)
        d = subprocess.run([exe, "-m", "gpumon", "detach", str(target.pid)], env=env,
                           capture_output=True, text=True, timeout=90)
        assert d.returncode == 0 and "detached" in d.stdout, d.stderr
        assert not any(n.startswith(f"{target.pid}.") for n in os.listdir(folder))
        assert target.poll() is None
    finally:
        _kill_proc(target)


@needs_root
def test_another_users_descendant_is_refused_and_named_with_its_owner():
    """A shell of ours whose Python child is nobody's: found by walking the tree, it is not
    offered, and the one line names it and its owner."""
    sh = subprocess.Popen(["sh", "-c", " ".join(NOBODY) + f" {sys.executable} -c "
                           "'import time; time.sleep(60)' & wait"], start_new_session=True)
    try:
        assert wait_until(lambda: any(_nobodys_python(k) for k in _kids(sh.pid)), 10)
        (kid,) = [k for k in _kids(sh.pid) if _nobodys_python(k)]
        with pytest.raises(InjectError, match="is not a Python process") as e:
            inject.inject(sh.pid)
        line = str(e.value)
        assert "\n" not in line
        assert f"{kid} (nobody's)" in line and "not offered" in line
        assert "its Python child processes" not in line
    finally:
        _kill(sh)


@needs_root
def test_without_cap_sys_ptrace_another_users_pid_is_refused_in_one_line():
    """gpumon run as nobody (no CAP_SYS_PTRACE) against root's Python process: refused before
    anything else, the pid and its owner named, and why."""
    target = subprocess.Popen(SLEEPER)
    code = ("import sys\nfrom gpumon import inject\n"
            "try:\n    inject.inject(int(sys.argv[1]), source='simulated')\n"
            "except inject.InjectError as e:\n    print(e)\n")
    try:
        env = dict(os.environ, HOME="/tmp", GPUMON_DIR="/tmp")
        env.pop("XDG_RUNTIME_DIR", None)
        r = subprocess.run(NOBODY + [sys.executable, "-c", code, str(target.pid)], env=env,
                           capture_output=True, text=True, timeout=60, cwd="/tmp")
        line = r.stdout.strip()
        if not line and ("No module named 'gpumon'" in r.stderr or "PermissionError" in r.stderr):
            pytest.skip(f"nobody cannot import this checkout's gpumon: {r.stderr[-200:]}")
        assert line.startswith(f"process {target.pid} (") and "belongs to root" in line, \
            (r.stdout, r.stderr)
        assert "CAP_SYS_PTRACE" in line and "\n" not in line
        assert target.poll() is None
    finally:
        _kill_proc(target)


def test_attach_refused_reads_the_capability_and_yama(monkeypatch):
    me = os.geteuid()
    assert inject.attach_refused(me) is None  # one's own: the debugger decides (yama)
    monkeypatch.setattr(inject, "_has_cap_sys_ptrace", lambda: False)
    assert "CAP_SYS_PTRACE" in inject.attach_refused(me + 1)
    monkeypatch.setattr(inject, "_has_cap_sys_ptrace", lambda: True)
    monkeypatch.setattr(inject, "_ptrace_scope", lambda: 3)
    assert "ptrace_scope is 3" in inject.attach_refused(me + 1)
    monkeypatch.setattr(inject, "_ptrace_scope", lambda: 2)
    assert inject.attach_refused(me + 1) is None


def _kill_proc(p: subprocess.Popen) -> None:
    p.kill()
    p.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="injecting as the owner is root's")
def test_the_owners_gpumon_gets_none_of_roots_environment(monkeypatch):
    """What root runs as the owner: gpumon's own interpreter, their uid, and none of root's
    environment beyond what gpumon needs (that user can read it in /proc)."""
    seen = {}

    class FakePopen:
        returncode = 0

        def __init__(self, argv, **kw):
            seen.update(kw, argv=argv)

        def communicate(self):
            return "/x/1.sock\n", ""

    monkeypatch.setenv("SECRET_TOKEN", "root's")
    monkeypatch.setenv("GPUMON_INJECT_SOURCE", "simulated")
    monkeypatch.setattr(inject.subprocess, "Popen", FakePopen)
    assert inject._as_owner(os.getpid(), 65534, "inject", 5.0, []) == "/x/1.sock"
    assert seen["user"] == 65534 and seen["extra_groups"] == []
    assert seen["argv"][:4] == [sys.executable, "-m", "gpumon", "inject"]
    assert "SECRET_TOKEN" not in seen["env"] and seen["env"]["GPUMON_INJECT_SOURCE"] == "simulated"
