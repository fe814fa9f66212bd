"""Issue 22, item 2 on the client's side: whatever an agent sends, gpumon's reader thread
keeps reading and the commands say one line, never a traceback."""
import json
import os
import socket
import threading

import pytest

from gpumon import client

from .harness import gpumon

HELLO = {"v": 1, "type": "hello", "pid": os.getpid(), "ppid": 1, "argv": ["fake"], "cwd": "/",
         "hostname": "h", "start_time": 1.0, "python": "3", "torch": None, "devices": [],
         "rank": None, "local_rank": None, "world_size": None, "allocator": None,
         "source": "simulated", "rate_hz": 10.0, "agent_version": "x", "commands": [],
         "nvml": None}
SAMPLE = {"type": "sample", "seq": 0, "t": 1.0, "cost_us": 1.0, "devices": [], "phase": None,
          "step": None}


class FakeAgent:
    """A socket that answers every connection with the given lines, then keeps it open."""

    def __init__(self, path, lines):
        self.lines = lines
        self.srv = socket.socket(socket.AF_UNIX)
        self.srv.bind(str(path))
        self.srv.listen(8)
        self.conns = []
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(c)
            try:
                c.sendall(b"".join(self.lines))
            except OSError:
                pass

    def close(self):
        self.srv.close()
        for c in self.conns:
            c.close()


def line(msg):
    return json.dumps(msg).encode() + b"\n"


@pytest.mark.parametrize("bad", [b"[" * 1000 + b"\n", b'{"type": "sample", "t": NaN}\n',
                                 b'{"type": "event", "n": ' + b"9" * 5000 + b"}\n"],
                         ids=["deep", "nan", "long-int"])
def test_a_bad_line_from_an_agent_does_not_kill_the_clients_reader(gpumon_dir, bad):
    fake = FakeAgent(gpumon_dir / "fake.sock", [line(HELLO), bad, line(SAMPLE)])
    try:
        with client.AgentConnection.connect(gpumon_dir / "fake.sock") as conn:
            m = conn.recv(timeout=10)
            assert m is not None and m["type"] == "error" and "bad message" in m["error"]
            m = conn.recv(timeout=10)  # the reader thread is alive: the next line arrives
            assert m is not None and m["type"] == "sample", m
    finally:
        fake.close()


def test_a_hello_with_version_true_is_refused(gpumon_dir):
    fake = FakeAgent(gpumon_dir / "fake.sock", [line({**HELLO, "v": True})])
    try:
        with pytest.raises(client.AttachError, match="protocol v"):
            client.AgentConnection.connect(gpumon_dir / "fake.sock")
    finally:
        fake.close()


def test_ls_and_attach_say_one_line_for_a_deeply_nested_hello(gpumon_dir):
    # Named after a live pid (this one), as an agent's socket is: ls lists it.
    fake = FakeAgent(gpumon_dir / f"{os.getpid()}.sock", [b"[" * 100000 + b"\n"])
    try:
        r = gpumon("ls")
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert str(os.getpid()) in r.stdout and "unreachable" in r.stdout
        r = gpumon("attach", str(os.getpid()), "--once")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1
    finally:
        fake.close()
