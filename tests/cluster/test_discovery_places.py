"""An agent serves in its runtime dir ($XDG_RUNTIME_DIR/gpumon-UID) when its environment has
one, else in the temp dir: a Slurm batch rank has none, the ssh login that looks for it has
one (pam_systemd). Every client path (ls, attach, the exporter, the relay over a real sshd)
finds the rank wherever it serves, with GPUMON_DIR unset as on a real node."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polling import wait_for

RANK_PROGRAM = ("import gpumon, sys\n"
                "gpumon.start()\n"
                "print('up', flush=True)\n"
                "sys.stdin.read()\n")


def _env(tmp_path: Path, xdg: bool, **extra: str) -> dict:
    """A node's environment without GPUMON_DIR: a login's (a runtime dir) or a batch step's
    (none); both with the same TMPDIR, as on one node."""
    e = dict(os.environ, TMPDIR=str(tmp_path / "tmp"), GPUMON_SOURCE="simulated",
             GPUMON_SIM_READY="now", GPUMON_RATE="10", **extra)
    e.pop("GPUMON_DIR", None)
    e.pop("GPUMON", None)
    if xdg:
        e["XDG_RUNTIME_DIR"] = str(tmp_path / "run")
    else:
        e.pop("XDG_RUNTIME_DIR", None)
    return e


@pytest.fixture
def batch_rank(tmp_path):
    """A rank started as a Slurm batch step starts it: no runtime dir, so it serves in the
    temp dir."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "run").mkdir(mode=0o700)
    p = subprocess.Popen([sys.executable, "-c", RANK_PROGRAM], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=_env(tmp_path, xdg=False, RANK="0", WORLD_SIZE="1"),
                         cwd=tmp_path)
    try:
        assert p.stdout.readline() == "up\n"
        sock = tmp_path / "tmp" / f"gpumon-{os.getuid()}" / f"{p.pid}.sock"
        wait_for(sock.exists, what="the batch rank's socket in the temp dir")
        yield p
    finally:
        p.kill()
        p.wait(10)
        p.stdin.close()
        p.stdout.close()


def test_a_login_with_a_runtime_dir_finds_a_batch_rank_in_the_temp_dir(batch_rank, tmp_path):
    login = _env(tmp_path, xdg=True)

    def gpumon(*args):
        return subprocess.run([sys.executable, "-m", "gpumon", *args], capture_output=True,
                              text=True, timeout=60, env=login, stdin=subprocess.DEVNULL)
    r = gpumon("ls", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["pid"]: row for row in json.loads(r.stdout)}
    assert batch_rank.pid in rows, r.stdout
    assert rows[batch_rank.pid]["socket"] == str(
        tmp_path / "tmp" / f"gpumon-{os.getuid()}" / f"{batch_rank.pid}.sock")
    r = gpumon("attach", str(batch_rank.pid), "--once")
    assert r.returncode == 0 and "cuda:0" in r.stdout, r.stdout + r.stderr
    # (/tmp is looked in too: agents of other programs on this machine may be listed beside)
    r = gpumon("export", "--once", "--host", "n1", "--pid-label")
    assert f'pid="{batch_rank.pid}"' in r.stdout, r.stdout[-2000:] + r.stderr


def test_a_folder_that_is_not_yours_is_not_trusted(tmp_path):
    """A gpumon-UID folder others may write is skipped, and ls says why (one line); with
    nothing else to list that is a failure (exit 1, stdout empty), as tests/faults/test_dirs.py
    asks of every front end."""
    (tmp_path / "tmp").mkdir()
    bad = tmp_path / "tmp" / f"gpumon-{os.getuid()}"
    bad.mkdir()
    os.chmod(bad, 0o777)
    (bad / "4242.sock").touch()
    env = _env(tmp_path, xdg=False)
    r = subprocess.run([sys.executable, "-m", "gpumon", "ls", "--json"], capture_output=True,
                       text=True, timeout=60, env=env)
    if r.stdout:  # agents of other programs in /tmp/gpumon-UID are listed beside: exit 0
        assert r.returncode == 0 and not [x for x in json.loads(r.stdout)
                                          if str(x["socket"]).startswith(str(bad))], r.stdout
    else:
        assert r.returncode == 1, r.stderr
    said = [x for x in r.stderr.splitlines() if str(bad) in x]
    assert said == [f"gpumon: not looked in {bad}: {bad} is writable by others (mode 0777): "
                    f"chmod 700 {bad}, or set GPUMON_DIR to a directory of yours (gpumon "
                    "makes a private folder in it)"], r.stderr


def test_the_relay_over_sshd_finds_a_batch_rank_from_a_login_with_a_runtime_dir(
        batch_rank, ssh_nodes, tmp_path):
    ssh_nodes.add("node1", None, {"XDG_RUNTIME_DIR": tmp_path / "run",
                                  "TMPDIR": tmp_path / "tmp"})
    r = subprocess.run([sys.executable, "-m", "gpumon", "attach", "--hosts", "node1",
                        "--ssh", ssh_nodes.ssh_cmd, "--remote-gpumon", ssh_nodes.remote_gpumon,
                        "--once"], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    rows = [x.split() for x in r.stdout.splitlines()[1:] if x.startswith("node1 ")]
    assert [(x[1], int(x[2])) for x in rows if int(x[2]) == batch_rank.pid] == [
        ("0/1", batch_rank.pid)], r.stdout


def test_a_folder_too_long_for_sockets_is_named_where_agents_from_here_would_serve(
        tmp_path, monkeypatch):
    """A temp dir too long for a socket path: named (no agent started from here can serve)
    when this environment's agents would use it, not from a login whose agents use its
    runtime dir (every ls there would fail for a place nothing serves in)."""
    import tempfile
    from gpumon.client import discovery
    long_tmp = tmp_path / ("d" * 100)
    long_tmp.mkdir()
    (tmp_path / "run").mkdir(mode=0o700)
    theirs = long_tmp / f"gpumon-{os.getuid()}"
    monkeypatch.delenv("GPUMON_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    assert theirs in discovery.candidate_dirs() and theirs not in discovery.unsafe_dirs()
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    why = discovery.unsafe_dirs()[theirs]
    assert "too long for a socket path" in why and "GPUMON_DIR" in why, why
    assert f"not looked in {theirs}: {why}" in discovery.refusal()
