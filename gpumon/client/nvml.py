"""What NVML alone says about a process that has no serving agent (none at all, or one still
waiting for the program's first CUDA call): the node's GPUs, and this process's memory on each.

One small interface, ``Nvml``, with two implementations: ``RealNvml`` (pynvml, through the
agent's error-swallowing wrapper) and ``FakeNvml`` (a dict, or a JSON file re-read when it
changes: ``GPUMON_FAKE_NVML=FILE``, so the NVML-only path runs in CI without a GPU).
``NvmlView`` turns either into protocol-shaped hello and sample messages for one pid.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from gpumon import protocol
from gpumon.client import procs


class Nvml:
    """The client's NVML: every method answers (None where NVML does not know), never raises."""

    error: str | None = None  # None, or why NVML cannot be used (one line)

    def gpus(self) -> list[dict[str, Any]]:
        """[{"index", "name", "total", "uuid"}] of every GPU of the node."""
        raise NotImplementedError

    def memory(self, index: int) -> tuple[int | None, int | None]:
        """(used, total) bytes of the whole device, every process together."""
        raise NotImplementedError

    def process_memory(self, index: int, pids: set[int]) -> int | None:
        """Bytes that these pids (one process, as seen in each pid namespace) hold on the
        device; None when they hold none there."""
        raise NotImplementedError


class RealNvml(Nvml):
    def __init__(self) -> None:
        from gpumon.agent.sources import Nvml as _Wrapper  # the agent's NVML wrapper (stdlib)
        self._nv = _Wrapper()
        self.error = self._nv.error
        self._handles: list[tuple[int, Any]] = []
        for i in range(self._nv.call("nvmlDeviceGetCount") or 0):
            h = self._nv.call("nvmlDeviceGetHandleByIndex", i)
            if h is not None:
                self._handles.append((i, h))
        self._gpus = [self._info(i, h) for i, h in self._handles]

    def _info(self, i: int, h: Any) -> dict[str, Any]:
        name = self._nv.call("nvmlDeviceGetName", h)
        uuid = self._nv.call("nvmlDeviceGetUUID", h)
        return {"index": i, "name": _text(name), "total": self._nv.memory(h)[1],
                "uuid": _text(uuid)}

    def _handle(self, index: int) -> Any:
        for i, h in self._handles:
            if i == index:
                return h
        return None

    def gpus(self) -> list[dict[str, Any]]:
        return [dict(g) for g in self._gpus]

    def memory(self, index: int) -> tuple[int | None, int | None]:
        return self._nv.memory(self._handle(index))

    def process_memory(self, index: int, pids: set[int]) -> int | None:
        return self._nv.process_used(self._handle(index), pids)


class FakeNvml(Nvml):
    """NVML as a dict says, for tests::

        {"gpus": [{"name": "Fake H200", "total": 150000000000, "used": 1000000000}],
         "processes": {"<pid>": {"<gpu index>": bytes}},
         "error": null}                 # or a string: NVML unavailable, for that reason

    Given a path, the file is re-read whenever it changes, so a test can move the figures."""

    def __init__(self, spec: dict[str, Any] | str | os.PathLike) -> None:
        self._path = None if isinstance(spec, dict) else os.fspath(spec)
        self._spec: dict[str, Any] = spec if isinstance(spec, dict) else {}
        self._mtime: float | None = None
        self._load()

    def _load(self) -> None:
        if self._path is None:
            self.error = self._spec.get("error")
            return
        try:
            m = os.stat(self._path).st_mtime_ns
            if m != self._mtime:
                with open(self._path) as f:
                    self._spec = json.load(f)
                self._mtime = m
        except (OSError, ValueError) as e:
            self._spec = {"error": f"fake NVML file {self._path}: {e}"}
        self.error = self._spec.get("error")

    def gpus(self) -> list[dict[str, Any]]:
        self._load()
        if self.error:
            return []
        return [{"index": i, "name": g.get("name"), "total": g.get("total"),
                 "uuid": g.get("uuid") or f"GPU-fake-{i}"}
                for i, g in enumerate(self._spec.get("gpus") or [])]

    def memory(self, index: int) -> tuple[int | None, int | None]:
        self._load()
        gpus = self._spec.get("gpus") or []
        if self.error or not 0 <= index < len(gpus):
            return None, None
        return gpus[index].get("used"), gpus[index].get("total")

    def process_memory(self, index: int, pids: set[int]) -> int | None:
        self._load()
        if self.error:
            return None
        total = None
        for pid, per_gpu in (self._spec.get("processes") or {}).items():
            if int(pid) in pids and str(index) in per_gpu:
                total = (total or 0) + int(per_gpu[str(index)])
        return total


def open_nvml() -> Nvml:
    """The NVML the client uses: the fake named by ``GPUMON_FAKE_NVML`` (tests), else pynvml."""
    fake = os.environ.get("GPUMON_FAKE_NVML")
    return FakeNvml(fake) if fake else RealNvml()


def _text(v: Any) -> Any:
    return v.decode(errors="replace") if isinstance(v, bytes) else v


class NvmlView:
    """One pid as NVML sees it, in the shapes of the agent's messages (``source: "nvml"``):
    a hello whose devices are the GPUs the process holds memory on (``gpus``: all of the
    node's), and samples with NVML's figures only (the allocator's are null)."""

    def __init__(self, pid: int, nvml: Nvml) -> None:
        self.pid = pid
        self.nvml = nvml
        self._pids = {pid} | procs.nspids(pid)
        self._seq = 0

    def hello(self) -> dict[str, Any]:
        env = procs.environ(self.pid)
        h = {f: None for f in protocol.HELLO_FIELDS}
        gpus = self.nvml.gpus()
        used = {d["index"] for d in self._devices()}
        h.update(v=protocol.VERSION, type="hello", pid=self.pid, ppid=procs.parent_of(self.pid),
                 argv=procs.argv(self.pid), start_time=procs.start_time(self.pid),
                 devices=[g for g in gpus if g["index"] in used], gpus=gpus, source="nvml",
                 commands=[], nvml=self.nvml.error, rank=procs.env_int(env, "RANK"),
                 local_rank=procs.env_int(env, "LOCAL_RANK"),
                 world_size=procs.env_int(env, "WORLD_SIZE"))
        return h

    def _devices(self) -> list[dict[str, Any]]:
        out = []
        for g in self.nvml.gpus():
            i = g["index"]
            proc = self.nvml.process_memory(i, self._pids)
            if proc is None:
                continue
            used, total = self.nvml.memory(i)
            d = {k: None for k in protocol.DEVICE_FIELDS}
            d.update(index=i, nvml_used=used, nvml_total=total, proc_used=proc)
            out.append(d)
        return out

    def sample(self) -> dict[str, Any]:
        """Devices where the process holds memory; ``gpus``: (index, used, total) of every GPU."""
        s = {"type": "sample", "seq": self._seq, "t": time.time(), "cost_us": None,
             "devices": self._devices(), "phase": None, "step": None, "source": "nvml",
             "gpus": [[g["index"], *self.nvml.memory(g["index"])] for g in self.nvml.gpus()]}
        self._seq += 1
        return s
