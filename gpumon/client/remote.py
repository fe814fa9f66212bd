"""Targets on other nodes: each node runs ``gpumon relay`` (gpumon/cluster/relay.py) through a
transport the cluster already has (the user's ssh, ``srun --overlap``), and ``ClusterTarget``
merges their streams into one target. Keys are ``host:pid``; every message gains ``host``.

A node's life, as members of the target:

- ``host:`` (the node itself) is a member too: ``connecting`` while its transport starts,
  ``connected`` while the relay answers; ``unreachable`` with the transport's own words
  ("ssh: connect to host b port 22: Connection refused") while it does not, retried with a
  growing delay (RETRY_S .. RETRY_MAX_S) that the line names ("retrying in 4 s"), or not
  retried where retrying cannot help (PERMANENT: access denied, no such job, no gpumon there,
  another protocol version); ``ended`` when the job ended;
- when a node drops (the transport ends, or says nothing for STALL_S: a hung link), its
  processes become ``unreachable`` ("host b: connection lost; reconnecting"): shown as such,
  with their last figures; when the relay answers again they are followed afresh (hello,
  history), and those no longer there are reported ended;
- every node has its own thread and pipe: a node that drops or hangs never holds the others;
- the target is a job: with ``job_watch`` (``slurm_watch``: squeue every WATCH_S) a job that
  is no longer running ends every rank ("exited", how "job_ended") and node ("ended"), then
  the target; without it (``--hosts``), once every rank seen has ended and every node answers,
  END_GRACE_S later (a torchrun restart comes back sooner), the target ends. Nodes that all
  failed for good end it too. ``ended_how`` says which: "job", "failed".

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
from gpumon.client.target import (CONNECTED, CONNECTING, ENDED, EXITED, HELPER, LAUNCHER,
                                  NODE_ENDED, UNREACHABLE, Target)

STALL_S = 15.0      # a relay sends a heartbeat every 2 s: this long without a byte is a drop
RETRY_S = 1.0
RETRY_MAX_S = 30.0
STDERR_KEEP = 4096  # bytes of the transport's stderr kept, to say why it failed
WATCH_S = 5.0       # how often squeue is asked whether the job still runs
END_GRACE_S = 5.0   # every rank ended this long (and no new one): the job ended (--hosts)
# What a transport says when retrying cannot help: said once, the node is not retried.
PERMANENT = ("access/permission denied", "invalid job id", "already completing or completed",
             "job has expired", "permission denied (publickey", "host key verification failed",
             "could not resolve hostname", "command not found", "no such file or directory",
             "install the same gpumon version",
             "unrecognized arguments")  # an older gpumon there (relay --job)


def is_permanent(why: str) -> bool:
    low = why.lower()
    return any(p in low for p in PERMANENT)


@dataclass
class Node:
    """One node: its name (as shown: the host given to --hosts, or Slurm's node name) and the
    command that starts ``gpumon relay`` there, its stdin/stdout the relay's."""
    name: str
    argv: list[str]
    via: str = "ssh"  # for messages: "ssh", "srun"


def _job_args(jobs: Sequence[str] | None) -> list[str]:
    return ["--job", ",".join(jobs)] if jobs else []


def ssh_node(host: str, ssh: str = "ssh", remote: str = "gpumon",
             jobs: Sequence[str] | None = None) -> Node:
    """ssh with the user's own config and keys (ProxyJump and all): BatchMode (never a
    password prompt in the middle of a view), keep-alives so a dead link is seen. jobs: the
    relay follows only the processes of these jobs (``--job``)."""
    relay = " ".join([remote, "relay", "--host", shlex.quote(host),
                      *map(shlex.quote, _job_args(jobs))])
    argv = shlex.split(ssh) + ["-T", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5",
                               "-o", "ServerAliveCountMax=3", host, "--", relay]
    return Node(host, argv, "ssh")


def srun_node(jobid: str, node: str, srun: str = "srun", remote: str = "gpumon",
              jobs: Sequence[str] | None = None) -> Node:
    """One task on one node of a running job, beside its steps (--overlap); its relay follows
    only that job's processes (jobs: the names the job goes by; default jobid)."""
    argv = shlex.split(srun) + ["--jobid", str(jobid), "--overlap", "--nodes", "1",
                                "--ntasks", "1", "--nodelist", node, "--quiet",
                                *shlex.split(remote), "relay", "--host", node,
                                *_job_args(jobs or [str(jobid)])]
    return Node(node, argv, "srun")


def _squeue_line(err: str, rc: int) -> str:
    why = err.strip().splitlines()
    line = why[-1].strip() if why else f"exit status {rc}"
    # squeue's own prefix ("squeue: error: ...") is not said twice
    return line if line.startswith("squeue:") else f"squeue: {line}"


def slurm_job(jobid: str, run: Callable[..., Any] = subprocess.run
              ) -> tuple[dict[str, str], set[str]]:
    """({node: the job id to run srun in there}, every job id of it) of a running job, or of
    the running elements of a job array (``--slurm ARRAYID``, or ``ARRAYID_TASK``): squeue's
    node lists, expanded by scontrol. Raises AgentError (one line) when nothing of it runs or
    Slurm is not there."""
    state, rows = squeue_states(jobid, run)
    if state is not None:
        raise AgentError(state)
    running = [(jid, nodes) for jid, st, nodes in rows if st == "RUNNING" and nodes]
    if not running:
        st = rows[0][1].lower()
        raise AgentError(f"Slurm job {jobid} is {st}, not running: no node to attach to yet")
    out: dict[str, str] = {}
    for jid, nodelist in running:
        r = run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                text=True, timeout=30)
        if r.returncode != 0:
            raise AgentError(f"scontrol show hostnames {nodelist}: {r.stderr.strip()}")
        for n in r.stdout.split():
            out.setdefault(n.strip(), jid)
    return out, {jid for jid, _, _ in rows}


