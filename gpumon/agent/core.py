"""The in-process agent: one daemon thread that samples the memory source at a fixed rate and
serves every connected client over a Unix socket, plus the extension registry that the
snapshot and phases parts use.

Why one thread: sampling and serving share the ring buffer and the client list; one thread
needs no locks on the hot path, and a ``select`` with a timeout is the sampling clock. Work
that may take long (snapshot dumps) runs in worker threads (``blocking=True`` commands) and
hands its reply back through a queue.
"""
from __future__ import annotations

import atexit
import collections
import errno
import itertools
import os
import selectors
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from gpumon import protocol
from gpumon.agent import paths
from gpumon.agent import server as srv
from gpumon.agent.log import get_logger

EXTENSIONS = ("gpumon.agent.snapshot", "gpumon.agent.phases", "gpumon.agent.modules")
HISTORY_SECONDS = 600.0  # the ring keeps at least 10 minutes at 10 Hz
MAX_RING = 60_000
MAX_ID = 2 ** 53  # a command id must be an integer below this in magnitude
# Memory budget of the ring (8 devices at 100 Hz would be ~170 MB of JSON otherwise); the ring
# never shrinks below 10 minutes at 10 Hz for it.
RING_BYTES = 64 * 1024 * 1024
READY_POLL_S = 0.25
# The sampling rate a client may ask for (set_rate) unless the program chose a higher one
# (gpumon.start(rate_hz=...) / GPUMON_RATE, or a ceiling: max_rate_hz= / GPUMON_MAX_RATE).
# 10 Hz is inside the noise of a Python-bound training step; 1000 Hz cost it +20-30%.
CLIENT_MAX_RATE = 20.0
# Commands registered with blocking=True and no max_rate of their own: per client per second.
BLOCKING_MAX_RATE = 5.0
# Beside <pid>.sock in the socket dir: <pid>.waiting exists while an agent is loaded but waits
# for the program's first CUDA call (removed when it serves or ends; JSON, see _mark_waiting);
# <pid>.detach asks a waiting injected agent to go (gpumon detach).
WAITING_SUFFIX = ".waiting"
# `gpumon run` names the command it becomes (its own pid, kept by exec) in GPUMON_RUN_PID; every
# agent of the run that serves leaves <that pid>.served beside the sockets, so the command, as it
# ends, knows whether any process of the run (torchrun's ranks included) ever used CUDA
RUN_PID_ENV = "GPUMON_RUN_PID"
SERVED_SUFFIX = ".served"
NEVER_USED_CUDA = ("gpumon: this program never used CUDA, so gpumon had no figures of it (it "
                   "follows a program from its first CUDA call; without a GPU try `gpumon demo`)")
DETACH_SUFFIX = ".detach"
POSTED_WAKE_AT = 256  # queued events wake the agent early only when this many wait
# accept() failing for want of descriptors (the program lives at its fd limit): the listening
# socket is left alone for this long, doubling up to ACCEPT_BACKOFF_MAX (connections wait in
# the kernel's backlog meanwhile); the poll is level-triggered, so retrying at once would spin.
ACCEPT_BACKOFF_MIN = 0.1
ACCEPT_BACKOFF_MAX = 5.0
_NO_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# The descriptors the agent leaves to the program: a connection whose descriptor number is this
# close to RLIMIT_NOFILE is refused (numbers are handed out lowest first, so every number below
# it is in use), else a client would take the program's last free descriptor.
FD_RESERVE = 32


def _fd_headroom(fd: int) -> bool:
    """True if fd leaves the program enough descriptors above it."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return True
    return soft == getattr(resource, "RLIM_INFINITY", -1) or fd < soft - min(FD_RESERVE, soft // 4)


class DescriptorsTaken(Exception):
    """The program closed descriptors of the agent's (os.closerange, a daemon's close-all):
    their numbers may already be files of the program's. The agent stops without touching them."""


def _version() -> str:
    try:
        from gpumon import __version__
        return __version__
    except Exception:
        return "unknown"


# -- paths -----------------------------------------------------------------------------------
def socket_dir(create: bool = False) -> Path:
    """``<base>/gpumon-<uid>`` (base: ``$GPUMON_DIR``, else ``$XDG_RUNTIME_DIR``, else the
    temp dir), made 0700 with create. The agent and the client both call this: a directory
    that is not yours, that others can write, or that is a symbolic link raises
    ``paths.UnsafeDirectory`` (a PermissionError) whose text is one line for the user."""
    return Path(paths.socket_dir(create))


# -- the extension registry (module level: extensions may register before start) -------------
class CommandError(Exception):
    """Raise from a command for a clean error reply (one line)."""


class CommandContext:
    __slots__ = ("client_id", "agent", "connection")

    def __init__(self, client_id: str, agent: "Agent", connection: Any = None) -> None:
        self.client_id = client_id
        self.agent = agent
        self.connection = connection  # this connection (identity only); None if not a client


_commands: dict[str, tuple[Callable[[dict, CommandContext], dict], bool, float | None]] = {}
_sample_extras: list[Callable[[], dict]] = []
_client_gone: list[Callable[[Any], None]] = []
_at_exit: list[Callable[[], None]] = []


def register_command(name: str, fn: Callable[[dict, CommandContext], dict],
                     blocking: bool = False, max_rate: float | None = None) -> None:
    """max_rate: how many times a second one client may run it (more get a clear error
    reply); a blocking command defaults to BLOCKING_MAX_RATE and runs one at a time per
    client."""
    if max_rate is None and blocking:
        max_rate = BLOCKING_MAX_RATE
    _commands[name] = (fn, bool(blocking), float(max_rate) if max_rate else None)


