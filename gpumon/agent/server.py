"""The agent's Unix socket: the listening socket, the per-client state, and the rules that keep
a slow or broken client from ever costing the training program anything.

All of it runs on the agent's one thread; nothing here blocks (non-blocking sockets, bounded
output buffers: a client that stops reading is dropped, never waited on).
"""
from __future__ import annotations

import collections
import errno
import os
import socket
import stat
import struct
import time
from typing import Any

from gpumon.protocol import LineReader

# A client whose unsent output passes this is dropped (it stopped reading).
DEFAULT_CLIENT_BUFFER = 8 * 1024 * 1024
# ... and all clients together (checked once a second: the slowest readers go first).
TOTAL_CLIENT_BUFFER = 32 * 1024 * 1024
# History is copied into a client's buffer only while its buffer is below this.
HISTORY_LOW_WATER = 256 * 1024
# A client that has made no progress reading for this long, with output waiting, is dropped.
STALL_SECONDS = 30.0
# Client -> agent lines are commands: small (a path, a label, a few numbers).
MAX_CLIENT_LINE = 64 * 1024
MAX_CLIENTS = 64
# Connections the kernel queues until the agent accepts them (it accepts all it finds each
# time the listening socket is readable); Linux caps it at net.core.somaxconn.
BACKLOG = 1024
# Every send: a peer that closed its end gives EPIPE, never SIGPIPE (a program that set
# SIGPIPE to its default action would die of it).
NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)

# What one client may make the agent do, whatever it sends (the agent's thread shares the GIL
# with the training loop): a budget of LINE_RATE tokens a second, bursts of LINE_BURST; a line
# costs one token and every KiB received one more. Past it the agent stops reading that client
# until the budget refills (the kernel's buffer, then the client, waits; no one else does).
LINE_RATE = 100.0
LINE_BURST = 128.0
# A command registered with blocking=True runs in a thread: one of each name at a time per
# client, and at most this many at once in all.
MAX_COMMAND_THREADS = 8

_PEERCRED = struct.Struct("3i")


def pid_alive(pid: int) -> bool:
    """True if pid runs; a zombie (exited, not yet reaped by its parent: a dead rank under
    torchrun) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


def remove_stale_sockets(directory: str) -> list[str]:
    """Unlink ``<pid>.sock`` files and ``<pid>.waiting`` markers whose process is gone (a
    killed agent leaves them)."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        stem, dot, suffix = name.lstrip(".").partition(".")
        if suffix in ("sock", "new"):
            is_kind = stat.S_ISSOCK
        elif suffix in ("waiting", "waiting.tmp", "detach", "served"):  # an agent's marker
            is_kind = stat.S_ISREG
        else:
            continue
        if not stem.isdigit():
            continue
        pid = int(stem)
        # our own old socket goes (a restarted agent); our own marker is the agent's to remove
        if (pid == os.getpid() and is_kind is stat.S_ISSOCK) or not pid_alive(pid):
            path = os.path.join(directory, name)
            try:
                if is_kind(os.lstat(path).st_mode):
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                pass
    return removed


def listen(path: str) -> tuple[socket.socket, int]:
    """Bind and listen under a temporary name, then rename into place, so a socket file that
    exists always accepts. Returns the socket and the inode of the file (to unlink only ours).
    The temporary name is no longer than "<pid>.sock": a folder that fits the final path fits it."""
    tmp = os.path.join(os.path.dirname(path), f".{os.getpid()}.new")
    for p in (tmp, path):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(tmp)
        os.chmod(tmp, 0o600)
        s.listen(BACKLOG)
        s.setblocking(False)
        os.rename(tmp, path)
        ino = os.stat(path).st_ino
    except BaseException:
        s.close()
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return s, ino


def fd_identity(fd: int) -> tuple[int, int] | None:
    """(device, inode) of what the descriptor number fd refers to now, or None if it is closed.
    The agent records it when it opens a descriptor: a program that closes every fd
    (os.closerange) and opens files of its own gets the same numbers, and only this tells
    them apart."""
    try:
        st = os.fstat(fd)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def owns(sock: socket.socket | None, ident: tuple[int, int] | None) -> bool:
    """True if sock's descriptor number still refers to what the agent opened."""
    if sock is None or ident is None:
        return False
    fd = sock.fileno()
    return fd >= 0 and fd_identity(fd) == ident


