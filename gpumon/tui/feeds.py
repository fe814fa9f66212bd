"""Where the live view's data comes from, off the UI thread.

A Feed owns one connection (anything with the AgentConnection interface: hello, recv, request,
close) and a daemon thread that reads it into a buffer. The app drains every buffer once per
frame, so a burst of samples costs one model update per frame, and the UI never blocks on the
network. Connection ends are turned into state messages:
  {"type": "_state", "state": "exited"|"unreachable", "reason": str, "status": int|None}
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

_STATE = "_state"


def process_gone(pid: int | None) -> bool:
    """True if pid no longer runs (a zombie counts as gone)."""
    if pid is None:
        return False
    try:
        import psutil
        p = psutil.Process(pid)
        return p.status() == psutil.STATUS_ZOMBIE
    except ImportError:
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    except Exception:  # NoSuchProcess, AccessDenied...
        try:
            import psutil
            return not psutil.pid_exists(pid)
        except Exception:
            return True


class Feed:
    """Reads one connection in a thread; reconnects while the process lives."""

    def __init__(self, key: str, connect: Callable[[], Any], pid: int | None = None,
                 clock: Callable[[], float] = time.time, reconnect_s: float = 2.0,
                 is_gone: Callable[[int | None], bool] = process_gone) -> None:
        self.key = key
        self.pid = pid
        self._connect = connect
        self._clock = clock
        self._reconnect_s = reconnect_s
        self._is_gone = is_gone
        self._lock = threading.Lock()
        self._buf: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.conn: Any = None
        self.messages = 0

    def start(self) -> "Feed":
        self._thread = threading.Thread(target=self._run, name=f"gpumon-feed-{self.key}",
                                        daemon=True)
        self._thread.start()
        return self

    def _push(self, msg: dict) -> None:
        with self._lock:
            self._buf.append((self._clock(), msg))
            self.messages += 1

    def drain(self) -> list[tuple[float, dict]]:
        with self._lock:
            buf, self._buf = self._buf, []
        return buf

    def pending(self) -> int:
        with self._lock:
            return len(self._buf)

    def _run(self) -> None:
        first = True
        while not self._stop.is_set():
            try:
                conn = self._connect()
            except Exception as e:  # AttachError, OSError, ProtocolError: all one line
                if self._stop.is_set():
                    return
                if self._is_gone(self.pid):
                    self._push({"type": _STATE, "state": "exited",
                                "reason": "" if not first else f"could not connect: {e}"})
                    return
                self._push({"type": _STATE, "state": "unreachable", "reason": _line(e)})
                first = False
                self._stop.wait(self._reconnect_s)
                continue
            first = False
            self.conn = conn
            hello = dict(getattr(conn, "hello", None) or {})
            hello.setdefault("type", "hello")
            if self.pid is None:
                self.pid = hello.get("pid")
            self._push(hello)
            reason = "the agent closed the connection"
            try:
                while not self._stop.is_set():
                    msg = conn.recv()
                    if msg is None:
                        break
                    self._push(msg)
            except Exception as e:
                reason = _line(e)
            finally:
                self.conn = None
                try:
                    conn.close()
                except Exception:
                    pass
            if self._stop.is_set():
                return
            if self._is_gone(self.pid):
                self._push({"type": _STATE, "state": "exited", "reason": ""})
                return
            self._push({"type": _STATE, "state": "unreachable", "reason": reason})
            self._stop.wait(self._reconnect_s)

    def request(self, cmd: str, args: dict | None = None, timeout: float = 10.0) -> dict:
        conn = self.conn
        if conn is None:
            raise RuntimeError("not connected to the agent")
        return conn.request(cmd, args, timeout=timeout)

    def stop(self) -> None:
        self._stop.set()
        conn = self.conn
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass


def _line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


# -- the NVML-only view: a pid without an agent ---------------------------------------------
class NvmlConnection:
    """An AgentConnection look-alike that polls NVML for one pid: no agent needed.

    Raises RuntimeError("NVML unavailable: ...") at construction when NVML can't be used."""

    def __init__(self, pid: int, rate_hz: float = 2.0, nvml: Any = None) -> None:
        if nvml is None:
            try:
                import pynvml as nvml  # nvidia-ml-py
            except ImportError as e:
                raise RuntimeError(f"NVML unavailable: {e}") from None
        try:
            nvml.nvmlInit()
        except Exception as e:
            raise RuntimeError(f"NVML unavailable: {_line(e)}") from None
        self._nvml = nvml
        self.pid = pid
        self._period = 1.0 / max(rate_hz, 0.1)
        self._closed = threading.Event()
        self._seq = 0
        self._handles = []
        devices = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            self._handles.append((i, h))
            name = nvml.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode()
            total = nvml.nvmlDeviceGetMemoryInfo(h).total
            devices.append({"index": i, "name": name, "total": total, "uuid": None})
        argv = None
        start = None
        try:
            import psutil
            p = psutil.Process(pid)
            argv, start = p.cmdline(), p.create_time()
        except Exception:
            pass
        self.hello = {"v": None, "type": "hello", "pid": pid, "argv": argv, "start_time": start,
                      "devices": devices, "source": "nvml", "rate_hz": rate_hz, "commands": [],
                      "nvml": None, "rank": None, "world_size": None, "allocator": None}

    def _sample(self) -> dict:
        nv = self._nvml
        figs = []
        for i, h in self._handles:
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            used = None
            for getter in ("nvmlDeviceGetComputeRunningProcesses",
                           "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    for p in getattr(nv, getter)(h):
                        if p.pid == self.pid and p.usedGpuMemory is not None:
                            used = (used or 0) + p.usedGpuMemory
                except Exception:
                    pass
            figs.append({"index": i, "nvml_used": mem.used, "nvml_total": mem.total,
                         "proc_used": used})
        self._seq += 1
        return {"type": "sample", "seq": self._seq, "t": time.time(), "cost_us": None,
                "devices": figs, "phase": None, "step": None}

    def recv(self, timeout: float | None = None) -> dict | None:
        if self._closed.wait(self._period if self._seq else 0):
            return None
        if process_gone(self.pid):
            return None
        return self._sample()

    def request(self, cmd: str, args: dict | None = None, timeout: float = 5.0) -> dict:
        raise RuntimeError("no gpumon agent in this process (NVML-only view)")

    def close(self) -> None:
        self._closed.set()
