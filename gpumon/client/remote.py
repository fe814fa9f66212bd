"""Targets on other nodes: each node runs ``gpumon relay`` (gpumon/cluster/relay.py) through a
transport the cluster already has (the user's ssh, ``srun --overlap``), and ``ClusterTarget``
merges their streams into one target. Keys are ``host:pid``; every message gains ``host``.

A node's life, as members of the target:

- ``host:`` (the node itself) is a member too: state ``launcher`` (hidden, like a launcher
  whose ranks are followed) while the relay answers; ``unreachable`` with the transport's own
  words ("ssh: connect to host b port 22: Connection refused") while it does not, retried with
  a growing delay (RETRY_S .. RETRY_MAX_S);
- when a node drops (the transport ends, or says nothing for STALL_S: a hung link), its
  processes become ``unreachable`` ("host b: connection lost; reconnecting"): shown as such,
  with their last figures; when the relay answers again they are followed afresh (hello,
  history), and those no longer there are reported ended;
- every node has its own thread and pipe: a node that drops or hangs never holds the others.

Commands (``request(key, ...)``) go to that node's relay, which runs them against its local
target: snapshot, reset peaks and the rest work across nodes; a snapshot file is written on
the node of its rank and its path comes back as that node's path.
"""
from __future__ import annotations

import itertools
import os
import select
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from gpumon import protocol
from gpumon.client.connection import AgentError
from gpumon.client.target import (ENDED, EXITED, LAUNCHER, UNREACHABLE, Target)

STALL_S = 15.0      # a relay sends a heartbeat every 2 s: this long without a byte is a drop
RETRY_S = 1.0
RETRY_MAX_S = 30.0
STDERR_KEEP = 4096  # bytes of the transport's stderr kept, to say why it failed


@dataclass
class Node:
    """One node: its name (as shown: the host given to --hosts, or Slurm's node name) and the
    command that starts ``gpumon relay`` there, its stdin/stdout the relay's."""
    name: str
    argv: list[str]
    via: str = "ssh"  # for messages: "ssh", "srun"


def ssh_node(host: str, ssh: str = "ssh", remote: str = "gpumon") -> Node:
    """ssh with the user's own config and keys (ProxyJump and all): BatchMode (never a
    password prompt in the middle of a view), keep-alives so a dead link is seen."""
    argv = shlex.split(ssh) + ["-T", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5",
                               "-o", "ServerAliveCountMax=3", host, "--",
                               f"{remote} relay --host {shlex.quote(host)}"]
    return Node(host, argv, "ssh")


def srun_node(jobid: str, node: str, srun: str = "srun", remote: str = "gpumon") -> Node:
    """One task on one node of a running job, beside its steps (--overlap)."""
    argv = shlex.split(srun) + ["--jobid", str(jobid), "--overlap", "--nodes", "1",
                                "--ntasks", "1", "--nodelist", node, "--quiet",
                                *shlex.split(remote), "relay", "--host", node]
    return Node(node, argv, "srun")