def slurm_nodes(jobid: str, run: Callable[..., Any] = subprocess.run) -> list[str]:
    """The nodes of a running job (see slurm_job)."""
    return list(slurm_job(jobid, run)[0])


def squeue_states(jobid: str, run: Callable[..., Any] = subprocess.run
                  ) -> tuple[str | None, list[tuple[str, str, str]]]:
    """(None, [(job id, state, node list)]) of a job (every element of an array), or (why,
    []) when Slurm knows no such job: one line. Raises AgentError when squeue cannot say."""
    try:
        r = run(["squeue", "--noheader", "--jobs", str(jobid), "--format", "%A %T %N"],
                capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise AgentError("squeue not found: --slurm needs Slurm's commands on this machine")
    except subprocess.TimeoutExpired:
        raise AgentError("squeue did not answer within 30 s")
    if r.returncode != 0:
        line = _squeue_line(r.stderr or r.stdout, r.returncode)
        if "invalid job id" in line.lower():  # finished and purged, or never was
            return f"no Slurm job {jobid} ({line})", []
        raise AgentError(line)
    rows = []
    for x in r.stdout.splitlines():
        f = x.split()
        if len(f) >= 2:
            rows.append((f[0], f[1], f[2] if len(f) > 2 else ""))
    if not rows:
        return f"no Slurm job {jobid} (finished, or not yours)", []
    return None, rows


def slurm_watch(jobid: str, run: Callable[..., Any] = subprocess.run
                ) -> Callable[[], str | None]:
    """For ClusterTarget's job_watch: None while some of the job runs (or squeue cannot
    say: a busy controller is no end), else one line that says how it ended."""
    def watch() -> str | None:
        try:
            gone, rows = squeue_states(jobid, run)
        except AgentError:
            return None
        if gone:
            return f"Slurm job {jobid} ended ({gone.split(' (', 1)[1].rstrip(')')})" \
                if " (" in gone else gone
        states = {st for _, st, _ in rows}
        if "RUNNING" in states or "PENDING" in states or "CONFIGURING" in states:
            return None
        return f"Slurm job {jobid} ended ({', '.join(sorted(states)).lower()})"
    return watch


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
    done: bool = False      # failed for good (not retried), or the job ended


class ClusterTarget(Target):
    """Every agent of every node, through one relay per node (see the module's docstring)."""

    def __init__(self, nodes: Sequence[Node], *, stall_s: float = STALL_S,
                 retry_s: float = RETRY_S, retry_max_s: float = RETRY_MAX_S,
                 env: dict[str, str] | None = None,
                 job_watch: Callable[[], str | None] | None = None,
                 watch_s: float = WATCH_S, end_grace_s: float | None = END_GRACE_S,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self._job_watch, self.watch_s, self.end_grace_s = job_watch, watch_s, end_grace_s
        self.ended_how: str | None = None  # "job" (ended, or every rank did), "failed"
        self.ended_line = ""
        self._end_lock = threading.Lock()
        self._all_ended_at: float | None = None
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
        t = threading.Thread(target=self._watch_loop, daemon=True, name="gpumon-job-watch")
        self._threads.append(t)
        t.start()
        end = time.monotonic() + 20.0
        for f in firsts:
            f.wait(max(0.0, end - time.monotonic()))
        return self

    # -- the job's end -------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        """squeue every watch_s (with a job_watch); every rank ended for end_grace_s."""
        next_watch = time.monotonic() + self.watch_s
        while not self._stop.wait(0.25):
            now = time.monotonic()
            if self._job_watch is not None and now >= next_watch:
                next_watch = now + self.watch_s
                self._check_job()
            if self.end_grace_s is not None:
                with self._lock:
                    at = self._all_ended_at
                if at is not None and now - at >= self.end_grace_s and self._all_ranks_ended():
                    self._end_job("every rank ended")

    def _check_job(self) -> bool:
        """Asks job_watch now; ends the target if the job ended. Whether it did."""
        if self._job_watch is None or self._stop.is_set():
            return self._stop.is_set()
        try:
            line = self._job_watch()
        except Exception:  # (squeue that cannot be run at all: the job is not known to end)
            return False
        if line:
            self._end_job(line)
            return True
        return False

    def _all_ranks_ended(self) -> bool:
        """Some rank was seen, every one has ended, and every node answers (or is done): what
        a node that cannot be reached runs is not known."""
        ms = self.members()
        ranks = [m for k, m in ms.items() if not k.endswith(":")
                 and m.state not in (LAUNCHER, HELPER)]
        return bool(ranks) and all(m.state in ENDED for m in ranks) and all(
            r.up or r.done for r in self._runs.values())

    def _note_rank_state(self) -> None:
        with self._lock:
            if self._all_ranks_ended():
                if self._all_ended_at is None:
                    self._all_ended_at = time.monotonic()
            else:
                self._all_ended_at = None

    def _end_job(self, line: str, how: str = "job") -> None:
        """The job ended (or nothing of it can be followed: how "failed"): every member that
        has not ended says so, then the target ends."""
        with self._end_lock:
            if self.ended_how is not None:
                return
            self.ended_how, self.ended_line = how, line
        self._stop.set()
        now = self.clock()
        for key, m in sorted(self.members().items()):
            if m.state in ENDED:
                continue
            host, _, local = key.rpartition(":")
            if not local:  # a node (one that failed for good has said why)
                if how == "job":
                    self.publish({"type": "state", "key": key, "pid": 0, "rank": None,
                                  "host": host, "state": NODE_ENDED, "since": now,
                                  "line": f"host {host}: {line}"})
                continue
            rline = f"pid {m.pid} on {host}: {line}"
            self.publish({"type": "event", "kind": "exit", "key": key, "pid": m.pid,
                          "rank": m.rank, "host": host, "status": None, "signal": None,
                          "how": "job_ended", "line": rline, "t": now})
            self.publish({"type": "state", "key": key, "pid": m.pid, "rank": m.rank,
                          "host": host, "state": EXITED, "line": rline, "since": now,
                          "status": None, "signal": None, "how": "job_ended"})
        for run in self._runs.values():
            self._kill(run)
            self._fail_waiters(run, line)
        self.end()

    def _node_failed_for_good(self, run: _NodeRun, why: str) -> None:
        name = run.node.name
        run.done = True
        self._node_state(run, UNREACHABLE, f"host {name}: {why} (not retried)")
        for key in sorted(run.keys):
            m = self.members().get(key)
            if m is not None and m.state not in ENDED:
                self.publish({"type": "state", "key": key, "pid": m.pid, "rank": m.rank,
                              "host": name, "state": UNREACHABLE, "since": self.clock(),
                              "line": f"pid {m.pid} on {name}: {why} (not retried)"})
        if all(r.done for r in self._runs.values()):
            self._end_job("no node can be followed", how="failed")
        else:
            self._note_rank_state()

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
        failures, why = 0, ""
        while not self._stop.is_set():
            if not why:  # the first try; a retry stays unreachable until the relay answers
                self._node_state(run, CONNECTING, f"host {name}: connecting ({run.node.via})")
            else:
                self._node_state(run, UNREACHABLE, f"host {name}: {why}; reconnecting now")
            why = self._session(run, first)
            was_up, run.up = run.up, False
            self._fail_waiters(run, "connection lost")
            if self._stop.is_set():
                first.set()
                return
            # srun fails as the job ends: squeue says whether it did, before a retry
            if run.node.via == "srun" and self._check_job():
                first.set()
                return
            if is_permanent(why):
                self._node_failed_for_good(run, why)
                first.set()
                return
            failures = 0 if was_up else failures + 1
            delay = min(self.retry_max_s, self.retry_s * (2 ** max(0, failures - 1)))
            line = f"host {name}: {why}; reconnecting in {delay:g} s"
            self._node_state(run, UNREACHABLE, line)
            first.set()
            self._note_rank_state()
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
            self._node_state(run, CONNECTED, f"host {name}: connected ({run.node.via}), "
                             f"{n} process{'es' if n != 1 else ''} with gpumon's agent")
            self._note_rank_state()
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
        if kind == "state":
            self._note_rank_state()

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
