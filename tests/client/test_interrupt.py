"""The one interrupt rule (gpumon/interrupt.py), command by command, as a user meets it: a real
SIGINT (what Ctrl-C sends) to a real `gpumon` process ends it with 130 and one line that says
what became of what it had started. Issue 32 item 5 / issue 31 item 8: `--json` and `export`
exited 0, `--once` 130, and nothing was said."""
import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from gpumon import client

from .conftest import gpumon_popen, wait_for

NOTHING = "gpumon: interrupted (Ctrl-C); nothing to undo\n"


def ctrl_c(a: subprocess.Popen, timeout: float = 30) -> tuple[int, str, str]:
    a.send_signal(signal.SIGINT)
    out, err = a.communicate(timeout=timeout)
    return a.returncode, out, err


def test_attach_json_ctrl_c_is_130_with_the_line(program):
    p = program(torch=False)
    a = gpumon_popen("attach", p.pid, "--json")
    for line in a.stdout:
        if json.loads(line)["type"] == "sample":
            break
    rc, _, err = ctrl_c(a)
    assert rc == 130 and err == NOTHING, err


def test_attach_once_ctrl_c_while_waiting_for_cuda(program):
    p = program()  # loaded, waiting for the first CUDA call
    a = gpumon_popen("attach", p.pid, "--once", "--wait", "60")
    time.sleep(2.0)
    assert a.poll() is None  # still waiting
    rc, out, err = ctrl_c(a)
    assert rc == 130 and err.endswith(NOTHING) and out == "", (rc, out, err)


def test_estimate_check_ctrl_c_while_waiting_for_steps(program):
    p = program(torch=False)  # serving, but it never trains
    a = gpumon_popen("estimate", "--params", "1e6", "--check", p.pid, "--timeout", "120")
    wait_for(lambda: "waiting for 2 completed training steps" in _peek_err(a),
             what="the check's waiting line")
    rc, _, err = ctrl_c(a)
    assert rc == 130 and err.endswith(NOTHING), err


def _peek_err(a: subprocess.Popen) -> str:
    """What the command wrote on stderr so far (non-blocking, kept for later reads)."""
    import fcntl
    fd = a.stderr.fileno()
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    got = getattr(a, "_seen_err", "")
    try:
        chunk = os.read(fd, 65536).decode()
    except BlockingIOError:
        chunk = ""
    a._seen_err = got + chunk
    return a._seen_err


def test_export_http_ctrl_c_is_130(program):
    pytest.importorskip("prometheus_client")
    program(torch=False)
    a = gpumon_popen("export", "--port", "0", "--address", "127.0.0.1")
    wait_for(lambda: "serving http://" in _peek_err(a), what="the exporter serving")
    a.send_signal(signal.SIGINT)
    out, err = a.communicate(timeout=30)
    assert a.returncode == 130 and (a._seen_err + err).endswith(NOTHING)


@pytest.mark.parametrize("sig, status, said", [
    (signal.SIGINT, 130, "gpumon: interrupted (Ctrl-C); removed {}\n"),
    (signal.SIGTERM, 0, "gpumon export: stopped; removed {}\n")])  # a service stop
def test_export_textfile_ctrl_c_or_sigterm_removes_its_file(program, tmp_path, sig, status, said):
    """The textfile is undone: left behind, node_exporter would serve its last figures as
    if they were live (after SIGTERM it stayed)."""
    pytest.importorskip("prometheus_client")
    program(torch=False)
    d = tmp_path / "textfiles"
    d.mkdir()
    a = gpumon_popen("export", "--textfile", d, "--interval", "0.2")
    wait_for(lambda: (d / "gpumon.prom").exists(), what="the textfile")
    a.send_signal(sig)
    _, err = a.communicate(timeout=30)
    assert a.returncode == status, err
    assert err.endswith(said.format(d / "gpumon.prom")), err
    assert not (d / "gpumon.prom").exists()


def test_export_textfile_ctrl_c_right_after_its_first_write_removes_the_file(
        tmp_path, monkeypatch):
    """Ctrl-C between the first write and the loop (seen under load: the file was there, the
    line said "nothing to undo" and the file stayed) is undone as well. The Ctrl-C comes as
    export says where it writes, just after that first write."""
    pytest.importorskip("prometheus_client")
    import io
    from gpumon import cli

    class CtrlCOnTheWritingLine(io.StringIO):
        def write(self, text):
            if text.startswith("gpumon export: writing"):
                raise KeyboardInterrupt
            return super().write(text)
    err = CtrlCOnTheWritingLine()
    monkeypatch.setattr(sys, "stderr", err)
    d = tmp_path / "textfiles"
    d.mkdir()
    assert cli.main(["export", "--textfile", str(d), "--interval", "0.2"]) == 130
    assert err.getvalue().endswith(
        f"gpumon: interrupted (Ctrl-C); removed {d / 'gpumon.prom'}\n"), err.getvalue()
    assert not (d / "gpumon.prom").exists()