def register_sample_extra(fn: Callable[[], dict]) -> None:
    if fn not in _sample_extras:
        _sample_extras.append(fn)


def register_client_gone(fn: Callable[[Any], None]) -> None:
    """fn(connection) on the agent thread when a client's connection ends (closed, killed,
    dropped for not reading); ``connection`` is what CommandContext.connection was for its
    commands. fn must return at once (start a thread for slow work)."""
    if fn not in _client_gone:
        _client_gone.append(fn)


def register_at_exit(fn: Callable[[], None]) -> None:
    """fn() when the program ends through Python's shutdown, before the agent's exit event
    and stop: an extension's last words (the phases tracker reports the run's last step)."""
    if fn not in _at_exit:
        _at_exit.append(fn)


def broadcast_event(kind: str, **payload: Any) -> None:
    """Send ``{"type":"event","kind":kind, ...payload}`` to every client now. Thread-safe, never
    raises; dropped when no agent is serving."""
    a = _agent
    if a is not None:
        a.post_event(kind, payload)


def queue_event(kind: str, payload: dict[str, Any]) -> None:
    """Like broadcast_event, for frequent events from the training thread (steps, phases): no
    wake-up and no encoding there, both cost the loop a GIL hand-over; the agent sends it with
    its next sample (at most 1 / rate later), in order. payload must not change afterwards."""
    a = _agent
    if a is not None:
        a.post_event(kind, payload, wake=False)


def current_agent() -> "Agent | None":
    return _agent