def slurm_nodes(jobid: str, run: Callable[..., Any] = subprocess.run) -> list[str]:
    """The nodes of a running job: squeue's node list, expanded by scontrol. Raises
    AgentError (one line) when the job is not running or Slurm is not there."""
    try:
        r = run(["squeue", "--noheader", "--jobs", str(jobid), "--format", "%T %N"],
                capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise AgentError("squeue not found: --slurm needs Slurm's commands on this machine")
    except subprocess.TimeoutExpired:
        raise AgentError("squeue did not answer within 30 s")
    if r.returncode != 0:
        why = (r.stderr or r.stdout).strip().splitlines()
        raise AgentError(f"squeue: {why[-1] if why else f'exit status {r.returncode}'}")
    lines = [x.split(None, 1) for x in r.stdout.splitlines() if x.strip()]
    if not lines:
        raise AgentError(f"no Slurm job {jobid} (finished, or not yours)")
    state, nodelist = lines[0][0], (lines[0][1] if len(lines[0]) > 1 else "")
    if state != "RUNNING" or not nodelist.strip():
        raise AgentError(f"Slurm job {jobid} is {state.lower()}, not running: no node to "
                         "attach to yet")
    r = run(["scontrol", "show", "hostnames", nodelist.strip()], capture_output=True,
            text=True, timeout=30)
    if r.returncode != 0:
        raise AgentError(f"scontrol show hostnames {nodelist}: {r.stderr.strip()}")
    return [x.strip() for x in r.stdout.split() if x.strip()]


@dataclass
class _NodeRun:
    node: Node
    proc: subprocess.Popen | None = None
    up: bool = False                         # the relay has said who it is
    keys: set[str] = field(default_factory=set)   # members of this node (full keys)
    waiters: dict[int, list] = field(default_factory=dict)  # id -> [event, reply]
    wlock: threading.Lock = field(default_factory=threading.Lock)
    info: dict[str, Any] = field(default_factory=dict)  # the relay's hello
    why: str | None = None  # why this session was ended from here (a wrong version)


class ClusterTarget(Target):
    """Every agent of every node, through one relay per node (see the module's docstring)."""

    def __init__(self, nodes: Sequence[Node], *, stall_s: float = STALL_S,
                 retry_s: float = RETRY_S, retry_max_s: float = RETRY_MAX_S,
                 env: dict[str, str] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        names = [n.name for n in nodes]
        if len(set(names)) != len(names):
            raise ValueError("a node is named twice")
        self._runs = {n.name: _NodeRun(n) for n in nodes}
        self.stall_s, self.retry_s, self.retry_max_s = stall_s, retry_s, retry_max_s
        self._env = env
        self._stop = threading.Event()
        self._ids = itertools.count(1)
        self._threads: list[threading.Thread] = []
        # who we are to the agents, as a local client is ("pid:N", the peer's pid): the agents
        # of a node see its relay; its id is mapped back to ours (see _by)
        self.client_id = f"pid:{os.getpid()}"

    # -- life ------------------------------------------------------------------------------
    def start(self) -> "ClusterTarget":
        """Starts every node's transport; returns once each node has answered with its
        first members (or failed once), at most a few seconds."""
        if self._threads:
            return self
        firsts = []
        for run in self._runs.values():
            first = threading.Event()
            firsts.append(first)
            t = threading.Thread(target=self._node_loop, args=(run, first), daemon=True,
                                 name=f"gpumon-node-{run.node.name}")
            self._threads.append(t)
            t.start()
        end = time.monotonic() + 20.0
        for f in firsts:
            f.wait(max(0.0, end - time.monotonic()))
        return self

    def close(self) -> None:
        self._stop.set()
        for run in self._runs.values():
            self._kill(run)
            self._fail_waiters(run, "the view was closed")
        self.end()

    def nodes(self) -> dict[str, bool]:
        """{node name: its relay answers now}"""
        return {name: run.up for name, run in self._runs.items()}

    # -- commands --------------------------------------------------------------------------
    def request(self, key: str, cmd: str, args: dict[str, Any] | None = None,
                timeout: float = 10.0) -> dict[str, Any]:
        host, sep, local = key.rpartition(":")
        run = self._runs.get(host) if sep else None
        if run is None or not local:
            raise AgentError(f"{key}: not part of this target")
        m = self.members().get(key)
        if m is None:
            raise AgentError(f"{key}: not part of this target")
        if not run.up or run.proc is None:
            raise AgentError(f"host {host} is unreachable; the command was not sent")
        mid = next(self._ids)
        ev = threading.Event()
        slot: list = [ev, None]
        run.waiters[mid] = slot
        msg = {"v": protocol.VERSION, "type": "cmd", "id": mid, "key": local, "cmd": cmd,
               "args": args or {}, "timeout": timeout}
        try:
            data = protocol.encode(msg)
            with run.wlock:
                run.proc.stdin.write(data)
                run.proc.stdin.flush()
        except (OSError, ValueError, AttributeError) as e:
            run.waiters.pop(mid, None)
            raise AgentError(f"host {host}: could not send {cmd} ({e})") from None
        if not ev.wait(timeout + 5.0):  # the relay's own timeout first, then the link's
            run.waiters.pop(mid, None)
            raise AgentError(f"host {host}: no answer to {cmd} within {timeout + 5:g} s")
        reply = slot[1]
        if not reply.get("ok"):
            raise AgentError(str(reply.get("error") or f"{cmd} failed on {host}"))
        result = reply.get("result")
        return result if isinstance(result, dict) else {}

    def _fail_waiters(self, run: _NodeRun, why: str) -> None:
        waiters, run.waiters = run.waiters, {}
        for slot in waiters.values():
            slot[1] = {"ok": False, "error": f"host {run.node.name}: {why}"}
            slot[0].set()

    # -- one node ----------------------------------------------------------------------------
    def _node_loop(self, run: _NodeRun, first: threading.Event) -> None:
        name = run.node.name
        failures = 0
        self._node_state(run, UNREACHABLE, f"host {name}: connecting ({run.node.via})")
        while not self._stop.is_set():
            why = self._session(run, first)
            first.set()
            was_up, run.up = run.up, False
            self._fail_waiters(run, "connection lost")
            if self._stop.is_set():
                return
            failures = 0 if was_up else failures + 1
            delay = min(self.retry_max_s, self.retry_s * (2 ** max(0, failures - 1)))
            line = f"host {name}: {why}; reconnecting in {delay:g} s"
            self._node_state(run, UNREACHABLE, line)
            for key in sorted(run.keys):
                m = self.members().get(key)
                if m is not None and m.state not in ENDED:
                    self.publish({"type": "state", "key": key, "pid": m.pid, "rank": m.rank,
                                  "host": name, "state": UNREACHABLE, "since": self.clock(),
                                  "line": f"pid {m.pid} on {name}: {why}; reconnecting"})
            if self._stop.wait(delay):
                return

    def _session(self, run: _NodeRun, first: threading.Event) -> str:
        """Runs the transport until it ends; returns why it ended (one phrase)."""
        node = run.node
        try:
            proc = subprocess.Popen(node.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=self._env,
                                    start_new_session=True)
        except OSError as e:
            return f"cannot run {node.argv[0]}: {e.strerror or e}"
        run.proc, run.info, run.why = proc, {}, None
        err = bytearray()
        reader = protocol.LineReader()
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        fds = [out_fd, err_fd]
        last = time.monotonic()
        why = None
        try:
            while fds and not self._stop.is_set():
                ready, _, _ = select.select(fds, [], [], 0.5)
                now = time.monotonic()
                if not ready:
                    if now - last > self.stall_s:
                        why = f"no word from the node for {self.stall_s:g} s"
                        break
                    continue
                for fd in ready:
                    data = os.read(fd, 1 << 16)
                    if fd == err_fd:
                        if not data:
                            fds.remove(fd)
                        else:
                            err += data
                            del err[:-STDERR_KEEP]
                        continue
                    if not data:
                        fds = []
                        break
                    last = now
                    try:
                        lines = reader.feed(data)
                    except protocol.ProtocolError as e:
                        lines = getattr(e, "lines", [])
                    for line in lines:
                        if line.strip():
                            self._relay_message(run, line, first)
        finally:
            self._kill(run)
            run.proc = None
            if err_fd in fds or not fds:  # the transport's last words (ssh: Could not ...)
                end = time.monotonic() + 1.0
                while time.monotonic() < end:
                    if not select.select([err_fd], [], [], 0.1)[0]:
                        continue
                    data = os.read(err_fd, 1 << 16)
                    if not data:
                        break
                    err += data
                    del err[:-STDERR_KEEP]
            for f in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    f.close()
                except OSError:
                    pass
        if why is None and run.why:
            why = run.why
        if why is None:
            rc = proc.returncode
            tail = _last_line(bytes(err))
            if not run.info and tail:
                why = tail  # ssh's or srun's own words: refused, no route, not found, ...
            elif tail:
                why = f"connection lost ({tail})"
            else:
                why = f"connection lost ({node.via} exited with status {rc})"
        return why

    def _relay_message(self, run: _NodeRun, line: bytes, first: threading.Event) -> None:
        try:
            msg = protocol.decode(line)
        except protocol.ProtocolError:
            return  # a login banner or motd line on stdout: not ours
        kind = msg.get("type")
        name = run.node.name
        if kind == "relay":
            if not protocol.is_version(msg.get("v")):
                v = str(msg.get("v"))[:20]
                run.why = (f"its gpumon speaks protocol v{v}, this one v{protocol.VERSION}: "
                           "install the same gpumon version on every node")
                self._kill(run)
                return
            run.info = msg
            return
        if kind == "relay_ready":
            keys = msg.get("keys")
            now_keys = {f"{name}:{k}" for k in keys if isinstance(k, str)} \
                if isinstance(keys, list) else set()
            for key in sorted(run.keys - now_keys):  # ended while the node was away
                m = self.members().get(key)
                if m is not None and m.state not in ENDED:
                    line_ = (f"pid {m.pid} on {name} is no longer there (it ended while the "
                             "node was unreachable)")
                    self.publish({"type": "event", "kind": "exit", "key": key, "pid": m.pid,
                                  "rank": m.rank, "host": name, "status": None,
                                  "signal": None, "how": "unknown", "line": line_,
                                  "t": self.clock()})
                    self.publish({"type": "state", "key": key, "pid": m.pid, "rank": m.rank,
                                  "host": name, "state": EXITED, "line": line_,
                                  "since": self.clock(), "status": None, "signal": None,
                                  "how": "unknown"})
            run.up = True
            n = len(now_keys)
            self._node_state(run, LAUNCHER, f"host {name}: connected ({run.node.via}), "
                             f"{n} process{'es' if n != 1 else ''} with gpumon's agent")
            first.set()
            return
        if kind == "heartbeat":
            return
        if kind == "reply":
            slot = run.waiters.pop(msg.get("id"), None)
            if slot is not None:
                result = msg.get("result")
                if isinstance(result, dict) and "by" in result:
                    msg = {**msg, "result": {**result, "by": self._by(run, result["by"])}}
                slot[1] = msg
                slot[0].set()
            return
        key = msg.get("key")
        if not isinstance(key, str) or kind not in ("state", "hello", "history", "sample",
                                                    "event"):
            return
        full = f"{name}:{key}"
        if kind == "state" and not isinstance(msg.get("state"), str):
            return
        run.keys.add(full)
        out = {**msg, "key": full, "host": name}
        if kind == "event" and "by" in out:  # (recording started/stopped by whom)
            out["by"] = self._by(run, out["by"])
        if "pid" not in out and key.isdigit():
            out["pid"] = int(key)  # (samples carry no pid; front ends tag lines with it)
        self.publish(out)

    def _by(self, run: _NodeRun, by: Any) -> Any:
        """A client id an agent of this node gave ("pid:N", N its peer's pid): this node's
        relay is us (a recording we started must be ours to stop); any other is named with
        its node, so a client there never passes for us (pids of two nodes may be equal)."""
        if not isinstance(by, str):
            return by
        if run.info.get("pid") is not None and by == f"pid:{run.info['pid']}":
            return self.client_id
        return f"{by} on {run.node.name}"

    def _node_state(self, run: _NodeRun, state: str, line: str) -> None:
        name = run.node.name
        self.publish({"type": "state", "key": f"{name}:", "pid": 0, "rank": None,
                      "host": name, "state": state, "line": line, "since": self.clock()})

    def _kill(self, run: _NodeRun) -> None:
        proc = run.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.stdin.close()  # EOF: the relay ends by itself
        except OSError:
            pass
        try:
            proc.wait(1.0)
            return
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except OSError:
            pass
        try:
            proc.wait(2.0)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()


def _last_line(err: bytes) -> str:
    lines = [x.strip() for x in err.decode(errors="replace").splitlines() if x.strip()]
    lines = [x for x in lines if not x.startswith("Warning: Permanently added")]
    if not lines:
        return ""
    return "".join(c if c.isprintable() else "?" for c in lines[-1])[:300]
