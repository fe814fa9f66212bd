"""The agents of this user on this node, as their files in the socket directory say: a
``<pid>.sock`` is an agent serving; a ``<pid>.waiting`` marker is an agent loaded and waiting
for the program's first CUDA call (gpumon/agent/core.py writes and removes both). Files of
processes that are gone (or of an older process with the same pid) are skipped; the agents
remove them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumon.client import procs
from gpumon.client.connection import AgentAddress


def socket_dir() -> Path:
    """The socket directory: the agent's own function decides (and checks) it."""
    from gpumon.agent.core import socket_dir as _sd
    return _sd(create=False)


@dataclass(frozen=True)
class Found:
    """One agent's files: state "serving" (a socket) or "waiting" (its marker, whose content
    is ``marker``: origin "env" | "inject" | "start", since, source)."""
    pid: int
    state: str
    path: Path
    marker: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def address(self) -> AgentAddress:
        return AgentAddress(self.pid, self.path)


def scan(directory: Path | None = None) -> dict[int, Found]:
    """Every live agent, by pid; a serving one wins over a marker left beside its socket."""
    from gpumon.agent.core import WAITING_SUFFIX
    d = socket_dir() if directory is None else directory
    try:
        names = os.listdir(d)
    except OSError:
        return {}
    out: dict[int, Found] = {}
    for name in names:
        stem, dot, suffix = name.partition(".")
        if not stem.isdigit():
            continue
        pid = int(stem)
        if "." + suffix == ".sock":
            if procs.alive(pid):
                out[pid] = Found(pid, "serving", d / name)
        elif "." + suffix == WAITING_SUFFIX and pid not in out:
            marker = _read_marker(d / name)
            if marker is not None and procs.alive(pid) and _same_process(pid, marker):
                out.setdefault(pid, Found(pid, "waiting", d / name, marker))
    return out


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            m = json.loads(f.read(65536))
        return m if isinstance(m, dict) else None
    except (OSError, ValueError):
        return None


def _same_process(pid: int, marker: dict[str, Any]) -> bool:
    """The marker was written by this process, not by an older one with the same pid."""
    t = marker.get("start_time")
    now = procs.start_time(pid)
    return not isinstance(t, (int, float)) or now is None or abs(now - t) < 2.0


def all_agents() -> list[AgentAddress]:
    """Every serving agent of this user on this node, by pid."""
    return [f.address for pid, f in sorted(scan().items()) if f.state == "serving"]


def discover(pid: int | None = None) -> list[AgentAddress]:
    """Serving agents; with pid: that pid's, or its descendants' (a launcher such as torchrun,
    a shell script or ``gpumon run``), ordered by rank then pid. For what is not serving yet,
    follow a Target instead."""
    agents = all_agents()
    if pid is None:
        return agents
    by_pid = {a.pid: a for a in agents}
    if pid in by_pid:
        return [by_pid[pid]]
    found = [by_pid[p] for p in procs.descendants(pid) if p in by_pid]
    found.sort(key=lambda a: (_rank_of(a.pid), a.pid))
    return found


def _rank_of(pid: int) -> int:
    r = procs.env_int(procs.environ(pid), "RANK")
    return r if r is not None else 1 << 30
