"""Real agent processes (simulated source) and real clients over real sockets."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from gpumon import client, protocol
from gpumon.agent.core import socket_dir

from .conftest import read_history, recv_type, wait_for


def status(addr):
    with client.AgentConnection.connect(addr) as c:
        return c.request("status")


def test_hello_history_then_live(spawn):
    p = spawn(rate=50)
    wait_for(lambda: status(p.address)["seq"] >= 20, what="20 samples")
    with client.AgentConnection.connect(p.address) as c:
        h = c.hello
        for f in protocol.HELLO_FIELDS:
            assert f in h, f
        assert h["pid"] == p.pid and h["source"] == "simulated" and h["v"] == protocol.VERSION
        assert h["devices"][0]["index"] == 0 and h["devices"][0]["total"] > 0
        assert {"ping", "reset_peaks", "set_rate", "status", "sample"} <= set(h["commands"])
        assert h["argv"] and "python" in h["argv"][0]
        hist = read_history(c)
        seqs = [s["seq"] for s in hist]
        assert len(seqs) >= 20 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        live = recv_type(c, "sample")
        assert live["seq"] == seqs[-1] + 1  # no gap, no duplicate between history and live
        assert live["devices"][0]["allocated"] > 0


def test_several_clients_get_the_same_stream(spawn):
    p = spawn(rate=50)
    conns = [client.AgentConnection.connect(p.address) for _ in range(4)]
    try:
        for c in conns:
            read_history(c)
        firsts = [recv_type(c, "sample")["seq"] for c in conns]
        target = max(firsts) + 5
        for c in conns:
            while True:
                s = recv_type(c, "sample")
                if s["seq"] == target:
                    break
                assert s["seq"] < target
        st = conns[0].request("status")
        assert len(st["clients"]) == 4
    finally:
        for c in conns:
            c.close()
    wait_for(lambda: len(status(p.address)["clients"]) == 1, what="closed clients removed")


def test_client_killed_mid_stream(spawn, python):
    p = spawn(rate=100)
    reader = subprocess.Popen([python, "-c", f"""
from gpumon import client
c = client.AgentConnection.connect({str(p.address.path)!r})
print("connected", flush=True)
for s in c.samples():
    pass
