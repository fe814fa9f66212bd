"""The fault suite's blind spots (issue 30 item 6): its victim only ever started the agent with
gpumon.start(), never under `gpumon run`, never copied its model, never opened files after the
agent started, never lived near its fd limit; and three checks of the agent could be removed
with every fault test still passing (the socket folder's owner check, the client-uid check,
the not-serving check that looked once after 0.8 s). Each test here names the sabotage it
catches; each was verified by making that change to the code and watching it fail."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .harness import Raw, cmd_line, unharmed

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to be another user")


def _files_equal_losses(d: Path, v) -> None:
    """Each file holds the program's last losses, exactly (opened at some step, all after)."""
    want = v.losses()
    for i in range(4):
        got = (d / f"f{i}.txt").read_text().split()
        assert got and got == want[len(want) - len(got):], f"f{i}.txt"


@pytest.mark.parametrize("via", ["start", "run"])
def test_files_opened_after_start_and_a_close_all_are_the_programs(victims, tmp_path, via):
    """A close-all (os.closerange) while a client is connected, then files of the program's
    own, which reuse the agent's descriptor numbers. Catches an agent that closes or writes
    descriptors it no longer owns (the old agent's log traceback landed in one of f0-f3 and
    the program died of EBADF)."""
    files, go = tmp_path / "files", tmp_path / "close-now"
    files.mkdir()
    v = victims(via=via, env={"T_FILES": str(files), "T_CLOSE_WHEN": str(go)})
    r = Raw(v.sock)
    r.send(cmd_line("status"))
    assert r.next() is not None
    go.touch()
    deadline = time.monotonic() + 60
    while v.sock.exists() and time.monotonic() < deadline:  # the agent saw it and stopped
        time.sleep(0.05)
    assert not v.sock.exists() and v.alive()
    time.sleep(0.3)  # the program goes on writing into its files
    assert v.finish() == 0, v.stderr()
    ok, why = unharmed(v, tmp_path)
    assert ok, why
    _files_equal_losses(files, v)


@pytest.mark.parametrize("via", ["start", "run"])
def test_near_its_fd_limit_a_client_takes_nothing(victims, tmp_path, via):
    """Six descriptors left to the program, four of them taken by files it opens after, and a
    short-lived open every 64 steps; clients connecting meanwhile. Catches an agent that takes
    the program's last descriptors (accepts without a reserve: the program's open then fails
    with EMFILE) or spins on EMFILE."""
    files = tmp_path / "files"
    files.mkdir()
    v = victims(via=via, env={"T_FDLIMIT": "6", "T_FILES": str(files)})
    v.wait_steps(512)  # its descriptors as they stay: two free, one used now and then
    conns = []
    for _ in range(6):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(v.sock))
            conns.append(s)
        except OSError:
            s.close()
        time.sleep(0.05)
    time.sleep(0.5)
    assert v.finish() == 0, v.stderr()
    for s in conns:
        s.close()
    ok, why = unharmed(v, tmp_path)
    assert ok, why
    _files_equal_losses(files, v)


def test_a_gpumon_run_victim_that_copies_its_model_is_unharmed(victims, tmp_path):
    """Under `gpumon run` with torch: a deepcopy of the model every 16 steps (an EMA or best
    model), a client attached. Catches anything gpumon puts on the program's model that copying
    cannot take (the phase tracker's hooks: TypeError: cannot pickle 'module' object)."""
    pytest.importorskip("torch")
    v = victims(via="run", torch_loop=True, steps=80, env={"T_COPY": "1"}, timeout=120)
    r = Raw(v.sock)
    r.send(cmd_line("status"))
    assert v.proc.wait(180) == 0, v.stderr()
    ok, why = unharmed(v, tmp_path)
    assert ok, why


@needs_root
def test_a_client_of_another_user_is_refused_by_the_agent_itself(victims, tmp_path):
    """The socket folder (0700) keeps other users out; behind it the agent checks the peer's
    uid (SO_PEERCRED). Opened up here so another uid can reach the socket: catches removing
    that check (before, all of tests/faults passed without it)."""
    import shutil
    import tempfile
    v = victims()
    mode_s = stat.S_IMODE(v.sock.stat().st_mode)
    # A second name for the same socket where another uid can reach it (the test's folders
    # are 0700), and the socket file writable by all: only the agent's own check is left.
    public = Path(tempfile.mkdtemp(prefix="gpumon-uid-", dir="/tmp"))
    public.chmod(0o755)
    link = public / "agent.sock"
    try:
        os.link(v.sock, link)
    except OSError:
        shutil.rmtree(public)
        pytest.skip("cannot hard-link the socket where another user can reach it")
    os.chmod(v.sock, 0o666)
    try:
        code = ("import os, socket, sys\n"
                f"os.setgid({NOBODY}); os.setuid({NOBODY})\n"
                "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
                "s.settimeout(10)\n"
                "s.connect(sys.argv[1])\n"
                "data = b''\n"
                "while not data.endswith(b'\\n'):\n"
                "    chunk = s.recv(65536)\n"
                "    if not chunk:\n"
                "        break\n"
                "    data += chunk\n"
                "sys.stdout.write(data.decode())\n")
        r = subprocess.run([sys.executable, "-c", code, str(link)], capture_output=True,
                           text=True, timeout=60)
    finally:
        os.chmod(v.sock, mode_s)
        shutil.rmtree(public)
    assert r.returncode == 0, r.stderr
    assert '"error"' in r.stdout and "not the same user" in r.stdout, r.stdout[:300]
    assert '"hello"' not in r.stdout
    v.finish()
    ok, why = unharmed(v, tmp_path)
    assert ok, why