# -- the agent --------------------------------------------------------------------------------
class Agent:
    def __init__(self, source: Any, rate_hz: float = 10.0, oom_snapshot: bool = False,
                 client_buffer: int = srv.DEFAULT_CLIENT_BUFFER,
                 stall_seconds: float = srv.STALL_SECONDS,
                 max_rate_hz: float | None = None, origin: str = "start") -> None:
        self.source = source
        # how the agent came: "start" (gpumon.start() in the program), "env" (GPUMON=1, gpumon
        # run), "inject" (gpumon inject / attach --inject)
        self.origin = origin
        self._waiting_marker: Path | None = None
        self.rate_hz = float(rate_hz)
        # The highest rate a client may set: the program's own choice, else CLIENT_MAX_RATE.
        self.max_rate_hz = float(max_rate_hz) if max_rate_hz else max(CLIENT_MAX_RATE,
                                                                      self.rate_hz)
        self._next_sample_t = 0.0  # monotonic time of the next sample (set when serving starts)
        self.oom_snapshot = bool(oom_snapshot)
        self.client_buffer = int(client_buffer)
        self.stall_seconds = float(stall_seconds)
        self.pid = os.getpid()
        self.started_at = time.time()
        self.socket_path: Path | None = None
        self.serving = threading.Event()
        self.seq = 0
        self.cost_us_last = 0.0
        self._cost_sum = 0.0
        self._sample_bytes = 0  # size of a recent sample, for the ring's byte budget
        self._ring: collections.deque[bytes] = collections.deque(maxlen=self._ring_len())
        self._ring_first = 0  # seq of _ring[0]
        self._clients: dict[int, srv.Client] = {}
        self._stop = threading.Event()
        self._posted: collections.deque = collections.deque()  # from other threads
        self._ready_callbacks: list[Callable[["Agent"], None]] = []
        # Made when serving starts: a program that closes every fd before its first CUDA call
        # (a daemon's start-up) takes nothing of the agent's. Each descriptor's identity
        # (server.fd_identity) is kept beside it and checked before every use.
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._wake_ident: tuple[Any, Any] = (None, None)
        self._sel: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._listener_ident: tuple[int, int] | None = None
        self._accept_delay = 0.0     # the current accept back-off (0: accepting)
        self._accept_at: float | None = None  # when the listener is watched again
        self._inode: int | None = None
        self._thread: threading.Thread | None = None
        self._paused: dict[int, float] = {}  # fd -> when its line budget allows the next line
        self._threads = 0  # blocking commands running
        self.hello_extra: dict[str, Any] = {}
        self._devices: list[dict[str, Any]] = []
        self._abandoned = False
        self.log = get_logger()

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> "Agent":
        self._thread = threading.Thread(target=self._run, name="gpumon-agent", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._wake()
        t = self._thread
        if t is not None and t is not threading.current_thread() and t.is_alive():
            t.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def when_ready(self, fn: Callable[["Agent"], None]) -> None:
        """Call fn(agent) on the agent thread once the source is ready (torch imported and CUDA
        initialised by the program), or now if it already is. For extensions that need torch."""
        if self.serving.is_set():
            self._call(fn)
        else:
            self._ready_callbacks.append(fn)

    def _call(self, fn: Callable[["Agent"], None]) -> None:
        try:
            fn(self)
        except Exception:
            self.log.exception("ready callback %r failed", fn)

    def _ring_len(self) -> int:
        floor = HISTORY_SECONDS * 10.0
        want = min(MAX_RING, max(floor, HISTORY_SECONDS * self.rate_hz))
        if self._sample_bytes:
            want = min(want, RING_BYTES // self._sample_bytes)
        return int(max(floor, want))

    def _resize_ring(self) -> None:
        n = self._ring_len()
        if self._ring.maxlen != n:
            new = collections.deque(self._ring, maxlen=n)
            self._ring_first += len(self._ring) - len(new)
            self._ring = new

    def _run(self) -> None:
        try:
            try:
                if not self.source.ready():
                    self._mark_waiting()
                    while not self.source.ready():
                        if self._stop.wait(READY_POLL_S):
                            return
                        if self.origin == "inject":
                            self._detach_if_asked()
                self.source.setup()
                self._devices = self.source.device_info()
                self._serve()
            except paths.UnsafeDirectory as e:
                self.log.error("not serving: %s", e)
            except DescriptorsTaken as e:
                self.log.warning("agent stopped: the program closed its descriptors (%s); they "
                                 "were left alone (they may be the program's files now)", e)
            except Exception:
                self.log.exception("agent stopped by an internal error")
            finally:
                self._shutdown()
        except BaseException:  # nothing of the agent's may reach the program's stderr
            pass

    def _shutdown(self) -> None:
        if self._abandoned:
            return
        self._unmark_waiting()
        served = self._sel is not None
        if self._posted and served:
            try:
                self._drain_posted()  # e.g. the exit event
            except Exception:
                pass
        self.serving.clear()
        for c in list(self._clients.values()):
            if srv.owns(c.sock, c.ident):
                c.flush()
            c.close()  # (only if still ours: server.release)
        self._clients.clear()
        srv.release(self._listener, self._listener_ident)
        self._listener = None
        # Unlink the socket only if it is still ours (same process, same file).
        p = self.socket_path
        if p is not None and os.getpid() == self.pid:
            try:
                if os.stat(p).st_ino == self._inode:
                    os.unlink(p)
            except OSError:
                pass
        if self._sel is not None:
            try:
                self._sel.close()
            except Exception:
                pass
        srv.release(self._wake_r, self._wake_ident[0])
        srv.release(self._wake_w, self._wake_ident[1])
        if served:  # an agent that never served (no CUDA) leaves no trace, not even a line
            self.log.info("agent stopped")

    def abandon_in_child(self) -> None:
        """After fork, in the child: stop serving without touching the parent's socket file.
        The agent thread does not exist in the child; close the inherited descriptors so the
        parent's clients see the parent's EOFs, not ours."""
        self._abandoned = True
        self._stop.set()
        self.serving.clear()
        for c in list(self._clients.values()):
            c.close()
        self._clients = {}
        srv.release(self._listener, self._listener_ident)
        srv.release(self._wake_r, self._wake_ident[0])
        srv.release(self._wake_w, self._wake_ident[1])
        if self._sel is not None:
            try:
                self._sel.close()
            except Exception:
                pass

    # -- waiting for the program's first CUDA call ------------------------------------------
    def _mark_waiting(self) -> None:
        """Write <pid>.waiting, so clients can tell "agent loaded, waiting for CUDA" from "no
        agent". Best effort: a failure only costs clients that knowledge."""
        try:
            d = socket_dir(create=True)
            srv.remove_stale_sockets(str(d))
            path = d / f"{self.pid}{WAITING_SUFFIX}"
            data = protocol.encode({"type": "waiting", "pid": self.pid, "since": self.started_at,
                                    "start_time": _process_start_time(), "origin": self.origin,
                                    "source": self.source.kind})
            paths.write_file(str(path), lambda f: f.write(data), private=True,
                             hint=paths.SOCKET_HINT)
            self._waiting_marker = path
        except Exception:
            self.log.exception("could not write the waiting marker")

    def _unmark_waiting(self) -> None:
        path, self._waiting_marker = self._waiting_marker, None
        if path is not None and os.getpid() == self.pid:
            for p in (path, path.with_suffix(DETACH_SUFFIX)):
                try:
                    os.unlink(p)
                except OSError:
                    pass

    def _detach_if_asked(self) -> None:
        """An injected agent that never served has no socket: `gpumon detach` asks it with a
        <pid>.detach file; it runs the same detach command a serving one would."""
        m = self._waiting_marker
        if m is None or not os.path.exists(m.with_suffix(DETACH_SUFFIX)):
            return
        entry = _commands.get("detach")
        if entry is not None:
            _run_command(entry[0], {}, CommandContext("file", self), self.log, "detach")

    # -- hello ------------------------------------------------------------------------------
    def hello(self) -> dict[str, Any]:
        info = self.source.info()
        from gpumon.agent import jobenv
        rank, local_rank, world_size = jobenv.ranks_of(os.environ)

        h = {
            "v": protocol.VERSION, "type": "hello", "pid": self.pid, "ppid": os.getppid(),
            "argv": _proc_argv() or list(getattr(sys, "argv", [])),
            "cwd": _safe(os.getcwd), "hostname": socket.gethostname(),
            "start_time": _process_start_time() or self.started_at,
            "python": sys.version.split()[0], "torch": info.get("torch"),
            "devices": self._devices,
            "rank": rank, "local_rank": local_rank, "world_size": world_size,
            "job_id": jobenv.job_of(os.environ) or None,
            "allocator": info.get("allocator"), "source": self.source.kind,
            "rate_hz": self.rate_hz, "agent_version": _version(),
            "commands": sorted(_commands), "nvml": info.get("nvml"),
            "agent_start": self.started_at, "oom_snapshot": self.oom_snapshot,
            "origin": self.origin,
        }
        h.update(self.hello_extra)
        return h

    # -- serving ----------------------------------------------------------------------------
    def _serve(self) -> None:
        d = socket_dir(create=True)
        srv.remove_stale_sockets(str(d))
        path = d / f"{self.pid}.sock"
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._wake_ident = (srv.fd_identity(self._wake_r.fileno()),
                            srv.fd_identity(self._wake_w.fileno()))
        self._listener, self._inode = srv.listen(str(path))
        self._listener_ident = srv.fd_identity(self._listener.fileno())
        self.socket_path = path
        self._unmark_waiting()  # the socket is there: clients now see a serving agent
        _note_served_for_run(d)
        # poll(2), not epoll: no descriptor of its own that a program's closerange could take
        # and its next open reuse (epoll_wait on the program's own epoll would eat its events).
        sel = self._sel = selectors.PollSelector()
        sel.register(self._listener, selectors.EVENT_READ, "listen")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.serving.set()
        self.log.info("serving %s (source %s, %.3g Hz)", path, self.source.kind, self.rate_hz)
        for fn in self._ready_callbacks:
            self._call(fn)
        self._ready_callbacks.clear()
        self._next_sample_t = time.monotonic()
        next_maint = self._next_sample_t + 1.0
        while not self._stop.is_set():
            timeout = self._next_sample_t
            if self._paused:
                timeout = min(timeout, min(self._paused.values()))
            if self._accept_at is not None:
                timeout = min(timeout, self._accept_at)
            timeout -= time.monotonic()
            events = sel.select(timeout if timeout > 0 else 0)
            self._check_descriptors()  # before any of them is used
            if self._accept_at is not None and time.monotonic() >= self._accept_at:
                self._accept_at = None
                sel.register(self._listener, selectors.EVENT_READ, "listen")
            for key, mask in events:
                tag = key.data
                if tag == "listen":
                    self._accept()
                elif tag == "wake":
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                else:
                    c = self._clients.get(tag)
                    if c is None:
                        continue
                    if mask & selectors.EVENT_READ:
                        self._read(c)
                    if mask & selectors.EVENT_WRITE and c.fd in self._clients:
                        self._pump(c)
            if self._posted:
                self._drain_posted()
            now = time.monotonic()
            if self._paused:
                self._resume(now)
            if now >= self._next_sample_t:
                self._sample()
                self._next_sample_t += 1.0 / self.rate_hz
                if self._next_sample_t < now:  # fell behind (suspended, overloaded): don't burst
                    self._next_sample_t = now + 1.0 / self.rate_hz
            if now >= next_maint:
                next_maint = now + 1.0
                self._maintain(now)

    def _check_descriptors(self) -> None:
        """Raise DescriptorsTaken unless every descriptor of the agent's still refers to what
        it opened (one fstat each: a few microseconds per loop)."""
        if not (srv.owns(self._listener, self._listener_ident)
                and srv.owns(self._wake_r, self._wake_ident[0])
                and srv.owns(self._wake_w, self._wake_ident[1])):
            raise DescriptorsTaken("the listening socket or the wake-up pair")
        for c in self._clients.values():
            if not srv.owns(c.sock, c.ident):
                raise DescriptorsTaken(f"the connection of client {c.id}")

    def _wake(self) -> None:
        # From any thread: never a byte into a descriptor that is no longer ours.
        if not srv.owns(self._wake_w, self._wake_ident[1]):
            return
        try:
            self._wake_w.send(b"x", srv.NOSIGNAL)
        except (BlockingIOError, OSError):
            pass

    def _refuse(self, sock: socket.socket, why: str) -> None:
        try:
            sock.setblocking(False)
            sock.send(protocol.encode({"type": "error", "error": why}), srv.NOSIGNAL)
        except OSError:
            pass
        sock.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _NO_FDS:
                    self._back_off_accept(e)
                else:
                    self.log.warning("accept failed: %s", e)
                return
            if not _fd_headroom(sock.fileno()):
                # Given back at once, and no log line (opening the log takes two more): the
                # next try comes ACCEPT_BACKOFF_MAX later, so the program's own opens meet a
                # descriptor of ours for a few microseconds every 5 s at most.
                self._refuse(sock, "the program has almost no file descriptors left (it is at "
                             "its RLIMIT_NOFILE): gpumon leaves them to it; try again later")
                self._back_off_accept(None)
                return
            self._accept_delay = 0.0
            try:
                pid, uid, _gid = srv.peer_credentials(sock)
            except OSError:
                pid, uid = 0, -1
            if uid != os.getuid():
                # Another user (the socket dir is 0700, but be sure): refuse, say why.
                self._refuse(sock, "permission denied: not the same user")
                self.log.warning("refused a client of uid %s (pid %s)", uid, pid)
                continue
            if len(self._clients) >= srv.MAX_CLIENTS:
                self._refuse(sock, f"too many clients ({srv.MAX_CLIENTS} connected): close one "
                             "and try again")
                continue
            sock.setblocking(False)
            c = srv.Client(sock, pid)
            self._clients[c.fd] = c
            c.cursor = self._ring_first
            try:
                c.out += protocol.encode(self.hello())
            except Exception:
                self.log.exception("hello failed")
                self._drop(c)
                continue
            self._interest(c, selectors.EVENT_READ)
            self._pump(c)

    def _back_off_accept(self, e: OSError | None) -> None:
        """No descriptor for a new connection (e), or none to spare (None: the program's
        last ones): stop watching the listener for a while (the connection waits in the
        backlog) instead of failing on it in a loop."""
        first = self._accept_delay == 0.0 and e is not None
        self._accept_delay = (ACCEPT_BACKOFF_MAX if e is None else min(
            ACCEPT_BACKOFF_MAX, max(ACCEPT_BACKOFF_MIN, 2 * self._accept_delay)))
        self._accept_at = time.monotonic() + self._accept_delay
        try:
            self._sel.unregister(self._listener)
        except (KeyError, ValueError, OSError):
            pass
        if first:
            self.log.warning("cannot accept a client: %s (the program is at its limit of open "
                             "files); retrying every %g s at most", e.strerror or e,
                             ACCEPT_BACKOFF_MAX)

    def _read(self, c: srv.Client) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(c)
            return
        now = time.monotonic()
        c.refill(now)
        c.tokens -= len(data) / 1024
        try:
            lines = c.reader.feed(data)
        except protocol.ProtocolError as e:
            lines = getattr(e, "lines", [])
            self._send(c, {"type": "error", "error": str(e)})
            if c.fd not in self._clients:
                return
        c.pending.extend(filter(None, lines))  # (in C: a flood of empty lines costs nothing)
        self._work(c, now)

    def _work(self, c: srv.Client, now: float) -> None:
        """Handle c's pending lines while its budget lasts; past it, stop reading c until the
        budget refills (``_resume``)."""
        tokens = c.refill(now)
        while c.pending and tokens >= 1:
            c.tokens = tokens = tokens - 1
            line = c.pending.popleft()
            if line.strip():
                self._handle(c, line)
                if c.fd not in self._clients:
                    return
        if c.pending or tokens < 1:
            self._paused[c.fd] = now + (1 - tokens) / srv.LINE_RATE
            self._interest(c)
        elif self._paused.pop(c.fd, None) is not None:
            self._interest(c)

    def _resume(self, now: float) -> None:
        for fd, at in list(self._paused.items()):
            if at <= now:
                c = self._clients.get(fd)
                if c is None:
                    self._paused.pop(fd, None)
                else:
                    self._work(c, now)

    def _interest(self, c: srv.Client, events: int | None = None) -> None:
        """Watch c for reading (unless its line budget is spent) and for writing (while output
        waits or history is due)."""
        if events is None:
            events = (0 if c.fd in self._paused else selectors.EVENT_READ) | (
                selectors.EVENT_WRITE if c.want_write else 0)
        if events == c.events:
            return
        try:
            if not events:
                self._sel.unregister(c.sock)
            elif not c.events:
                self._sel.register(c.sock, events, c.fd)
            else:
                self._sel.modify(c.sock, events, c.fd)
            c.events = events
        except (KeyError, ValueError, OSError):
            pass

    def _handle(self, c: srv.Client, line: bytes) -> None:
        try:
            msg = protocol.decode(line)
        except protocol.ProtocolError as e:
            self._send(c, {"type": "error", "error": str(e)})
            return
        if not protocol.is_version(msg.get("v")):
            v = msg.get("v")
            self._send(c, {"type": "error", "error":
                           f"client speaks protocol v{str(v)[:20]}, this agent speaks "
                           f"v{protocol.VERSION}: use the same gpumon version on both sides"})
            return
        if msg.get("type") != "cmd":
            self._send(c, {"type": "error", "error":
                           f"unexpected message type {msg['type'][:40]!r}"})
            return
        mid = msg.get("id")
        if type(mid) is not int or not -MAX_ID < mid < MAX_ID:
            self._send(c, {"type": "error", "error": "command without an integer 'id' "
                           "(below 2**53 in magnitude)"})
            return
        name, args = msg.get("cmd"), msg.get("args", {})
        if args is None:
            args = {}
        if not isinstance(name, str) or not isinstance(args, dict):
            self._reply(c, mid, error="a command needs a string 'cmd' and an object 'args'")
            return
        entry = _commands.get(name)
        if entry is None:
            self._reply(c, mid, error=f"unknown command {name[:64]!r} (known: "
                        f"{', '.join(sorted(_commands))})")
            return
        fn, blocking, max_rate = entry
        if max_rate is not None:
            wait = c.command_budget(name, max_rate, time.monotonic())
            if wait:
                self._reply(c, mid, error=f"{name}: at most {max_rate:g} a second per client; "
                            f"try again in {wait:.2g} s")
                return
        ctx = CommandContext(c.id, self, c)
        if blocking:
            if name in c.running:
                self._reply(c, mid, error=f"{name} is still running for this client: wait for "
                            "its reply")
                return
            if self._threads >= srv.MAX_COMMAND_THREADS:
                self._reply(c, mid, error=f"the agent is busy ({self._threads} commands "
                            "running): try again in a moment")
                return
            fd = c.fd

            def work() -> None:
                ok, res = False, f"{name} failed"
                try:
                    ok, res = _run_command(fn, args, ctx, self.log, name)
                except BaseException:  # never the program's stderr (threading.excepthook)
                    pass
                finally:  # always: the agent counts the commands running
                    self._posted.append(("reply", fd, c, mid, ok, res, name))
                    self._wake()

            try:
                threading.Thread(target=work, name=f"gpumon-cmd-{name}", daemon=True).start()
            except RuntimeError as e:  # can't start new thread
                self._reply(c, mid, error=f"{name}: cannot start a thread: {e}")
                return
            c.running.add(name)
            self._threads += 1
            return
        ok, res = _run_command(fn, args, ctx, self.log, name)
        if ok:
            self._reply(c, mid, result=res)
        else:
            self._reply(c, mid, error=res)

    def _reply(self, c: srv.Client, mid: int, result: Any = None, error: str | None = None) -> None:
        if error is not None:
            self._send(c, {"type": "reply", "id": mid, "ok": False, "error": error})
            return
        try:
            self._send(c, {"type": "reply", "id": mid, "ok": True, "result": result})
        except (TypeError, ValueError, RecursionError) as e:
            # The command did run: say so, not that it failed.
            self._send(c, {"type": "reply", "id": mid, "ok": False,
                           "error": f"the command ran, but its result could not be sent: "
                                    f"{str(e)[:200]}"})

    def _send(self, c: srv.Client, msg: dict[str, Any]) -> None:
        try:
            data = protocol.encode(msg)
        except protocol.ProtocolError as e:
            data = protocol.encode({"type": "error", "error": str(e)})
        c.out += data
        self._pump(c)

    def _pump(self, c: srv.Client) -> None:
        """Top up history while the buffer is low, send what the socket takes, and arm or
        disarm write interest. Drops the client on error or when its buffer overflows."""
        if c.in_history and len(c.out) < srv.HISTORY_LOW_WATER:
            self._fill_history(c)
        if not c.flush():
            self._drop(c)
            return
        if c.in_history and len(c.out) < srv.HISTORY_LOW_WATER:
            self._fill_history(c)
            if not c.flush():
                self._drop(c)
                return
        if len(c.out) > self.client_buffer:
            self.log.info("dropped client %s: %d bytes unread", c.id, len(c.out))
            self._drop(c)
            return
        want = bool(c.out) or c.in_history
        if want != c.want_write:
            c.want_write = want
            self._interest(c)

    def _fill_history(self, c: srv.Client) -> None:
        ring = self._ring
        while c.in_history and len(c.out) < srv.HISTORY_LOW_WATER:
            if c.cursor < self._ring_first:
                c.cursor = self._ring_first  # the ring wrapped while this client lagged
            start = c.cursor - self._ring_first
            items = list(itertools.islice(ring, start, start + protocol.HISTORY_CHUNK))
            c.cursor += len(items)
            last = c.cursor - self._ring_first >= len(ring)
            c.out += b'{"type":"history","last":' + (b"true" if last else b"false")
            c.out += b',"samples":[' + b",".join(items) + b"]}\n"
            if last:
                c.in_history = False

    def _drop(self, c: srv.Client) -> None:
        self._clients.pop(c.fd, None)
        self._paused.pop(c.fd, None)
        if c.events and self._sel is not None:
            try:
                self._sel.unregister(c.sock)
            except (KeyError, ValueError, OSError):
                pass
        c.events = 0
        c.close()
        for fn in list(_client_gone):
            try:
                fn(c)
            except Exception:
                self.log.exception("client-gone hook %r failed", fn)

    def _drain_posted(self) -> None:
        while self._posted:
            item = self._posted.popleft()
            if item[0] == "event":
                try:  # encoded here, on the agent thread, not on the poster's
                    data = protocol.encode(item[1])
                except Exception as e:
                    self.log.warning("event %r not sent: %s", item[1].get("kind"), e)
                    continue
                for c in list(self._clients.values()):
                    c.out += data
                    self._pump(c)
            elif item[0] == "reply":
                _, fd, c, mid, ok, res, name = item
                self._threads -= 1
                c.running.discard(name)
                if self._clients.get(fd) is c:
                    if ok:
                        self._reply(c, mid, result=res)
                    else:
                        self._reply(c, mid, error=res)
            elif item[0] == "call":
                self._call(item[1])

    def post_event(self, kind: str, payload: dict[str, Any], wake: bool = True) -> None:
        if not self.serving.is_set():
            return
        msg = {"type": "event", "kind": kind}
        try:
            msg.update(payload)
        except Exception as e:
            self.log.warning("event %r not sent: %s", kind, e)
            return
        msg["type"], msg["kind"] = "event", kind
        self._posted.append(("event", msg))
        if wake or len(self._posted) > POSTED_WAKE_AT:
            self._wake()

    def call_soon(self, fn: Callable[["Agent"], None]) -> None:
        """Run fn(agent) on the agent thread (thread-safe)."""
        self._posted.append(("call", fn))
        self._wake()

    # -- sampling (the hot path) ------------------------------------------------------------
    def _sample(self) -> None:
        t0 = time.perf_counter()
        try:
            devices = self.source.read()
        except Exception:
            self.log.exception("sample failed")
            return
        msg = {"type": "sample", "seq": self.seq, "t": time.time(), "cost_us": 0.0,
               "devices": devices, "phase": None, "step": None}
        for fn in _sample_extras:
            try:
                extra = fn()
                if extra:
                    msg.update(extra)
            except Exception:
                self.log.exception("sample extra %r failed; removed", fn)
                _sample_extras.remove(fn)
                break
        if msg["phase"] is None and msg["step"] is None:
            ps = getattr(self.source, "phase_step", None)  # the simulated step's own phases
            if ps is not None:
                msg["phase"], msg["step"] = ps()
        cost = (time.perf_counter() - t0) * 1e6
        msg["cost_us"] = round(cost, 1)
        try:
            data = protocol.encode_sample(msg)
        except (TypeError, ValueError):
            self.log.exception("sample not serialisable")
            return
        self.cost_us_last = cost
        self._cost_sum += cost
        ring = self._ring
        if len(ring) == ring.maxlen:
            self._ring_first += 1
        ring.append(data)
        self.seq += 1
        if self._clients:
            line = data + b"\n"
            t = msg["t"]
            for c in list(self._clients.values()):
                if c.gap:  # a client that asked for fewer live samples (`stream`)
                    if t < c.next_t:
                        if c.in_history or c.out:
                            self._pump(c)
                        continue
                    c.next_t = t + c.gap
                if c.in_history or c.out:  # in history it gets this sample from the ring
                    if not c.in_history:
                        c.out += line
                    self._pump(c)
                elif not c.send_now(line):
                    self._drop(c)
                elif c.out:
                    self._pump(c)  # arm write interest for what the socket did not take

    def _maintain(self, now: float) -> None:
        if self._ring:
            self._sample_bytes = len(self._ring[-1])
            self._resize_ring()
        try:
            if self.source.refresh():
                self._devices = self.source.device_info()
                self.post_event("devices", {"devices": self._devices})
        except Exception:
            self.log.exception("device refresh failed")
        for c in list(self._clients.values()):
            if c.out and now - c.last_progress > self.stall_seconds:
                self.log.info("dropped client %s: stalled %.0f s", c.id, now - c.last_progress)
                self._drop(c)
        # All clients together: unsent output past TOTAL_CLIENT_BUFFER drops the slowest
        # readers first (64 clients x 8 MiB each would otherwise be 512 MiB of the program's).
        total = sum(len(c.out) for c in self._clients.values())
        if total > srv.TOTAL_CLIENT_BUFFER:
            for c in sorted(self._clients.values(), key=lambda c: len(c.out), reverse=True):
                if total <= srv.TOTAL_CLIENT_BUFFER:
                    break
                total -= len(c.out)
                self.log.info("dropped client %s: %d bytes unread, %d for all clients",
                              c.id, len(c.out), total + len(c.out))
                self._drop(c)

    def set_rate(self, rate_hz: float) -> None:
        """On the agent thread. The new interval counts from now, not from the old rate's
        pending sample (0.1 Hz -> 10 Hz would otherwise wait up to 10 s)."""
        self.rate_hz = float(rate_hz)
        self._next_sample_t = time.monotonic() + 1.0 / self.rate_hz
        self._resize_ring()

    def status(self) -> dict[str, Any]:
        return {"pid": self.pid, "rate_hz": self.rate_hz, "source": self.source.kind,
                "seq": self.seq, "history": len(self._ring),
                "clients": [srv.info(c) for c in self._clients.values()],
                "cost_us_last": round(self.cost_us_last, 1),
                "cost_us_mean": round(self._cost_sum / self.seq, 1) if self.seq else None,
                "devices": self.source.device_indices(), "uptime": time.time() - self.started_at,
                "socket": str(self.socket_path)}


def _run_command(fn: Callable, args: dict, ctx: CommandContext, log: Any, name: str) -> tuple[bool, Any]:
    try:
        res = fn(args, ctx)
        return True, ({} if res is None else res)
    except CommandError as e:
        return False, str(e) or f"{name} failed"
    except Exception as e:
        log.exception("command %s failed", name)
        return False, f"{name} failed: {type(e).__name__}: {e}".splitlines()[0]


# -- built-in commands ------------------------------------------------------------------------
def _cmd_ping(args: dict, ctx: CommandContext) -> dict:
    return {"pong": True, "t": time.time(), "pid": ctx.agent.pid}


def _cmd_reset_peaks(args: dict, ctx: CommandContext) -> dict:
    try:
        ctx.agent.source.reset_peaks()
    except Exception as e:
        raise CommandError(f"could not reset peaks: {e}") from None
    return {"reset": ctx.agent.source.device_indices()}


def _cmd_set_rate(args: dict, ctx: CommandContext) -> dict:
    r = args.get("rate_hz")
    top = ctx.agent.max_rate_hz
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0.1 <= r <= 1000):
        raise CommandError(f"set_rate needs rate_hz, a number from 0.1 to {top:g}")
    if r > top:
        raise CommandError(f"rate_hz {r:g} is above this program's ceiling of {top:g} Hz (a "
                           "client may not set more; the program may: GPUMON_RATE / "
                           "GPUMON_MAX_RATE, gpumon run --rate, gpumon.start(rate_hz=...))")
    old = ctx.agent.rate_hz
    ctx.agent.set_rate(float(r))
    return {"rate_hz": float(r), "previous": old}


def _cmd_stream(args: dict, ctx: CommandContext) -> dict:
    """{"max_hz": float}: at most this many live samples a second to this client (an exporter
    needs one a second, not the program's ten); the history and events are unchanged."""
    r = args.get("max_hz")
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0.001 <= r <= 1000):
        raise CommandError("stream needs max_hz, a number from 0.001 to 1000")
    c = ctx.connection
    if c is None or not hasattr(c, "gap"):
        raise CommandError("stream applies to a client connection")
    # a little under 1/max_hz, so a sample a tick early is not skipped for a whole period
    c.gap = 0.0 if r >= ctx.agent.rate_hz else 0.95 / r
    c.next_t = 0.0
    return {"max_hz": float(r), "rate_hz": ctx.agent.rate_hz}


