"""A recording belongs to the client that asked for it (unless started with --start): killed
by SIGTERM or SIGKILL, or without a terminal, `gpumon snapshot` leaves no recording on in the
program (issue 16: the next one was refused, naming a dead pid)."""
import os
import signal
import time

import pytest

from gpumon import client

from .conftest import gpumon, gpumon_popen, wait_for


def _events(conn, kinds, timeout=15.0):
    """Events of these kinds, until each kind was seen (or timeout)."""
    got = {}
    end = time.monotonic() + timeout
    while set(kinds) - set(got) and time.monotonic() < end:
        try:
            m = conn.recv(timeout=0.2)
        except TimeoutError:
            continue
        if m is None:
            break
        if m.get("type") == "event" and m.get("kind") in kinds:
            got.setdefault(m["kind"], []).append(m)
    return got


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_snapshot_command_leaves_no_recording_on(program, sig, tmp_path):
    p = program(torch=False)
    watcher = client.AgentConnection.connect(client.discover(p.pid)[0])  # another client
    try:
        snap = gpumon_popen("snapshot", p.pid, "--seconds", "300", "-o", tmp_path)
        wait_for(lambda: watcher.request("snapshot_status")["recording"], what="recording")
        t0 = time.monotonic()
        snap.send_signal(sig)
        ev = _events(watcher, ("recording", "snapshot"))
        st = watcher.request("snapshot_status")
        assert not st["recording"] and time.monotonic() - t0 < 10
        stopped = [e for e in ev["recording"] if e["state"] == "stopped"][0]
        # SIGTERM: the command stops and dumps by itself; SIGKILL: its connection went and
        # the agent did it, and told the clients still there where the file is
        assert stopped["reason"] == ("stop" if sig == signal.SIGTERM else "client gone")
        path = ev["snapshot"][0]["path"]
        assert os.path.exists(path) and os.path.dirname(path) == str(tmp_path)
        out, err = snap.communicate(timeout=30)
        if sig == signal.SIGTERM:  # it says where, as after Ctrl-C
            assert snap.returncode == 0 and out.strip() == path, err
        else:
            assert snap.returncode == -signal.SIGKILL
        r = gpumon("snapshot", p.pid, "--seconds", "0.3")  # the next one is not refused
        assert r.returncode == 0, r.stderr
        assert os.path.exists(r.stdout.strip())
    finally:
        watcher.close()


def test_a_started_recording_outlives_its_command(program):
    p = program(torch=False)
    r = gpumon("snapshot", p.pid, "--start")
    assert r.returncode == 0, r.stderr
    time.sleep(1.0)  # its connection is long gone
    with client.connect(p.pid) as c:
        st = c.request("snapshot_status")
        assert st["recording"] and st["keep"]
    r = gpumon("snapshot", p.pid, "--stop")
    assert r.returncode == 0 and os.path.exists(r.stdout.strip())


def test_without_a_terminal_a_snapshot_needs_a_way_to_end(program):
    p = program(torch=False)
    r = gpumon("snapshot", p.pid)  # stdin at EOF: a job script, nohup
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("gpumon") and r.stderr.count("\n") == 1  # one line
    assert r.stderr.endswith(": stdin is not a terminal, so there is no Enter to stop the "
                             "recording: give --seconds N or --steps N (or --start, then --stop "
                             "later)\n")
    with client.connect(p.pid) as c:
        assert not c.request("snapshot_status")["recording"]  # nothing was started