def release(sock: socket.socket | None, ident: tuple[int, int] | None) -> None:
    """Close sock if its descriptor is still ours; else forget it without closing: the number
    now belongs to the program (a file it opened after closing ours)."""
    if sock is None:
        return
    try:
        if owns(sock, ident):
            sock.close()
        else:
            sock.detach()
    except OSError:
        pass


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the connected peer (Linux SO_PEERCRED)."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return _PEERCRED.unpack(data)


class Client:
    __slots__ = ("sock", "fd", "ident", "id", "peer_pid", "reader", "out", "cursor", "in_history",
                 "last_progress", "connected_at", "want_write", "events", "pending", "tokens",
                 "tokens_t", "running", "buckets", "gap", "next_t")

    def __init__(self, sock: socket.socket, peer_pid: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.ident = fd_identity(self.fd)
        self.peer_pid = peer_pid
        self.id = f"pid:{peer_pid}"
        self.reader = LineReader(MAX_CLIENT_LINE)
        self.out = bytearray()
        self.cursor = 0         # next sample seq to send as history
        self.in_history = True  # history not yet complete: live samples come from the ring
        self.last_progress = time.monotonic()
        self.connected_at = time.time()
        self.want_write = False
        self.events = 0                    # what the selector watches for this client now
        self.pending: collections.deque[bytes] = collections.deque()  # lines not yet handled
        self.tokens = LINE_BURST
        self.tokens_t = time.monotonic()
        self.running: set[str] = set()     # blocking commands of this client in flight
        self.buckets: dict[str, list[float]] = {}  # per command with a max rate: [tokens, t]
        self.gap = 0.0     # `stream` max_hz: live samples at least this many seconds apart
        self.next_t = 0.0  # (sample time) the next live sample this client gets

    def refill(self, now: float) -> float:
        """The line budget now (tokens; below 1, no line may be handled nor read)."""
        t = self.tokens = min(LINE_BURST, self.tokens + (now - self.tokens_t) * LINE_RATE)
        self.tokens_t = now
        return t

    def command_budget(self, name: str, rate: float, now: float) -> float:
        """One use of command name, at most rate a second (bursts of max(1, 2 rate)): 0.0 if
        allowed, else the seconds to wait."""
        burst = max(1.0, 2.0 * rate)
        b = self.buckets.get(name)
        if b is None:
            b = self.buckets[name] = [burst, now]
        b[0] = min(burst, b[0] + (now - b[1]) * rate)
        b[1] = now
        if b[0] >= 1.0:
            b[0] -= 1.0
            return 0.0
        return (1.0 - b[0]) / rate

    def _send(self, data: Any) -> int | None:
        """One non-blocking send: bytes taken (0 when the socket is full), None if gone."""
        try:
            n = self.sock.send(data, NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as e:
            return 0 if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK) else None
        if n:
            self.last_progress = time.monotonic()
        return n

    def flush(self) -> bool:
        """Send what the socket takes now. False if the client is gone."""
        if not self.out:
            return True
        n = self._send(self.out)
        if n is None:
            return False
        del self.out[:n]
        return True

    def send_now(self, data: bytes) -> bool:
        """The live path: send data at once (one syscall, no buffer copy) and queue only what
        the socket did not take; behind anything already queued, it queues and flushes (never
        out of order). False if the client is gone. The caller pumps when ``out`` is left
        non-empty."""
        if self.out:
            self.out += data
            return self.flush()
        n = self._send(data)
        if n is None:
            return False
        if n < len(data):
            self.out += data[n:]
        return True

    def close(self) -> None:
        release(self.sock, self.ident)


def info(c: Client) -> dict[str, Any]:
    return {"id": c.id, "since": c.connected_at, "buffered": len(c.out)}