def _cmd_status(args: dict, ctx: CommandContext) -> dict:
    return ctx.agent.status()


def _cmd_sample(args: dict, ctx: CommandContext) -> dict:
    """The figures read now (NVML too), not the last streamed sample: a caller that has
    paused the program at a synchronised point gets numbers it can compare exactly."""
    a = ctx.agent
    try:
        devices = a.source.read(fresh=True)
    except TypeError:  # a source without the fresh argument
        devices = a.source.read()
    return {"t": time.time(), "seq": a.seq, "devices": devices}


# max rates: a fresh sample reads NVML's process list (~0.5 ms) on the agent's thread.
for _n, _f, _r in (("ping", _cmd_ping, None), ("reset_peaks", _cmd_reset_peaks, 5.0),
                   ("set_rate", _cmd_set_rate, 5.0), ("status", _cmd_status, None),
                   ("sample", _cmd_sample, 20.0), ("stream", _cmd_stream, 5.0)):
    register_command(_n, _f, max_rate=_r)


# -- helpers ----------------------------------------------------------------------------------
def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _proc_argv() -> list[str]:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _process_start_time() -> float | None:
    """The process's start time (unix s) from /proc, so it is right even for a late start()."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 (starttime), counted after the comm field
        with open("/proc/stat") as f:
            btime = next(int(l.split()[1]) for l in f if l.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except Exception:
        return None


# -- start / stop (idempotent, fork-safe) -----------------------------------------------------
_agent: Agent | None = None
_lock = threading.Lock()
_atexit_registered = False


def start(rate_hz: float | None = None, source: Any = None, oom_snapshot: bool | None = None,
          **kw: Any) -> Agent | None:
    global _agent, _atexit_registered
    try:
        with _lock:
            if _agent is not None and _agent.pid == os.getpid() and _agent.alive:
                return _agent
            if rate_hz is None:
                rate_hz = float(os.environ.get("GPUMON_RATE") or 10.0)
            if not (0.1 <= rate_hz <= 1000):
                raise ValueError(f"rate {rate_hz} Hz out of range (0.1 to 1000)")
            if oom_snapshot is None:
                oom_snapshot = os.environ.get("GPUMON_OOM_SNAPSHOT", "") not in ("", "0")
            if kw.get("max_rate_hz") is None and os.environ.get("GPUMON_MAX_RATE"):
                try:
                    kw["max_rate_hz"] = min(1000.0, max(0.1, float(os.environ["GPUMON_MAX_RATE"])))
                except ValueError:
                    get_logger().warning("GPUMON_MAX_RATE=%r is not a number: ignored",
                                         os.environ["GPUMON_MAX_RATE"])
            if source is None or isinstance(source, str):
                from gpumon.agent.sources import make_source
                source = make_source(source)
            a = Agent(source, rate_hz=rate_hz, oom_snapshot=oom_snapshot, **kw)
            _agent = a
            if not _atexit_registered:  # first: atexit runs it after the extensions' own
                atexit.register(_stop_at_exit)
                _atexit_registered = True
            # Before serving: a client that connects at once sees every command in the hello.
            _install_extensions(a)
            a.start()
        return a
    except Exception:
        get_logger().exception("gpumon.start failed")
        return None


def _install_extensions(a: Agent) -> None:
    import importlib
    for name in EXTENSIONS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            a.log.exception("extension %s failed to import", name)
            continue
        except Exception:
            a.log.exception("extension %s failed to import", name)
            continue
        try:
            install = getattr(mod, "install", None)
            if install is not None:
                install(a)
        except Exception:
            a.log.exception("extension %s failed to install", name)


def stop() -> None:
    global _agent
    try:
        with _lock:
            a, _agent = _agent, None
        if a is not None and a.pid == os.getpid():
            a.stop()
            _uninstall_extensions(a)
    except Exception:
        get_logger().exception("gpumon.stop failed")


def _uninstall_extensions(a: Agent) -> None:
    """Remove what the extensions hooked into the program (phases' module hooks), so a stopped
    agent costs nothing; a module without ``uninstall`` has nothing to remove."""
    for name in EXTENSIONS:
        mod = sys.modules.get(name)
        fn = getattr(mod, "uninstall", None) if mod is not None else None
        if fn is not None:
            try:
                fn()
            except Exception:
                a.log.exception("extension %s failed to uninstall", name)


def _stop_at_exit() -> None:
    a = _agent
    if a is not None and a.pid == os.getpid():
        for fn in list(_at_exit):
            try:
                fn()
            except Exception:
                a.log.exception("exit callback %r failed", fn)
        a.post_event("exit", exit_facts())
        a.stop(timeout=1.0)
        _say_if_the_run_never_used_cuda(a)


def _note_served_for_run(d: Path) -> None:
    top = os.environ.get(RUN_PID_ENV, "")
    if top.isdigit():
        try:
            (d / f"{top}{SERVED_SUFFIX}").touch(mode=0o600)
        except OSError:
            pass


def _say_if_the_run_never_used_cuda(a: "Agent") -> None:
    """In the command `gpumon run` became, at its end: one line on stderr when no process of
    the run ever used CUDA (a CPU run shows nothing in gpumon, and said nothing of why). Only
    for the torch source, in a program that imported torch, where `gpumon run` asked for the
    agent."""
    if os.environ.get(RUN_PID_ENV) != str(os.getpid()) or a.origin != "env":
        return
    try:
        (socket_dir() / f"{os.getpid()}{SERVED_SUFFIX}").unlink()
        return  # an agent of the run served
    except FileNotFoundError:
        pass
    except Exception:
        return
    if a._sel is not None or getattr(a.source, "kind", None) != "torch" \
            or "torch" not in sys.modules:  # a program that is not torch's: not ours to judge
        return
    try:
        sys.stderr.write(NEVER_USED_CUDA + "\n")
        sys.stderr.flush()
    except Exception:
        pass


def exit_facts() -> dict[str, Any]:
    """What an atexit handler can know of how the program ends: through Python's shutdown
    (a normal end or sys.exit: the status is not visible from here) or an uncaught exception
    (status 1; KeyboardInterrupt: Python ends itself with SIGINT). A signal that kills the
    process (SIGKILL, SIGTERM without a handler) runs no atexit, so no event at all."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is None:
        return {"pid": os.getpid(), "how": "shutdown", "exception": None}
    msg = str(exc).strip().splitlines()
    text = (f"{type(exc).__name__}: {msg[0]}" if msg else type(exc).__name__)[:300]
    if isinstance(exc, KeyboardInterrupt):
        return {"pid": os.getpid(), "how": "signal", "signal": 2, "exception": text}
    return {"pid": os.getpid(), "how": "exception", "status": 1, "exception": text}


def _after_fork_in_child() -> None:
    global _agent, _lock
    _lock = threading.Lock()
    a, _agent = _agent, None
    if a is not None:
        try:
            a.abandon_in_child()
        except Exception:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
