"""Client.flush, the agent's one send path: it never blocks, keeps what the socket did not take,
and says when the client is gone."""
import socket

import pytest

from gpumon.agent import server


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    yield server.Client(a, 0), b
    a.close()
    b.close()


def test_flush_sends_and_keeps_what_the_socket_did_not_take(pair):
    c, peer = pair
    c.out += b"hello\n"
    assert c.flush() and not c.out
    assert peer.recv(100) == b"hello\n"
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    chunk = b"x" * 4096
    for _ in range(200):  # fill the socket: the rest stays buffered, nothing raises
        c.out += chunk
        assert c.flush()
    assert len(c.out) > 0
    got = 0
    peer.setblocking(False)
    while True:
        try:
            got += len(peer.recv(1 << 20))
        except BlockingIOError:
            break
    assert got + len(c.out) == 200 * 4096


def test_flush_says_the_client_is_gone(pair):
    c, peer = pair
    peer.close()
    c.out += b"sample\n"
    assert c.flush() is False


def test_flush_on_a_closed_socket_says_gone(pair):
    c, peer = pair
    c.sock.close()
    c.out += b"sample\n"
    assert c.flush() is False


def test_send_now_sends_at_once_or_queues_behind_what_waits(pair):
    c, peer = pair
    assert c.send_now(b"one\n") and not c.out
    assert peer.recv(100) == b"one\n"
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sent = 0
    while not c.out:  # until the socket is full: the rest of a line is queued, in order
        assert c.send_now(b"y" * 1000 + b"\n")
        sent += 1
    assert c.send_now(b"last\n") and c.out.endswith(b"last\n")
    peer.close()
    assert c.send_now(b"more\n") is False
