"""A target: what the user pointed at (one pid, a launcher's pid, every agent of the node) and
the life of each process in it, as one stream of tagged messages that front ends subscribe to.

``Target`` is the interface (subscriptions, members, commands); ``LocalTarget`` follows
processes on this node through the socket directory and /proc. A remote target (ssh, srun) is
another ``Target`` that publishes the same messages.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from gpumon.agent.jobenv import in_jobs, ranks_of
from gpumon.client import discovery, procs
from gpumon.client.connection import AgentConnection, AgentError, AttachError
from gpumon.client.nvml import Nvml, NvmlView, open_nvml

# The states of one process of a target (a member), in the order a typical run passes them.
NO_PROCESS = "no_process"    # the pid does not exist
NOT_PYTHON = "not_python"    # not a Python process, and no agent under it (yet)
NO_AGENT = "no_agent"        # Python, without gpumon's agent: NVML figures only
WAITING = "waiting"          # the agent is loaded, waiting for the program's first CUDA call
SERVING = "serving"          # connected to the agent: its hello, history, samples and events
UNREACHABLE = "unreachable"  # the agent's socket is there but does not answer; retried
LAUNCHER = "launcher"        # the pid named has child processes with agents: they are followed
HELPER = "helper"            # a worker of a followed process (DataLoader, datasets.map): hidden
EXITED = "exited"            # ended: status or signal where it can be known
# The states of a node of a remote target (attach --hosts/--slurm: its member "host:"):
CONNECTING = "connecting"    # its transport (ssh, srun) is starting, the relay has not answered
CONNECTED = "connected"      # the relay answers: the node's processes are members of their own
# (UNREACHABLE: the transport failed or went silent; the line says why and when it is retried,
# or that it is not, for a failure that does not pass by itself: access denied, no such job)
NODE_ENDED = "ended"         # the job ended (Slurm says so, or every rank's exit was seen)
STATES = (NO_PROCESS, NOT_PYTHON, NO_AGENT, WAITING, SERVING, UNREACHABLE, LAUNCHER, HELPER,
          EXITED, CONNECTING, CONNECTED, NODE_ENDED)
ENDED = (NO_PROCESS, EXITED, NODE_ENDED)

# said under WAITING_LINE where a person reads it (the live view, --once)
NO_CUDA_YET = ("this program has not used CUDA yet: gpumon shows it from its first CUDA call. "
               "A program that runs on the CPU never makes one; to see gpumon without a GPU: "
               "`gpumon demo`, or GPUMON_SOURCE=simulated gpumon run -- ...")
NEVER_USED_CUDA = ("; it never used CUDA, so gpumon had no figures of it (gpumon follows a "
                   "program from its first CUDA call; without a GPU try `gpumon demo`)")
WAITING_LINE = "pid {pid}: gpumon's agent is loaded, waiting for the program's first CUDA call"
START_GRACE_S = 10.0  # a process started under gpumon whose agent has not said a word yet
RECONNECT_S = 2.0
MARKER_GONE_S = 3.0  # a waiting agent's marker gone: still "waiting" this long (serving soon, or exiting)
TREE_S = 5.0  # the descendants of the pid named are walked again at least this often
SUBSCRIPTION_LIMIT = 100_000  # messages a subscriber may leave unread; the oldest go first


@dataclass(frozen=True)
class Member:
    """One process of a target, as of now. key: unique within the target (the pid as text
    here; a remote target adds the host). hello: the agent's (or NVML's, source "nvml")."""
    key: str
    pid: int
    state: str
    line: str
    since: float
    hello: dict[str, Any] | None = None
    rank: int | None = None
    exit: procs.Exit | None = None

    @property
    def serving(self) -> bool:
        return self.state == SERVING


class Subscription:
    """The messages of a target, in order, each as (receive time, message). Thread-safe."""

    def __init__(self, clock: Callable[[], float], types: tuple[str, ...] | None = None) -> None:
        self.types = types  # message types kept (None: all)
        self._q: collections.deque = collections.deque(maxlen=SUBSCRIPTION_LIMIT)
        self._cv = threading.Condition()
        self._ended = False
        self._clock = clock

    def _put(self, msg: dict[str, Any]) -> None:
        if self.types is not None and msg["type"] not in self.types:
            return
        with self._cv:
            self._q.append((self._clock(), msg))
            self._cv.notify_all()

    def _end(self) -> None:
        with self._cv:
            self._ended = True
            self._cv.notify_all()

    def get(self, timeout: float | None = None) -> tuple[float, dict[str, Any]] | None:
        """The next message; None once the target has ended and everything was read. Raises
        TimeoutError if timeout passes first."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._q or self._ended, timeout):
                raise TimeoutError(f"no message within {timeout} s")
            return self._q.popleft() if self._q else None

    def drain(self) -> list[tuple[float, dict[str, Any]]]:
        """Everything queued now, without waiting."""
        with self._cv:
            out = list(self._q)
            self._q.clear()
            return out

    @property
    def ended(self) -> bool:
        with self._cv:
            return self._ended and not self._q


