"""One connection to one agent's socket: the hello, then a reader thread that routes replies
to the waiting ``request`` and everything else to ``recv`` (or to an ``on_message`` callback).
Standard library only."""
from __future__ import annotations

import itertools
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gpumon import protocol


class AttachError(Exception):
    """Could not attach: no such process, another user's process, no agent... (one line)."""


class AgentError(Exception):
    """A command failed, or the agent went away (one line)."""


@dataclass(frozen=True)
class AgentAddress:
    pid: int
    path: Path


_EOF = object()


class AgentConnection:
    """One connection to an agent. A reader thread routes replies to the waiting ``request``
    and everything else to ``recv``, so a UI thread may loop on recv while another requests."""

    def __init__(self, sock: socket.socket, hello: dict[str, Any], reader: protocol.LineReader,
                 pending_lines: list[bytes], address: AgentAddress | None,
                 on_message: Callable[[dict[str, Any] | None], None] | None = None) -> None:
        self.sock = sock
        self._on_message = on_message
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
                timeout: float = 2.0,
                on_message: Callable[[dict[str, Any] | None], None] | None = None
                ) -> "AgentConnection":
        """Connect and read the hello. on_message: called on the reader thread with every
        history/sample/event/error message, and with None at EOF (recv is then unused)."""
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
        return cls(s, hello, reader, lines[1:], addr, on_message)

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
        if self._on_message is not None:
            self._on_message(msg)
        else:
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
            if self._on_message is not None:
                self._on_message(None)
            else:
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


