"""Talking to agents: discovery of their sockets, a connection, and an NVML-only reader for a
process that has no agent. No torch, no UI; psutil for process trees, pynvml optional.
"""
from __future__ import annotations

import itertools
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumon import protocol


class AttachError(Exception):
    """Could not attach: no such process, another user's process, no agent... (one line)."""


class AgentError(Exception):
    """A command failed, or the agent went away (one line)."""


@dataclass(frozen=True)
class AgentAddress:
    pid: int
    path: Path


def socket_dir() -> Path:
    from gpumon.agent.core import socket_dir as _sd
    return _sd(create=False)


def _alive(pid: int) -> bool:
    """True if pid runs; a zombie (a dead rank not yet reaped by torchrun) counts as dead."""
    from gpumon.agent.server import pid_alive  # stdlib only; the agent uses the same test
    return pid_alive(pid)


def all_agents() -> list[AgentAddress]:
    """Every live agent socket in this user's socket dir, by pid."""
    d = socket_dir()
    out = []
    try:
        names = os.listdir(d)
    except OSError:
        return out
    for name in names:
        stem = name[:-5] if name.endswith(".sock") else ""
        if stem.isdigit() and _alive(int(stem)):
            out.append(AgentAddress(int(stem), d / name))
    out.sort(key=lambda a: a.pid)
    return out


def descendants(pid: int) -> list[int]:
    import psutil
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def discover(pid: int | None = None) -> list[AgentAddress]:
    """Live agents; with pid: the agent of that pid, or of its descendants (a launcher such as
    torchrun, a shell script or ``gpumon run``), ordered by rank then pid."""
    agents = all_agents()
    if pid is None:
        return agents
    by_pid = {a.pid: a for a in agents}
    if pid in by_pid:
        return [by_pid[pid]]
    found = [by_pid[p] for p in descendants(pid) if p in by_pid]
    found.sort(key=lambda a: (_rank_of(a.pid), a.pid))
    return found


def _rank_of(pid: int) -> int:
    try:
        import psutil
        r = psutil.Process(pid).environ().get("RANK")
        return int(r) if r is not None else 1 << 30
    except Exception:
        return 1 << 30


def check_pid(pid: int) -> None:
    """Raise AttachError with one clear line if pid does not exist or is another user's."""
    import psutil
    try:
        p = psutil.Process(pid)
        uid = p.uids().real
        if p.status() == psutil.STATUS_ZOMBIE:
            raise AttachError(f"process {pid} has exited (zombie)")
    except psutil.NoSuchProcess:
        raise AttachError(f"no process with pid {pid}") from None
    except psutil.AccessDenied:
        raise AttachError(f"process {pid} belongs to another user: run gpumon as that user") from None
    me = os.getuid()
    if uid != me and me != 0:
        try:
            import pwd
            who = pwd.getpwuid(uid).pw_name
        except Exception:
            who = f"uid {uid}"
        raise AttachError(f"process {pid} belongs to {who}: run gpumon as that user")


_EOF = object()