"""], stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "connected"
    wait_for(lambda: len(status(p.address)["clients"]) == 2, what="reader connected")
    reader.send_signal(signal.SIGKILL)
    reader.wait()
    reader.stdout.close()
    wait_for(lambda: len(status(p.address)["clients"]) == 1, what="killed client dropped")
    with client.AgentConnection.connect(p.address) as c:
        read_history(c)
        a = recv_type(c, "sample")["seq"]
        b = recv_type(c, "sample")["seq"]
        assert b == a + 1
    assert p.poll() is None


def test_slow_client_is_dropped_and_others_keep_streaming(spawn):
    p = spawn(rate=200, env={"GPUMON_SIM_DEVICES": "8"}, kw={"client_buffer": 256 * 1024})
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(str(p.address.path))  # ... and never reads
    with client.AgentConnection.connect(p.address) as fast:
        read_history(fast)
        last = recv_type(fast, "sample")["seq"]
        t0 = time.monotonic()
        dropped = False
        while time.monotonic() - t0 < 30:
            s = recv_type(fast, "sample")
            assert s["seq"] == last + 1, "the fast client missed samples"
            last = s["seq"]
            if s["seq"] % 50 == 0:
                st = fast.request("status")
                if len(st["clients"]) == 1:
                    dropped = True
                    break
        assert dropped, "the slow client was never dropped"
        # Sampling never waited: ~200 Hz throughout.
        n0 = fast.request("status")["seq"]
        time.sleep(0.5)
        assert fast.request("status")["seq"] - n0 >= 40
    slow.close()


def test_malformed_messages_get_errors_and_the_agent_keeps_serving(spawn):
    p = spawn(rate=20)
    with client.AgentConnection.connect(p.address) as c:
        read_history(c)

        def err_after(raw):
            c.send_raw(raw)
            return recv_type(c, "error")["error"]

        assert "not a JSON" in err_after(b"this is not json\n")
        assert "protocol v" in err_after(b'{"v": 999, "type": "cmd", "id": 1, "cmd": "ping"}\n')
        assert "unexpected message type" in err_after(b'{"v": 1, "type": "hello"}\n')
        assert "integer 'id'" in err_after(b'{"v": 1, "type": "cmd", "cmd": "ping"}\n')
        assert "is not an object" in err_after(b"[1, 2, 3]\n")
        # twice the limit: refused once, the rest skipped up to its newline (2 MiB took 20 s:
        # the agent reads a client at most 100 KiB a second, to spare the training loop)
        from gpumon.agent.server import MAX_CLIENT_LINE
        assert "longer than" in err_after(b"x" * (2 * MAX_CLIENT_LINE))
        c.send_raw(b"\n")  # ends the oversized line; an empty line is ignored
        c.send_raw(b'{"v": 1, "type": "cmd", "id": 5, "cmd": "ping", "args": [1]}\n')
        with pytest.raises(client.AgentError, match="unknown command 'no_such'"):
            c.request("no_such")
        assert c.request("ping")["pong"] is True
        assert recv_type(c, "sample")
    p.terminate()
    out, err = p.communicate(timeout=10)
    assert out == b"" and err == b"", "the agent wrote to the program's stdout/stderr"


def test_commands_reset_peaks_set_rate(spawn):
    p = spawn(rate=50)
    with client.AgentConnection.connect(p.address) as c:
        read_history(c)
        wait_for(lambda: recv_type(c, "sample")["devices"][0]["peak_allocated"] > 2 * 2 ** 30,
                 what="a high peak")
        assert c.request("reset_peaks") == {"reset": [0]}
        s = recv_type(c, "sample")["devices"][0]
        assert s["peak_allocated"] == s["allocated"]
        now = c.request("sample")
        assert [d["index"] for d in now["devices"]] == [0] and now["seq"] >= 1
        assert set(protocol.DEVICE_FIELDS) <= set(now["devices"][0])
        assert c.request("set_rate", {"rate_hz": 5})["rate_hz"] == 5.0
        assert c.request("status")["rate_hz"] == 5.0
        a, b = recv_type(c, "sample"), recv_type(c, "sample")
        assert b["t"] - a["t"] > 0.1
        for bad in ({"rate_hz": 0}, {"rate_hz": "fast"}, {}, {"rate_hz": True}):
            with pytest.raises(client.AgentError, match="rate_hz"):
                c.request("set_rate", bad)
        with pytest.raises(client.AgentError, match="unknown command"):
            c.request("frobnicate")
        assert c.request("status")["rate_hz"] == 5.0



def test_faster_rate_takes_effect_at_once(spawn):
    """0.1 Hz schedules the next sample 10 s ahead; switching to 50 Hz must not wait for it."""
    p = spawn(rate=50)
    with client.AgentConnection.connect(p.address) as c:
        read_history(c)
        c.request("set_rate", {"rate_hz": 0.1})
        c.request("set_rate", {"rate_hz": 50})
        t0 = time.monotonic()
        recv_type(c, "sample")
        recv_type(c, "sample")
        assert time.monotonic() - t0 < 2.0

def test_exit_removes_socket_and_tells_clients(spawn):
    p = spawn(rate=20)
    path = p.address.path
    with client.AgentConnection.connect(p.address) as c:
        read_history(c)
        p.terminate()
        msgs = []
        while True:
            m = c.recv(timeout=10)
            if m is None:
                break
            msgs.append(m)
        assert any(m["type"] == "event" and m["kind"] == "exit" for m in msgs)
    p.wait(10)
    assert not path.exists()


def test_stale_sockets_are_removed(spawn, python):
    d = socket_dir(create=True)
    dead = subprocess.Popen([python, "-c", "pass"])
    dead.wait()
    stale = d / f"{dead.pid}.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # the file stays, as after a SIGKILL
    assert stale.exists()
    assert all(a.pid != dead.pid for a in client.discover())  # clients skip it already
    p = spawn(rate=20)
    assert not stale.exists()
    assert [a.pid for a in client.discover()] == [p.pid]


def test_killed_agent_leaves_a_socket_that_the_next_one_removes(spawn):
    p1 = spawn(rate=20)
    path = p1.address.path
    p1.kill()
    p1.wait()
    assert path.exists()
    with pytest.raises(client.AttachError):
        client.AgentConnection.connect(path, timeout=1)
    spawn(rate=20)
    assert not path.exists()


FORK_BODY = r"""
import gpumon.agent.core as core
sys.stdin.readline()  # the test connects first
pid = os.fork()
if pid == 0:
    os.write(1, f"child-agent {core.current_agent()}\n".encode())  # one write: no interleaving
    time.sleep(1.0)
    sys.exit(0)  # runs atexit in the child: must not touch the parent's socket
