"""The client: everything about what the user pointed at, in one place. Front ends (the TUI,
``attach --json/--once``, ``snapshot``, ``ls``, ``estimate --check``; later the exporter and
the relay) subscribe to a target and only render what it says.

A target and its stream::

    from gpumon import client
    t = client.LocalTarget(pid)       # one pid, a launcher's pid (its ranks), or None: the node
    sub = t.subscribe()               # before start(), so nothing is missed (histories too);
                                      # subscribe(types=("state", "event")): only those
    t.start()                         # one poll now; then a thread follows by itself
    while (item := sub.get()) is not None:   # (receive time, message); None: all has ended
        recv_t, msg = item            # or sub.drain() once per frame, without blocking
    t.request(key, "reset_peaks")     # a command to the agent of one member; AgentError
    t.members()                       # {key: Member(key, pid, state, line, hello, rank, exit)}
    t.wait(lambda ms: ..., timeout)   # until the members satisfy a predicate
    t.close()

Every message carries ``key``, the member (one process) it is about: the pid as text here; a
remote target (a host over ssh or srun) adds the host. Messages:

- ``state``: ``{"type": "state", "key", "pid", "rank", "state", "line", "since"}`` at each
  change; ``state`` is one of ``STATES``: no_process, not_python, no_agent, waiting (the
  agent is loaded, waiting for the program's first CUDA call), serving, unreachable, launcher
  (the pid named launched the processes followed), helper (a worker of one followed: not
  shown), exited (with ``status``, ``signal``, ``how``: "exit" | "exception" | "signal" |
  "unknown" | "job_ended"). A remote target's nodes are members too (key ``host:``):
  connecting, connected, unreachable (the line says why, and whether it is retried), ended.
  ``line`` is one sentence for the user.
- the agent's ``hello``, ``history``, ``sample`` and ``event`` messages (gpumon/protocol.py)
  with ``key`` added. A member with no serving agent gets NVML's view instead: a hello and
  samples with ``"source": "nvml"`` (allocator figures null; ``gpus`` lists the node's GPUs).
  When its agent starts serving, the agent's hello follows, then its history.
- ``{"type": "event", "kind": "exit", "key", "pid", "rank", "status", "signal", "how",
  "line"}`` once per member that ended, made by the client (the agent cannot see a SIGKILL).

To write another kind of target (a remote host), subclass ``Target``: call ``publish(msg)``
with such messages and implement ``start``, ``request`` and ``close``.

Lower level, for one agent: ``discover(pid)``, ``AgentConnection.connect(address)``,
``connect(pid)``. NVML: ``client.nvml`` (``Nvml``, ``FakeNvml``: ``GPUMON_FAKE_NVML=FILE``).
"""
from __future__ import annotations

from gpumon.client.connection import AgentAddress, AgentConnection, AgentError, AttachError
from gpumon.client.discovery import all_agents, discover, scan, socket_dir
from gpumon.client.procs import check_pid, descendants
from gpumon.client.target import (CONNECTED, CONNECTING, EXITED, LAUNCHER, HELPER, NO_AGENT,
                                  NO_CUDA_YET, NO_PROCESS, NODE_ENDED, NOT_PYTHON, SERVING,
                                  STATES, UNREACHABLE, WAITING, LocalTarget, Member,
                                  Subscription, Target)

__all__ = [
    "AgentAddress", "AgentConnection", "AgentError", "AttachError", "LocalTarget", "Member",
    "Subscription", "Target", "STATES", "NO_PROCESS", "NOT_PYTHON", "NO_AGENT", "WAITING",
    "SERVING", "UNREACHABLE", "LAUNCHER", "HELPER", "EXITED", "CONNECTING", "CONNECTED",
    "NODE_ENDED", "NO_CUDA_YET", "all_agents", "check_pid",
    "connect", "descendants", "discover", "scan", "socket_dir",
]


def connect(pid: int, timeout: float = 2.0) -> AgentConnection:
    """Connect to the serving agent of pid (or the first one among its descendants); else
    AttachError with the line that says what pid is now (waiting for CUDA, no agent, ...)."""
    found = discover(pid)
    if found:
        return AgentConnection.connect(found[0], timeout=timeout)
    t = LocalTarget(pid, nvml_s=None, connect_timeout=timeout)
    try:
        ms = list(t.start().members().values())
    finally:
        t.close()
    shown = [m for m in ms if m.state not in (LAUNCHER, HELPER)] or ms
    raise AttachError(shown[0].line if shown else f"no gpumon agent in process {pid}")
