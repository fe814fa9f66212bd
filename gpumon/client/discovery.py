"""The agents of this user on this node, as their files in the socket directories say: a
``<pid>.sock`` is an agent serving; a ``<pid>.waiting`` marker is an agent loaded and waiting
for the program's first CUDA call (gpumon/agent/core.py writes and removes both). Files of
processes that are gone (or of an older process with the same pid) are skipped; the agents
remove them.

An agent serves in ``$GPUMON_DIR/gpumon-UID`` if its environment sets GPUMON_DIR, else in
``$XDG_RUNTIME_DIR/gpumon-UID`` if it has a runtime dir, else in the temp dir: a Slurm batch
rank (no runtime dir) and the ssh login that looks for it (pam_systemd gives it one) disagree.
So, unless GPUMON_DIR names the one place, every place an agent of this uid may have chosen is
looked in (``socket_dirs``), each checked as the agent checks its own (ours, 0700, no link);
one that fails the check is skipped and named by ``unsafe_dirs`` (with this environment's own
folder when its path is too long for a socket: no agent can serve there), and ``refusal`` is
the line that says so wherever no agent is found. Every client path (ls, attach, the relay,
the exporter) goes through ``scan``.
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
    """The socket directory an agent started from here would use (the agent's own function
    decides, and checks, it)."""
    from gpumon.agent.core import socket_dir as _sd
    return _sd(create=False)


def candidate_dirs() -> list[Path]:
    """Every ``gpumon-UID`` folder an agent of this user may serve in, unchecked, first the
    one an agent started from here would use: with GPUMON_DIR set, that one only (a test, or
    a site that names one place for everything); else this environment's runtime dir, the
    login runtime dir ``/run/user/UID`` (an agent started from a login shell or a systemd user
    unit, seen from a batch step that has none), this environment's temp dir and /tmp (a
    batch rank's, seen from a login that has a runtime dir)."""
    import tempfile
    from gpumon.agent import paths
    name = paths.own_dir_name()
    if os.environ.get("GPUMON_DIR"):
        return [Path(paths.base_dir()) / name]
    bases = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        bases.append(xdg)
    bases += [f"/run/user/{os.getuid()}", tempfile.gettempdir(), "/tmp"]
    out: list[Path] = []
    for b in bases:
        d = Path(os.path.abspath(b)) / name
        if d not in out:
            out.append(d)
    return out


def socket_dirs() -> list[Path]:
    """The folders of ``candidate_dirs`` that exist and pass the agent's own check (yours,
    0700, not a link, in a parent nobody else can swap it in)."""
    return [d for d in candidate_dirs() if _checked(d) is True]


def unsafe_dirs() -> dict[Path, str]:
    """{folder: why it is not looked in} of the candidates that exist but fail the check (an
    agent there is not followed), and of the one an agent started from here would use when
    its path is too long for a socket (no agent of this environment can serve at all)."""
    from gpumon.agent import paths
    own = Path(os.path.abspath(paths.base_dir())) / paths.own_dir_name()
    out = {}
    for d in candidate_dirs():
        why = _checked(d, must_fit=d == own)
        if isinstance(why, str):
            out[d] = why
    return out


def refusal() -> str | None:
    """One line naming every folder of ``unsafe_dirs`` and why, or None: said wherever gpumon
    reports that it found no agent (ls, the target's member lines), since the agent may serve
    in one of them."""
    refused = unsafe_dirs()
    return "; ".join(f"not looked in {d}: {why}" for d, why in refused.items()) or None


def _checked(d: Path, must_fit: bool = False) -> bool | str | None:
    """True: a folder to trust; None: none there; str: why it is refused (or, must_fit, why
    none can be there: too long for a socket path)."""
    from gpumon.agent import paths
    too_long = paths.too_long_for_sockets(str(d))
    if too_long and (must_fit or os.path.lexists(d)):
        return too_long
    if not os.path.lexists(d):
        return None
    try:
        paths.private_dir(str(d), False, paths.SOCKET_HINT)
    except OSError as e:
        return str(e)
    return True


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
    """Every live agent, by pid, in every socket folder of this user (``socket_dirs``), or in
    ``directory`` only; a serving one wins over a marker left beside its socket."""
    if directory is not None:
        return _scan_one(directory)
    out: dict[int, Found] = {}
    for d in socket_dirs():
        for pid, f in _scan_one(d).items():
            if pid not in out or (f.state == "serving" and out[pid].state != "serving"):
                out[pid] = f
    return out


def _scan_one(d: Path) -> dict[int, Found]:
    from gpumon.agent.core import WAITING_SUFFIX
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
    from gpumon.agent.jobenv import ranks_of
    r = ranks_of(procs.environ(pid))[0]
    return r if r is not None else 1 << 30