def test_export_textfile_ctrl_c_as_its_first_write_is_made_durable_removes_the_file(
        tmp_path, monkeypatch):
    """The file is in place from the rename on, but the write returns only after the folder's
    fsync: a Ctrl-C there (test_export_textfile_ctrl_c_or_sigterm_removes_its_file in the 2.11 CI leg, one
    process at load 8) said "nothing to undo" and left the file to node_exporter."""
    pytest.importorskip("prometheus_client")
    import io
    from gpumon import cli
    fsync = os.fsync

    def ctrl_c_on_the_folders_fsync(fd):
        fsync(fd)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise KeyboardInterrupt
    monkeypatch.setattr(os, "fsync", ctrl_c_on_the_folders_fsync)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    d = tmp_path / "textfiles"
    d.mkdir()
    assert cli.main(["export", "--textfile", str(d), "--interval", "0.2"]) == 130
    assert err.getvalue().endswith(
        f"gpumon: interrupted (Ctrl-C); removed {d / 'gpumon.prom'}\n"), err.getvalue()
    assert not (d / "gpumon.prom").exists()


def test_export_textfile_ctrl_c_before_its_first_write_leaves_an_earlier_file(
        tmp_path, monkeypatch):
    """A file this run did not write (an earlier run's) is not this run's to remove."""
    pytest.importorskip("prometheus_client")
    import io
    from gpumon import cli
    from gpumon.cluster import export

    def ctrl_c(self, directory):
        raise KeyboardInterrupt
    monkeypatch.setattr(export.Exporter, "write_textfile", ctrl_c)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    d = tmp_path / "textfiles"
    d.mkdir()
    (d / "gpumon.prom").write_text("# an earlier run's\n")
    assert cli.main(["export", "--textfile", str(d), "--interval", "0.2"]) == 130
    assert err.getvalue().endswith(NOTHING), err.getvalue()
    assert (d / "gpumon.prom").read_text() == "# an earlier run's\n"


def test_attach_hosts_ctrl_c_while_a_node_connects_is_130_and_leaves_no_transport(tmp_path):
    """A node whose ssh never answers: Ctrl-C ends the command and its ssh with it."""
    pids = tmp_path / "ssh.pids"
    ssh = tmp_path / "fake-ssh"
    ssh.write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep 120\n")
    ssh.chmod(ssh.stat().st_mode | stat.S_IXUSR)
    a = gpumon_popen("attach", "--hosts", "nodeA", "--json", "--ssh", ssh)
    wait_for(lambda: pids.exists() and pids.read_text().strip(), what="the node's ssh")
    rc, _, err = ctrl_c(a)
    assert rc == 130 and err.endswith(NOTHING), err
    ssh_pid = int(pids.read_text().split()[0])
    wait_for(lambda: not _alive(ssh_pid), what="the node's ssh gone")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_ls_ctrl_c_is_130(monkeypatch, capsys):
    """ls ends in milliseconds: the SIGINT is sent while it scans (a real signal to this
    process, through cli.main as `gpumon ls` runs it)."""
    from gpumon import cli
    real_start = client.LocalTarget.start

    def start(self, *a, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the signal is taken here
        return real_start(self, *a, **kw)

    monkeypatch.setattr(client.LocalTarget, "start", start)
    assert cli.main(["ls"]) == 130
    assert capsys.readouterr().err == NOTHING


def test_the_interrupt_line_is_one_line_for_every_outcome():
    from gpumon.interrupt import Interrupted, line
    assert line() == NOTHING.rstrip("\n")
    assert line("removed /x") == "gpumon: interrupted (Ctrl-C); removed /x"
    assert isinstance(Interrupted("x"), KeyboardInterrupt)  # reaches every except of it


if sys.platform != "linux":  # /proc
    pytestmark = pytest.mark.skip("linux only")


def test_ctrl_c_at_the_inject_question_quits_instead_of_answering_no(monkeypatch):
    """It counted as "N" and the live view opened."""
    import io

    from gpumon import inject
    from gpumon.commands.inject import offer_inject

    class Tty(io.StringIO):
        def isatty(self):
            return True

    class CtrlC(Tty):
        def readline(self, *a):
            raise KeyboardInterrupt

    monkeypatch.setattr(inject, "check_target", lambda pid: inject.REMOTE_EXEC_VERSION)
    loaded = []
    monkeypatch.setattr(inject, "inject", lambda pid: loaded.append(pid))
    with pytest.raises(KeyboardInterrupt):
        offer_inject(4242, stdin=CtrlC(), stderr=Tty())
    assert loaded == []