class Target:
    """What front ends subscribe to. Producers call ``publish`` with tagged messages:

    - ``{"type": "state", "key", "pid", "state": one of STATES, "line": one sentence, "since",
      "rank"}``; for EXITED also ``"status", "signal", "how"`` (see procs.Exit);
    - the agent's ``hello``/``history``/``sample``/``event`` messages with ``"key"`` added;
      NVML-only members send a hello and samples with ``"source": "nvml"``;
    - ``{"type": "event", "kind": "exit", "key", "pid", "status", "signal", "how", "line"}``
      once per member that ended (made by the client: the agent cannot see its own SIGKILL).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._subs: list[Subscription] = []
        self._members: dict[str, Member] = {}
        self._ended = False

    # -- for front ends -------------------------------------------------------------------
    def subscribe(self, types: tuple[str, ...] | None = None) -> Subscription:
        """A new subscription (of these message types only, e.g. ("state", "event")). It
        starts with each member's last hello and state (history and samples already sent are
        not replayed: subscribe before start() to get them)."""
        sub = Subscription(self.clock, types)
        with self._lock:
            for m in self._members.values():
                if m.hello is not None:
                    sub._put({**m.hello, "key": m.key})
                sub._put(self._state_msg(m))
            if self._ended:
                sub._end()
            self._subs.append(sub)
        return sub

    def members(self) -> dict[str, Member]:
        with self._lock:
            return dict(self._members)

    def wait(self, predicate: Callable[[dict[str, Member]], Any], timeout: float | None
             ) -> Any:
        """Until predicate(members) is true (its value) or timeout (its last, false value)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                v = predicate(dict(self._members))
                if v or self._ended:
                    return v
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return v
                self._changed.wait(left if left is None else min(left, 0.5))

    @property
    def ended(self) -> bool:
        """Nothing more will come: every process followed has ended (or close() was called)."""
        return self._ended

    def start(self) -> "Target":
        return self

    def request(self, key: str, cmd: str, args: dict[str, Any] | None = None,
                timeout: float = 10.0) -> dict[str, Any]:
        """Send a command to the agent of one member; its result, or AgentError (one line)."""
        raise AgentError("this target takes no commands")

    def close(self) -> None:
        self.end()

    # -- for producers --------------------------------------------------------------------
    def publish(self, msg: dict[str, Any]) -> None:
        """Send one tagged message (it has "key") to every subscriber; hello and state
        messages also update members()."""
        with self._lock:
            key = msg["key"]
            m = self._members.get(key)
            if msg["type"] == "state":
                ex = None
                if msg["state"] == EXITED:
                    ex = procs.Exit(msg.get("status"), msg.get("signal"), msg.get("how") or
                                    "unknown", msg.get("line") or "")
                base = m or Member(key, msg["pid"], msg["state"], "", msg.get("since") or 0.0)
                m = replace(base, state=msg["state"], line=msg.get("line") or "",
                            since=msg.get("since") or self.clock(), exit=ex,
                            rank=msg.get("rank", base.rank))
                self._members[key] = m
                self._changed.notify_all()
            elif msg["type"] == "hello":
                base = m or Member(key, msg.get("pid") or 0, SERVING, "", self.clock())
                self._members[key] = replace(base, hello={k: v for k, v in msg.items()
                                                          if k != "key"},
                                             rank=msg.get("rank", base.rank))
            for s in self._subs:
                s._put(msg)

    def end(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
            for s in self._subs:
                s._end()
            self._changed.notify_all()

    @staticmethod
    def _state_msg(m: Member) -> dict[str, Any]:
        msg = {"type": "state", "key": m.key, "pid": m.pid, "state": m.state, "line": m.line,
               "since": m.since, "rank": m.rank}
        if m.exit is not None:
            msg.update(status=m.exit.status, signal=m.exit.signal, how=m.exit.how)
        return msg


class _Proc:
    """LocalTarget's record of one process (touched under the target's lock)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.key = str(pid)
        self.state: str | None = None
        self.line = ""
        self.rank: int | None = None
        self.ppid: int | None = procs.parent_of(pid)
        self.conn: AgentConnection | None = None
        self.token: object | None = None  # the connection attempt whose messages count
        self.live = False                 # hello published: agent messages flow through
        self.pending: list[dict[str, Any]] = []
        self.connecting = False
        self.retry_at = 0.0
        self.served = False               # a connection reached it once
        self.agent_exit: dict[str, Any] | None = None  # the agent's own exit event
        self.nvml: NvmlView | None = None
        self.nvml_at = 0.0
        self.ending = False               # its end is being reported (once)
        self.closing = False              # its connection ended: is the process ending too?
        self.marker_seen = False          # its agent's waiting marker was there
        self.marker_gone_at: float | None = None  # when that marker went (monotonic time)


class LocalTarget(Target):
    """Follows ``pid`` (the process, or the agents among its descendants: a launcher), or with
    ``pid=None`` every agent of this user on this node, through the socket directory and
    /proc, polling every ``poll_s``; what has no serving agent gets NVML samples every
    ``nvml_s`` (None: none). ``child``: a subprocess.Popen of that pid when this
    process started it (its exit status is then exact). ``nvml``: the Nvml to use (default:
    open_nvml(), opened on first need). ``jobs``: follow only the processes of these jobs
    (their SLURM_JOB_ID, an array's ``ID_TASK`` or id, or their pod; see agent/jobenv.py):
    another job of the same user on the node is not this target's."""

    def __init__(self, pid: int | None = None, *, poll_s: float = 0.25, nvml_s: float | None = 1.0,
                 nvml: Nvml | None = None, child: Any = None, connect_timeout: float = 2.0,
                 clock: Callable[[], float] = time.time, jobs: Any = None) -> None:
        super().__init__(clock)
        self.pid = pid
        self.jobs = frozenset(jobs) if jobs else None
        self._job_of: dict[int, bool] = {}  # pid -> in self.jobs (its environment is fixed)
        self.poll_s = poll_s
        self.nvml_s = nvml_s
        self._nvml = nvml
        self._child = child
        self._connect_timeout = connect_timeout
        self._procs: dict[int, _Proc] = {}
        self._tree_cache: set[int] = set()
        self._tree_seen: set[int] = set()
        self._tree_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- life ------------------------------------------------------------------------------
    def start(self) -> "LocalTarget":
        """One poll now (agents already serving are connected before this returns), then a
        thread that keeps following."""
        if self._thread is None:
            self._poll(sync=True)
            self._thread = threading.Thread(target=self._run, name="gpumon-target", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            conns = [p.conn for p in self._procs.values() if p.conn is not None]
            for p in self._procs.values():
                p.token = None
        for c in conns:
            c.close()
        self.end()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s) and not self._ended:
            try:
                self._poll()
            except Exception as e:  # never die silently: say it once, keep following
                self._note_error(e)

    def _note_error(self, e: Exception) -> None:
        from gpumon.agent.log import get_logger
        get_logger().warning("target poll failed: %s", e)

    # -- commands --------------------------------------------------------------------------
    def request(self, key: str, cmd: str, args: dict[str, Any] | None = None,
                timeout: float = 10.0) -> dict[str, Any]:
        with self._lock:
            p = next((p for p in self._procs.values() if p.key == key), None)
            conn = p.conn if p is not None and p.live else None
            why = p.line if p is not None else f"{key}: not part of this target"
        if conn is None:
            raise AgentError(why or f"pid {key}: not connected")
        return conn.request(cmd, args, timeout=timeout)

    # -- the poll ---------------------------------------------------------------------------
    def _poll(self, sync: bool = False) -> None:
        found = discovery.scan()
        if self.jobs is not None:
            for gone in set(self._job_of) - set(found):  # (a pid reused is asked again)
                del self._job_of[gone]
            found = {pid: f for pid, f in found.items() if self._in_jobs(pid)}
        root_alive = self.pid is not None and procs.alive(self.pid)
        if self.pid is None:
            cands = set(found)
        else:
            cands = {p for p in self._tree(found) if p in found} if root_alive else set()
            with self._lock:  # a rank whose launcher died is still followed
                cands |= {p.pid for p in self._procs.values()
                          if p.pid in found and p.state not in (LAUNCHER, HELPER) + ENDED}
        visible = _visible(cands, found)
        root = self._procs.get(self.pid) if self.pid is not None else None
        if self.pid is not None and not visible and not (root and root.state == LAUNCHER):
            visible = {self.pid}  # (a launcher stays one between its ranks' restarts)
        for pid in sorted(visible):
            self._update(pid, found.get(pid), sync)
        if self.pid is not None and root_alive and self.pid not in visible:
            self._record(self.pid)  # said once: the pid named is their launcher
        with self._lock:
            others = [p for p in self._procs.values() if p.pid not in visible]
        for p in others:
            if p.state in ENDED or p.ending:
                continue
            if not procs.alive(p.pid):
                self._ended_proc(p)
            elif p.pid == self.pid or (p.pid in found and _is_launcher(p.pid, visible)):
                self._set(p, LAUNCHER, f"pid {p.pid} ({procs.name_of(p.pid)}) launched the "
                          "processes shown: their agents are followed")
            elif p.pid in found:
                self._set(p, HELPER, f"pid {p.pid}: a helper process of one that is followed")
            else:  # followed before, its agent gone (stopped, detached): what is it now
                self._update(p.pid, None, False)
        self._tick_nvml()
        with self._lock:
            done = self.pid is not None and not root_alive and all(
                p.state in ENDED or p.state == HELPER for p in self._procs.values())
        if done:
            self.end()

    def _in_jobs(self, pid: int) -> bool:
        v = self._job_of.get(pid)
        if v is None:
            v = self._job_of[pid] = in_jobs(procs.environ(pid), self.jobs or frozenset())
        return v

    def _tree(self, found: dict[int, discovery.Found]) -> set[int]:
        """The pid named and its descendants. Walking every process's parent is the poll's
        costly part (~2 ms with 100 processes): done again only when an agent file of a new
        pid appears (a new rank's agent always makes one), or every TREE_S."""
        now = time.monotonic()
        new = set(found) - self._tree_seen
        if new or now >= self._tree_at:
            self._tree_cache = {self.pid, *procs.descendants(self.pid)}
            self._tree_seen = set(found)
            self._tree_at = now + TREE_S
        return self._tree_cache

    def _record(self, pid: int) -> _Proc:
        with self._lock:
            p = self._procs.get(pid)
            if p is None:
                p = self._procs[pid] = _Proc(pid)
                p.rank = ranks_of(procs.environ(pid))[0]
            return p

    def _update(self, pid: int, found: discovery.Found | None, sync: bool) -> None:
        p = self._record(pid)
        if p.ending:
            return
        if found is not None and found.state == "serving":
            with self._lock:
                go = (p.conn is None and not p.connecting and not p.closing
                      and time.monotonic() >= p.retry_at)
                if go:
                    p.connecting = True
                    p.token = token = object()
            if go:
                if sync:
                    self._connect(p, found, token)
                else:
                    threading.Thread(target=self._connect, args=(p, found, token),
                                     name=f"gpumon-connect-{pid}", daemon=True).start()
            return
        with self._lock:
            connected = p.conn is not None or p.connecting or p.closing
        if connected:
            return  # the connection's end decides
        if found is not None and found.state == "waiting":
            p.marker_seen, p.marker_gone_at = True, None
            self._set(p, WAITING, WAITING_LINE.format(pid=pid), origin=found.marker.get("origin"))
            return
        if p.state == WAITING and p.marker_seen and found is None and procs.alive(pid):
            # the marker went: the agent serves in a moment, or the program is ending (its
            # agent removes the marker at exit, a moment before the process is gone)
            now = time.monotonic()
            if p.marker_gone_at is None:
                p.marker_gone_at = now
            if now - p.marker_gone_at < MARKER_GONE_S:
                return
        if not procs.alive(pid):
            if p.state is None and not self._exists(pid):
                self._set(p, NO_PROCESS, f"no process with pid {pid}")
            else:
                self._ended_proc(p)
            return
        state, line = classify(pid)
        self._set(p, state, line)

    @staticmethod
    def _exists(pid: int) -> bool:
        return procs.stat_fields(pid) is not None

    # -- connections -------------------------------------------------------------------------
    def _connect(self, p: _Proc, found: discovery.Found, token: object) -> None:
        def on_message(msg: dict[str, Any] | None) -> None:
            self._agent_message(p, token, msg)
        try:
            conn = AgentConnection.connect(found.address, timeout=self._connect_timeout,
                                           on_message=on_message)
        except AttachError as e:
            with self._lock:
                p.connecting = False
                p.token = None if p.token is token else p.token
                p.retry_at = time.monotonic() + RECONNECT_S
            if procs.alive(p.pid):
                self._set(p, UNREACHABLE, f"pid {p.pid}: its agent does not answer ({e}); "
                          "retrying")
            else:
                self._ended_proc(p)
            return
        with self._lock:
            p.connecting = False
            if p.token is not token:  # closed meanwhile
                conn.close()
                return
            p.conn, p.live, p.served, p.nvml = conn, True, True, None
            hello = dict(conn.hello)
            if hello.get("rank") is not None:
                p.rank = hello["rank"]
            self._set(p, SERVING, f"pid {p.pid}: connected to gpumon's agent")
            self.publish({**hello, "key": p.key})
            pending, p.pending = p.pending, []
            eof = None in pending
            for m in pending[:pending.index(None)] if eof else pending:
                self._forward(p, m)
            if eof:  # EOF came with the first lines
                p.conn, p.token, p.live, p.closing = None, None, False, True
        if eof:
            conn.close()
            self._connection_ended(p)

    def _agent_message(self, p: _Proc, token: object, msg: dict[str, Any] | None) -> None:
        """On the connection's reader thread: every message, None at EOF."""
        with self._lock:
            if p.token is not token:
                return  # an older connection's
            if not p.live:
                p.pending.append(msg)  # _connect publishes the hello first, then these
                return
            if msg is not None:
                self._forward(p, msg)
                return
            p.conn, p.token, p.live, p.closing = None, None, False, True
        self._connection_ended(p)

    def _forward(self, p: _Proc, msg: dict[str, Any]) -> None:
        if msg.get("type") == "event" and msg.get("kind") == "exit":
            p.agent_exit = msg  # the client makes the exit event, with what it knows more
            return
        self.publish({**msg, "key": p.key})

    def _connection_ended(self, p: _Proc) -> None:
        """The agent's connection ended: the process ended (then say how), or only the agent
        stopped (gpumon.stop(), detach): the next polls say what the process is now."""
        wait = 3.0 if p.agent_exit is not None else 1.0
        end = time.monotonic() + wait  # the socket closes a moment before the process ends
        try:
            while procs.alive(p.pid) and time.monotonic() < end:
                if self._stop.wait(0.02):
                    return
            if not procs.alive(p.pid):
                self._ended_proc(p)
                return
            with self._lock:
                p.retry_at = time.monotonic() + 0.5
            self._set(p, UNREACHABLE, f"pid {p.pid}: its agent closed the connection; the "
                      "process still runs")
        finally:
            p.closing = False

    # -- ends --------------------------------------------------------------------------------
    def _ended_proc(self, p: _Proc) -> None:
        with self._lock:
            if p.ending or p.state in ENDED:
                return
            p.ending = True  # one exit per process, whichever thread sees it first
        ex = self._exit_of(p)
        if p.marker_seen and not p.served:  # its agent waited for CUDA the whole run
            ex = replace(ex, line=ex.line + NEVER_USED_CUDA)
        self.publish({"type": "event", "kind": "exit", "key": p.key, "pid": p.pid,
                      "status": ex.status, "signal": ex.signal, "how": ex.how, "line": ex.line,
                      "t": self.clock(), "rank": p.rank})
        self._set(p, EXITED, ex.line, status=ex.status, signal=ex.signal, how=ex.how)

    def _exit_of(self, p: _Proc) -> procs.Exit:
        status = sig = None
        child = self._child
        if child is not None and getattr(child, "pid", None) == p.pid:
            try:
                rc = child.wait(timeout=1.0)
                status, sig = (None, -rc) if rc < 0 else (rc, None)
            except Exception:
                pass
        else:
            z = procs.zombie_exit(p.pid)
            if z is not None:
                status, sig = z
        return describe_exit(p.pid, status, sig, p.agent_exit, p.served, p.ppid)

    # -- NVML, for what has no serving agent ---------------------------------------------------
    def _tick_nvml(self) -> None:
        if self.nvml_s is None:
            return
        now = time.monotonic()
        with self._lock:
            due = [p for p in self._procs.values()
                   if p.state in (WAITING, NO_AGENT, UNREACHABLE) and not p.live
                   and now >= p.nvml_at]
        if not due:
            return
        if self._nvml is None:
            self._nvml = open_nvml()
        for p in due:
            with self._lock:
                p.nvml_at = now + self.nvml_s
                view, new = p.nvml, p.nvml is None
                if new:
                    view = p.nvml = NvmlView(p.pid, self._nvml)
            if new:
                self._publish_if_unchanged(p, view, view.hello)
            if not self._nvml.error:
                self._publish_if_unchanged(p, view, view.sample)

    def _publish_if_unchanged(self, p: _Proc, view: NvmlView, make: Callable[[], dict]) -> None:
        msg = make()  # outside the lock: NVML's process list takes ~0.4 ms per device
        with self._lock:
            if p.nvml is view and not p.live:
                self.publish({**msg, "key": p.key})

    # -- state -------------------------------------------------------------------------------
    def _set(self, p: _Proc, state: str, line: str, **extra: Any) -> None:
        with self._lock:
            if p.state == state and p.line == line:
                return
            p.state, p.line = state, line
            if state in (NOT_PYTHON, LAUNCHER, HELPER) + ENDED:
                p.nvml = None
            msg = {"type": "state", "key": p.key, "pid": p.pid, "state": state, "line": line,
                   "since": self.clock(), "rank": p.rank, **extra}
            self.publish(msg)


def _visible(cands: set[int], found: dict[int, discovery.Found]) -> set[int]:
    """The agents worth following. A serving one always. A waiting one unless it is the
    ancestor or descendant of a serving one, or
    - a launcher: an ancestor of another agent that has a rank (RANK/LOCAL_RANK) it has not
      (torchrun, accelerate under gpumon run: their agents never see CUDA), or
    - a helper: a descendant of another agent that is no rank of its own (a spawned
      DataLoader, datasets.map or compile worker: it inherits its parent's environment)."""
    waiting = {p for p in cands if found[p].state != "serving"}
    if not waiting or len(cands) < 2:
        return set(cands)
    chains = {p: _ancestors(p) for p in cands}
    ranked = {p: _has_rank(p) for p in cands}
    hidden = set()
    for w in waiting:
        for other in cands - {w}:
            related = w in chains[other] or other in chains[w]
            if related and found[other].state == "serving":
                hidden.add(w)  # the launcher or a helper of an agent that serves
            elif w in chains[other] and ranked[other] and not ranked[w]:
                hidden.add(w)  # a launcher of `other`
            elif other in chains[w] and not (ranked[w] and not ranked[other]):
                hidden.add(w)  # a helper of `other`
    return cands - hidden


def _is_launcher(pid: int, visible: set[int]) -> bool:
    return any(pid in _ancestors(v) for v in visible)


def _has_rank(pid: int) -> bool:
    env = procs.environ(pid)
    return "RANK" in env or "LOCAL_RANK" in env


def _ancestors(pid: int, limit: int = 64) -> set[int]:
    out = set()
    p = procs.parent_of(pid)
    while p and p > 1 and p not in out and len(out) < limit:
        out.add(p)
        p = procs.parent_of(p)
    return out


def classify(pid: int) -> tuple[str, str]:
    """(state, line) of a live process that has no agent file: no agent, an agent starting
    (it runs under gpumon and is young), or not Python. Where a socket folder of this user
    was refused (not yours, open to others, a link, too long), the line names it: the agent
    may serve, or have failed to, there."""
    env = procs.environ(pid)
    under_gpumon = env.get("GPUMON", "") not in ("", "0")
    refused = discovery.refusal()
    if _is_gpumon_run(procs.argv(pid)):  # `gpumon run ... &` then at once `attach $!`
        return WAITING, f"pid {pid} is gpumon run, starting its command"
    if not procs.is_python(pid):
        name = procs.name_of(pid)
        if refused:
            return NOT_PYTHON, (f"pid {pid} ({name}) is not a Python process, and no agent "
                                f"under it was found; {refused}")
        return NOT_PYTHON, (f"pid {pid} ({name}) is not a Python process, and no process "
                            "under it runs gpumon's agent (yet)")
    if under_gpumon:
        started = procs.start_time(pid)
        if started is None or time.time() - started < START_GRACE_S:
            return WAITING, (f"pid {pid} runs under gpumon (GPUMON=1): its agent is starting"
                             + (f"; {refused}" if refused else ""))
        if not refused:
            return NO_AGENT, (f"pid {pid} runs under gpumon (GPUMON=1) but its agent did not "
                              f"start: see agent.log in {discovery.socket_dir()}")
    if refused:
        return NO_AGENT, f"pid {pid}: no gpumon agent found for it; {refused}"
    return NO_AGENT, (f"pid {pid}: no gpumon agent in this Python process (NVML figures "
                      f"only); for the full view start it with gpumon run -- CMD, GPUMON=1, "
                      f"or gpumon attach {pid} --inject")


def no_figures_line(pid: int, nvml_error: str) -> str:
    """The one line for a process with no agent whose figures NVML cannot give either
    (attach --once/--json say it and fail), naming any socket folder refused."""
    refused = discovery.refusal()
    return f"no gpumon agent in process {pid}, and {nvml_error}" + (
        f"; {refused}" if refused else "")


def _is_gpumon_run(argv: list[str]) -> bool:
    """`gpumon run` itself, before it execs the command (the pid stays the command's)."""
    for i, a in enumerate(argv[:4]):
        name = a.rsplit("/", 1)[-1]
        if (name == "gpumon" or (a == "gpumon" and argv[i - 1:i] == ["-m"])) and \
                argv[i + 1:i + 2] == ["run"]:
            return True
    return False


def describe_exit(pid: int, status: int | None, sig: int | None,
                  agent_exit: dict[str, Any] | None, served: bool,
                  ppid: int | None) -> procs.Exit:
    """How pid ended, from what is known: its status or signal (a child of ours, or read while
    it was a zombie), and the agent's exit event (sent from Python's shutdown, so it never
    comes after SIGKILL or a default SIGTERM). Says what is not known."""
    who = f"pid {pid}"
    ae = agent_exit or {}
    exc = ae.get("exception")
    parent = f"its parent (pid {ppid})" if ppid else "its parent"
    if sig is not None:
        return procs.Exit(None, sig, "signal", f"{who} was killed by {procs.signal_name(sig)}")
    if status is not None:
        if ae.get("how") == "exception" and exc:
            return procs.Exit(status, None, "exception",
                              f"{who} exited with status {status} after an uncaught {exc}")
        return procs.Exit(status, None, "exit", f"{who} exited with status {status}")
    if ae.get("how") == "exception":
        return procs.Exit(1, None, "exception",
                          f"{who} ended with an uncaught {exc} (Python exits with status 1)")
    if ae.get("how") == "signal" and ae.get("signal"):
        s = int(ae["signal"])
        return procs.Exit(None, s, "signal", f"{who} was interrupted ({exc}): Python ended it "
                          f"with {procs.signal_name(s)}")
    if ae.get("how") == "shutdown":
        return procs.Exit(None, None, "exit", f"{who} ended through Python's normal shutdown; "
                          f"its exit status went to {parent}, gpumon could not read it")
    if served:
        return procs.Exit(None, None, "unknown",
                          f"{who} ended without Python's shutdown (killed by a signal such as "
                          f"SIGKILL, or SIGTERM without a handler, or os._exit); its exit "
                          f"status went to {parent}, gpumon could not read it")
    return procs.Exit(None, None, "unknown", f"{who} ended; its exit status went to {parent}, "
                      "gpumon could not read it")
