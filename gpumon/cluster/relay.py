"""`gpumon relay`: the node end of `gpumon attach --hosts/--slurm`. It follows every gpumon agent
of this user on this node, or with ``--job J`` those of job J only (``client.LocalTarget(None,
jobs=...)``, the same owner of a target's life as the local view) and speaks gpumon's protocol over stdin/stdout, both ways, through whatever
transport started it (ssh, srun). One JSON object per line (gpumon/protocol.py's framing).

relay -> client (stdout):
  ``{"type": "relay", "v", "host", "pid", "gpumon"}``  first line: who answers
  the target's messages as they are (``state``, ``hello``, ``history``, ``sample``, ``event``,
  each with ``key``: the pid as text on this node)
  ``{"type": "relay_ready", "keys": [...]}``  after the first poll: the members now (a client
  that reconnects drops the ones it knew that are not there any more)
  ``{"type": "reply", "id", "ok", "result" | "error"}``  a command's answer
  ``{"type": "heartbeat", "t"}``  every HEARTBEAT_S, so a silent link is seen as one
client -> relay (stdin):
  ``{"v", "type": "cmd", "id", "key", "cmd", "args"}``  a command for the agent of member key
  (snapshot_start/stop, reset_peaks, ...): run in a thread of its own, so a slow one never
  holds the stream; at most MAX_INFLIGHT at once.
EOF on stdin (the ssh session or srun step ended): the relay closes its connections and exits.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any, BinaryIO

from gpumon import protocol

HEARTBEAT_S = 2.0
MAX_INFLIGHT = 16
MAX_TIMEOUT_S = 120.0


class Relay:
    def __init__(self, inp: BinaryIO, out: BinaryIO, host: str | None = None,
                 target: Any = None, jobs: Any = None) -> None:
        if target is None:  # every agent of this user here, or those of these jobs only
            from gpumon import client
            target = client.LocalTarget(None, jobs=jobs)
        self.target = target
        self.inp, self.out = inp, out
        self.host = host or socket.gethostname()
        self._wlock = threading.Lock()
        self._stop = threading.Event()
        self._inflight = threading.BoundedSemaphore(MAX_INFLIGHT)
        self.broken = False

    def send(self, msg: dict[str, Any]) -> bool:
        try:
            data = protocol.encode(msg)
        except (protocol.ProtocolError, TypeError, ValueError):
            return True  # (never happens for the target's plain-data messages) skip it
        with self._wlock:
            if self.broken:
                return False
            try:
                self.out.write(data)
                self.out.flush()
            except (BrokenPipeError, OSError, ValueError):
                self.broken = True
                self._stop.set()
                return False
        return True

    def run(self) -> int:
        from gpumon import __version__
        sub = self.target.subscribe()
        self.send({"type": "relay", "v": protocol.VERSION, "host": self.host,
                   "pid": os.getpid(), "gpumon": __version__})
        self.target.start()
        ready = {"type": "relay_ready", "keys": sorted(self.target.members())}
        threading.Thread(target=self._pump, args=(sub, ready), name="gpumon-relay-out",
                         daemon=True).start()
        try:
            self._read_commands()
        finally:
            self._stop.set()
            self.target.close()
        return 0

    def _pump(self, sub: Any, ready: dict[str, Any]) -> None:
        # what the first poll said (states, hellos) goes first, then relay_ready: a client
        # that waits for it knows every member it names
        for _, msg in sub.drain():
            if not self.send(msg):
                return
        if not self.send(ready):
            return
        next_beat = time.monotonic() + HEARTBEAT_S
        while not self._stop.is_set():
            try:
                item = sub.get(timeout=max(0.05, next_beat - time.monotonic()))
            except TimeoutError:
                item = False
            if item is None:
                return
            if item:
                if not self.send(item[1]):
                    return
            if time.monotonic() >= next_beat:
                if not self.send({"type": "heartbeat", "t": time.time()}):
                    return
                next_beat = time.monotonic() + HEARTBEAT_S

    def _read_commands(self) -> None:
        reader = protocol.LineReader()
        fd = self.inp.fileno()
        while not self._stop.is_set():
            try:
                data = os.read(fd, 65536)
            except OSError:
                return
            if not data:
                return  # EOF: the session ended
            try:
                lines = reader.feed(data)
            except protocol.ProtocolError as e:
                lines = getattr(e, "lines", [])
                self.send({"type": "error", "error": str(e)})
            for line in lines:
                if line.strip():
                    self._command(line)

    def _command(self, line: bytes) -> None:
        try:
            msg = protocol.decode(line)
        except protocol.ProtocolError as e:
            self.send({"type": "error", "error": str(e)})
            return
        mid = msg.get("id")
        if msg.get("type") != "cmd" or not protocol.is_version(msg.get("v")) or \
                type(mid) is not int or not isinstance(msg.get("key"), str) or \
                not isinstance(msg.get("cmd"), str) or not isinstance(msg.get("args", {}), dict):
            self.send({"type": "error", "error": "expected {v, type: cmd, id: int, key, cmd, "
                       "args: {}}"})
            return
        if not self._inflight.acquire(blocking=False):
            self.send({"type": "reply", "id": mid, "ok": False,
                       "error": f"{self.host}: too many commands at once; try again"})
            return
        timeout = msg.get("timeout")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not 0 < timeout <= MAX_TIMEOUT_S:
            timeout = 10.0
        threading.Thread(target=self._run_command, daemon=True, name="gpumon-relay-cmd",
                         args=(mid, msg["key"], msg["cmd"], msg.get("args") or {},
                               float(timeout))).start()

    def _run_command(self, mid: int, key: str, cmd: str, args: dict, timeout: float) -> None:
        from gpumon.client import AgentError
        try:
            result = self.target.request(key, cmd, args, timeout=timeout)
            reply = {"type": "reply", "id": mid, "ok": True, "result": result}
        except AgentError as e:
            reply = {"type": "reply", "id": mid, "ok": False, "error": str(e)}
        except Exception as e:  # the relay answers every command, whatever happened
            reply = {"type": "reply", "id": mid, "ok": False,
                     "error": f"{cmd} failed on {self.host}: {type(e).__name__}: {e}"}
        finally:
            self._inflight.release()
        self.send(reply)


def run_relay(inp: BinaryIO, out: BinaryIO, host: str | None = None,
              jobs: Any = None) -> int:
    try:
        return Relay(inp, out, host, jobs=jobs).run()
    except KeyboardInterrupt:
        return 0
    finally:
        try:
            sys.stderr.flush()
        except OSError:
            pass
