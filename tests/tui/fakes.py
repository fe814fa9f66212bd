"""A scripted stand-in for client.AgentConnection (hello, recv, request, close), a client
Target over such connections (what the attach app subscribes to), and a deterministic
training-like sample generator: no sockets, no clock, no randomness."""
from __future__ import annotations

import math
import queue
import threading
from typing import Any, Callable

from gpumon.client import Target

GiB = 2**30
MiB = 2**20
T0 = 1_700_000_000.0  # a fixed "unix time" for scripted runs
CLIENT_ID = "pid:4242"

_END = object()


def hello(pid: int = 1234, rank: int | None = None, world: int | None = None,
          devices: int = 1, commands: tuple[str, ...] = ("ping", "reset_peaks", "set_rate",
                                                         "status"),
          source: str = "simulated", total: int = 80 * GiB) -> dict:
    return {
        "v": 1, "type": "hello", "pid": pid, "ppid": 1,
        "argv": ["python", "train.py", "--batch", "16"], "cwd": "/work", "hostname": "node1",
        "start_time": T0 - 5.0, "python": "3.11.7", "torch": "2.13.0",
        "devices": [{"index": i, "name": "NVIDIA H200", "total": total, "uuid": f"GPU-{i}"}
                    for i in range(devices)],
        "rank": rank, "local_rank": rank, "world_size": world,
        "allocator": {"backend": "native", "conf": "expandable_segments:True",
                      "expandable_segments": True},
        "source": source, "rate_hz": 10.0, "agent_version": "0.1.0",
        "commands": list(commands), "nvml": None,
    }


def figures(i: int, dev: int = 0, scale: float = 1.0, retries: int = 0, ooms: int = 0,
            total: int = 80 * GiB) -> dict:
    """A training-step-shaped memory curve: params + optimizer state, a forward ramp,
    backward release, a step every 20 samples."""
    phase = (i % 20) / 20.0
    params = 6 * GiB * scale
    opt = 12 * GiB * scale if i >= 20 else 0
    act = 20 * GiB * scale * (phase / 0.5 if phase < 0.5 else (1 - phase) / 0.5)
    alloc = params + opt + act
    reserved = params + opt + 22 * GiB * scale + (i // 50) * 64 * MiB
    return {
        "index": dev, "allocated": int(alloc), "reserved": int(reserved),
        "active": int(alloc * 0.98), "requested": int(alloc * 0.97),
        "inactive_split": int(300 * MiB * (1 + math.sin(i / 7.0)) / 2),
        "peak_allocated": int(params + opt + 20 * GiB * scale),
        "peak_reserved": int(reserved), "peak_active": int(params + opt + 19.6 * GiB * scale),
        "segments": 40 + i // 50, "alloc_retries": retries, "ooms": ooms,
        "device_alloc": 60 + i // 50, "device_free": 20,
        "nvml_used": int(reserved + 734 * MiB + 2 * GiB), "nvml_total": total,
        "proc_used": int(reserved + 734 * MiB),
    }


def sample(i: int, devices: int = 1, rate: float = 10.0, t0: float = T0, **kw) -> dict:
    return {"type": "sample", "seq": i, "t": t0 + i / rate, "cost_us": 21.5,
            "devices": [figures(i, d, **kw) for d in range(devices)],
            "phase": None, "step": i // 20}


def history(n: int, devices: int = 1, **kw) -> list[dict]:
    return [{"type": "history", "samples": [sample(i, devices, **kw) for i in range(n)],
             "last": True}]


class FakeConnection:
    """Plays `script`, then blocks until more is fed (feed()), end() (EOF) or close()."""

    def __init__(self, hello_msg: dict, script: list[dict] | None = None,
                 handlers: dict[str, Callable[[dict], dict]] | None = None) -> None:
        self.hello = hello_msg
        self._q: queue.Queue = queue.Queue()
        for m in script or []:
            self._q.put(m)
        self.handlers = handlers or {}
        self.requests: list[tuple[str, dict]] = []
        self.closed = threading.Event()
        self.played = 0

    def feed(self, *msgs: dict) -> None:
        for m in msgs:
            self._q.put(m)

    def end(self) -> None:
        self._q.put(_END)

    def recv(self, timeout: float | None = None) -> dict | None:
        while True:
            if self.closed.is_set():
                return None
            try:
                m = self._q.get(timeout=0.05)
            except queue.Empty:
                continue
            if m is _END:
                return None
            self.played += 1
            return m

    def request(self, cmd: str, args: dict | None = None, timeout: float = 5.0) -> dict:
        self.requests.append((cmd, dict(args or {})))
        fn = self.handlers.get(cmd)
        if fn is None:
            raise RuntimeError(f"unknown command {cmd!r}")
        return fn(args or {})

    def close(self) -> None:
        self.closed.set()

    def drained(self) -> bool:
        return self._q.empty()


class FakeTarget(Target):
    """The client's Target over scripted connections: each one is a member (key: its pid as
    text) that starts serving, publishes what the connection plays, and at its end has exited
    (gone=True) or become unreachable (its process still runs: a new connection for the same
    key may follow, with add())."""

    def __init__(self, *conns: FakeConnection, gone: bool = True,
                 clock: Callable[[], float] | None = None) -> None:
        super().__init__(clock=clock or (lambda: T0 + 1e6))
        self.gone = gone
        self.conns: dict[str, FakeConnection] = {}
        self._started = False
        for c in conns:
            self.add(c)

    def add(self, conn: FakeConnection, key: str | None = None) -> None:
        key = key or str(conn.hello["pid"])
        self.conns[key] = conn
        if self._started:
            self._pump(key, conn)

    def start(self) -> "FakeTarget":
        self._started = True
        for key, conn in list(self.conns.items()):
            self._pump(key, conn)
        return self

    def state(self, key: str, state: str, line: str = "", **extra: Any) -> None:
        pid = int(key) if key.isdigit() else 0
        self.publish({"type": "state", "key": key, "pid": pid, "state": state, "line": line,
                      "since": self.clock(), "rank": None, **extra})

    def _pump(self, key: str, conn: FakeConnection) -> None:
        def run() -> None:
            self.state(key, "serving", f"pid {key}: connected to gpumon's agent")
            self.publish({**conn.hello, "key": key})
            while (m := conn.recv()) is not None:
                self.publish({**m, "key": key})
            if conn.closed.is_set():
                return
            if self.gone:
                self.state(key, "exited", f"pid {key} ended", status=None, signal=None,
                           how="unknown")
            else:
                self.state(key, "unreachable", f"pid {key}: its agent closed the connection")
        threading.Thread(target=run, daemon=True).start()

    def request(self, key: str, cmd: str, args: dict | None = None,
                timeout: float = 10.0) -> dict:
        return self.conns[key].request(cmd, args, timeout)

    def close(self) -> None:
        for c in self.conns.values():
            c.close()
        self.end()