os.write(1, f"forked {pid}\n".encode())
os.waitpid(pid, 0)
os.write(1, b"reaped\n")
"""


def test_fork_child_neither_serves_nor_breaks_the_parent(spawn):
    e = dict(os.environ, GPUMON_SOURCE="simulated", T_RATE="50", T_KW="{}")
    from .conftest import AGENT_PROG
    import textwrap
    p = subprocess.Popen([sys.executable, "-c", AGENT_PROG.replace("{body}", textwrap.dedent(FORK_BODY))],
                         env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    spawn.procs.append(p)
    addr = wait_for(lambda: client.discover(p.pid), what="agent")[0]
    with client.AgentConnection.connect(addr) as c:
        read_history(c)
        p.stdin.write("go\n")
        p.stdin.flush()
        lines = [p.stdout.readline().strip() for _ in range(3)]
        assert any(l.startswith("forked") for l in lines), lines
        child = int(next(l for l in lines if l.startswith("forked")).split()[1])
        assert "child-agent None" in lines and "reaped" in lines
        assert not (socket_dir() / f"{child}.sock").exists()
        assert addr.path.exists()
        # The connection made before the fork still streams, with no gap.
        a = recv_type(c, "sample")["seq"]
        assert recv_type(c, "sample")["seq"] == a + 1
    with client.AgentConnection.connect(addr) as c2:
        assert c2.hello["pid"] == p.pid
        read_history(c2)
        assert recv_type(c2, "sample")


def test_start_is_idempotent_and_stop_removes_the_socket(spawn):
    p = spawn(rate=20, wait=False, body="""
a.serving.wait(20)
b = gpumon.start()
print("same", a is b, len([n for n in os.listdir(a.socket_path.parent) if n.endswith(".sock")]), flush=True)
path = a.socket_path
gpumon.stop()
print("removed", not path.exists(), flush=True)
c = gpumon.start()
c.serving.wait(20)
print("restarted", c is not a, c.socket_path == path, path.exists(), flush=True)
""")
    assert p.stdout.readline().split() == [b"same", b"True", b"1"]
    assert p.stdout.readline().split() == [b"removed", b"True"]
    assert p.stdout.readline().split() == [b"restarted", b"True", b"True", b"True"]
    assert [a.pid for a in client.discover()] == [p.pid]


def test_peer_credentials_are_checked():
    from gpumon.agent import server
    a, b = socket.socketpair()
    pid, uid, gid = server.peer_credentials(a)
    assert (pid, uid) == (os.getpid(), os.getuid())
    a.close(), b.close()


def test_connect_errors_are_one_line(tmp_path):
    with pytest.raises(client.AttachError, match="no gpumon agent"):
        client.AgentConnection.connect(tmp_path / "123.sock")
    # A socket that accepts and sends garbage instead of a hello.
    path = tmp_path / "1.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)
    import threading

    def serve():
        conn, _ = srv.accept()
        conn.sendall(b'{"type": "hello", "v": 42}\n')
        time.sleep(0.5)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    with pytest.raises(client.AttachError, match="v42"):
        client.AgentConnection.connect(path)
    srv.close()


def test_in_process_agent_never_raises_into_the_program(monkeypatch):
    """A source that fails on every read: the agent logs, the program carries on."""
    from gpumon.agent import core
    from gpumon.agent.sources import SimulatedSource

    class Broken(SimulatedSource):
        def read(self):
            raise RuntimeError("broken source")

    a = core.Agent(Broken(), rate_hz=100)
    a.start()
    try:
        wait_for(lambda: a.serving.is_set(), what="serving")
        with client.AgentConnection.connect(a.socket_path) as c:
            assert c.request("ping")["pong"]
            assert read_history(c) == []
        assert a.alive
    finally:
        a.stop()
    assert not a.socket_path.exists()


def test_a_client_that_disconnects_mid_message_costs_nothing(spawn):
    p = spawn(rate=50)
    for _ in range(5):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(p.address.path))
        s.sendall(b'{"v": 1, "type": "cmd", "id": 1, "cmd": "pi')  # half a line, then gone
        s.close()
    with client.AgentConnection.connect(p.address) as c:
        assert c.request("ping")["pong"]
        wait_for(lambda: len(c.request("status")["clients"]) == 1, what="half-clients dropped")
    assert p.poll() is None


def test_log_goes_where_GPUMON_LOG_says_and_nowhere_else(spawn, tmp_path):
    log = tmp_path / "agent.log"
    p = spawn(rate=20, env={"GPUMON_LOG": str(log)})
    wait_for(lambda: log.exists() and "serving" in log.read_text(), what="a log line")
    p.terminate()
    out, err = p.communicate(timeout=10)
    assert out == b"" and err == b""
    q = spawn(rate=20, env={"GPUMON_LOG": "stderr"})
    q.terminate()
    out, err = q.communicate(timeout=10)
    assert b"gpumon[" in err and b"serving" in err and out == b""


def test_a_log_that_cannot_be_written_stays_silent(spawn, tmp_path):
    p = spawn(rate=20, env={"GPUMON_LOG": str(tmp_path / "no-such-dir" / "agent.log")})
    with client.AgentConnection.connect(p.address) as c:
        c.send_raw(b"garbage\n")  # makes the agent log a warning or two
        assert recv_type(c, "error")
    p.terminate()
    out, err = p.communicate(timeout=10)
    assert out == b"" and err == b""