class AgentConnection:
    """One connection to an agent. A reader thread routes replies to the waiting ``request``
    and everything else to ``recv``, so a UI thread may loop on recv while another requests."""

    def __init__(self, sock: socket.socket, hello: dict[str, Any], reader: protocol.LineReader,
                 pending_lines: list[bytes], address: AgentAddress | None) -> None:
        self.sock = sock
        self.hello = hello
        self.address = address
        self.eof = False
        self.error: str | None = None
        self._reader = reader
        self._q: queue.Queue = queue.Queue()
        self._replies: dict[int, list] = {}
        self._rlock = threading.Lock()
        self._slock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        for line in pending_lines:
            self._dispatch(line)
        self._thread = threading.Thread(target=self._read_loop, name="gpumon-conn", daemon=True)
        self._thread.start()

    @classmethod
    def connect(cls, address_or_path: AgentAddress | str | os.PathLike,
                timeout: float = 2.0) -> "AgentConnection":
        if isinstance(address_or_path, AgentAddress):
            addr, path = address_or_path, str(address_or_path.path)
        else:
            path = str(address_or_path)
            stem = os.path.basename(path)[:-5]
            addr = AgentAddress(int(stem), Path(path)) if stem.isdigit() else None
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(path)
        except FileNotFoundError:
            s.close()
            raise AttachError(f"no gpumon agent at {path} (the process may have exited)") from None
        except ConnectionRefusedError:
            s.close()
            raise AttachError(f"the agent at {path} does not answer (the process exited?)") from None
        except PermissionError:
            s.close()
            raise AttachError(f"permission denied on {path}: is it another user's agent?") from None
        except OSError as e:
            s.close()
            raise AttachError(f"cannot connect to {path}: {e.strerror or e}") from None
        reader = protocol.LineReader()
        deadline = time.monotonic() + timeout
        lines: list[bytes] = []
        try:
            while not lines:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AttachError(f"the agent at {path} sent no hello within {timeout:g} s")
                s.settimeout(left)
                try:
                    data = s.recv(65536)
                except socket.timeout:
                    continue
                if not data:
                    raise AttachError(f"the agent at {path} closed the connection")
                lines = reader.feed(data)
            hello = protocol.decode(lines[0])
            if hello.get("type") == "error":
                raise AttachError(f"the agent refused: {hello.get('error')}")
            protocol.check_hello(hello)
        except protocol.ProtocolError as e:
            s.close()
            raise AttachError(str(e)) from None
        except OSError as e:
            s.close()
            raise AttachError(f"lost the agent at {path}: {e}") from None
        except AttachError:
            s.close()
            raise
        s.settimeout(None)
        return cls(s, hello, reader, lines[1:], addr)

    # -- reading --------------------------------------------------------------------------
    def _dispatch(self, line: bytes) -> None:
        try:
            msg = protocol.decode(line)
        except protocol.ProtocolError as e:
            msg = {"type": "error", "error": f"bad message from the agent: {e}"}
        if msg.get("type") == "reply" and isinstance(msg.get("id"), int):
            with self._rlock:
                slot = self._replies.get(msg["id"])
            if slot is not None:
                slot[1] = msg
                slot[0].set()
                return
            return  # a reply nobody waits for any more (timed out)
        self._q.put(msg)

    def _read_loop(self) -> None:
        try:
            while True:
                data = self.sock.recv(262144)
                if not data:
                    break
                for line in self._reader.feed(data):
                    self._dispatch(line)
        except (OSError, protocol.ProtocolError, ValueError) as e:
            if not self._closed:
                self.error = str(e)
        finally:
            self.eof = True
            with self._rlock:
                for slot in self._replies.values():
                    slot[0].set()
            self._q.put(_EOF)

    def recv(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next history/sample/event/error message; None at EOF (the agent or process went
        away, or close() was called). Raises TimeoutError if timeout passes first."""
        if self.eof and self._q.empty():
            return None
        try:
            msg = self._q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no message within {timeout} s") from None
        if msg is _EOF:
            self._q.put(_EOF)  # later calls see EOF too
            return None
        return msg

    def samples(self, timeout: float | None = None):
        """Iterate samples (history ones first, flattened) until EOF."""
        while True:
            msg = self.recv(timeout)
            if msg is None:
                return
            if msg["type"] == "history":
                yield from msg.get("samples", ())
            elif msg["type"] == "sample":
                yield msg

    # -- commands -------------------------------------------------------------------------
    def request(self, cmd: str, args: dict[str, Any] | None = None,
                timeout: float = 5.0) -> dict[str, Any]:
        mid = next(self._ids)
        slot: list = [threading.Event(), None]
        with self._rlock:
            self._replies[mid] = slot
        try:
            data = protocol.encode(protocol.command(mid, cmd, args))
            try:
                with self._slock:
                    self.sock.sendall(data)
            except OSError as e:
                raise AgentError(f"agent connection lost: {e.strerror or e}") from None
            if not slot[0].wait(timeout):
                raise AgentError(f"no reply to {cmd!r} within {timeout:g} s")
            reply = slot[1]
            if reply is None:
                raise AgentError(f"the agent went away before answering {cmd!r}")
            if not reply.get("ok"):
                raise AgentError(str(reply.get("error") or f"{cmd} failed"))
            return reply.get("result") or {}
        finally:
            with self._rlock:
                self._replies.pop(mid, None)

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are (for tests of the agent's error handling)."""
        with self._slock:
            self.sock.sendall(data)

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "AgentConnection":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(pid: int, timeout: float = 2.0) -> AgentConnection:
    """Connect to the agent of pid (or the first one among its descendants)."""
    found = discover(pid)
    if not found:
        raise AttachError(f"no gpumon agent in process {pid} or its children")
    return AgentConnection.connect(found[0], timeout=timeout)


# -- NVML only: a process without an agent ---------------------------------------------------
class NvmlReader:
    """What NVML alone says about one process's GPU memory (no agent, no CUDA context).
    ``error`` is None or why NVML is unavailable; read() never raises."""

    def __init__(self, pid: int) -> None:
        from gpumon.agent.sources import Nvml, _own_pids
        self.pid = pid
        self.nvml = Nvml()
        self.error = self.nvml.error
        self._pids = {pid} | (_nspids(pid) if pid != os.getpid() else _own_pids())
        self._handles: list[tuple[int, Any]] = []
        n = self.nvml.call("nvmlDeviceGetCount") or 0
        for i in range(n):
            h = self.nvml.call("nvmlDeviceGetHandleByIndex", i)
            if h is not None:
                self._handles.append((i, h))

    def devices(self) -> list[dict[str, Any]]:
        out = []
        for i, h in self._handles:
            name = self.nvml.call("nvmlDeviceGetName", h)
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            used, total = self.nvml.memory(h)
            uuid = self.nvml.call("nvmlDeviceGetUUID", h)
            if isinstance(uuid, bytes):
                uuid = uuid.decode(errors="replace")
            out.append({"index": i, "name": name, "total": total, "uuid": uuid})
        return out

    def read(self) -> dict[str, Any]:
        """A sample-shaped dict: devices where the process has memory (proc_used), NVML only."""
        devs = []
        for i, h in self._handles:
            proc = self.nvml.process_used(h, self._pids)
            if proc is None:
                continue
            used, total = self.nvml.memory(h)
            d = {k: None for k in protocol.DEVICE_FIELDS}
            d.update(index=i, nvml_used=used, nvml_total=total, proc_used=proc)
            devs.append(d)
        return {"type": "sample", "pid": self.pid, "t": time.time(), "devices": devs,
                "source": "nvml", "nvml": self.error}


def _nspids(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return {int(x) for x in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()
