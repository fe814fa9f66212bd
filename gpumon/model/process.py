"""What the live view knows about one attached process: its hello, per-device series and
figures, its state (running / exited / unreachable) and recording state. Pure data, fed with
protocol messages (gpumon/protocol.py); no Textual, no torch, no sockets."""
from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Any, Iterable

from gpumon.model.breakdown import BreakdownModel
from gpumon.model.series import Series

# The chart's series, in drawing order (later ones on top). "nvml" is this process's own use
# of the device as NVML sees it (proc_used): it includes memory PyTorch does not manage.
CHART_METRICS = ("nvml", "reserved", "allocated", "active")
_SAMPLE_KEY = {"nvml": "proc_used", "reserved": "reserved", "allocated": "allocated",
               "active": "active"}


class State(str, enum.Enum):
    CONNECTING = "connecting"
    RUNNING = "running"
    WAITING = "waiting"      # the agent is loaded, waiting for the program's first CUDA call
    NO_AGENT = "no agent"    # NVML's figures only
    EXITED = "exited"
    UNREACHABLE = "unreachable"


# The client's states (gpumon.client.STATES) as this model shows them.
_CLIENT_STATES = {"serving": State.RUNNING, "waiting": State.WAITING,
                  "no_agent": State.NO_AGENT, "not_python": State.NO_AGENT}


@dataclass
class Recording:
    """Allocation-history recording on the agent (the snapshot feature)."""
    active: bool = False
    by: str | None = None        # client id, "pid:<n>"
    who: str | None = None       # a readable name of that client, when the agent gives one
    since: float | None = None   # unix time it started
    # (start, end or None) spans, for markers on the timeline; bounded
    spans: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))
    last_path: str | None = None  # the last snapshot file written
    last_error: str | None = None  # the last failed dump


class DeviceModel:
    def __init__(self, index: int, name: str | None = None, total: int | None = None,
                 **series_kw: Any) -> None:
        self.index = index
        self.name = name or f"cuda:{index}"
        self.total = total
        self.series: dict[str, Series] = {m: Series(**series_kw) for m in CHART_METRICS}
        self.latest: dict[str, Any] = {}
        self.retries_rose_t: float | None = None  # when alloc_retries last went up
        self.ooms_rose_t: float | None = None
        self._peak_alloc_offset = 0.0
        # (t, bytes) where the agent's peak_allocated (torch's max_memory_allocated) last rose:
        # the peak falls between two samples, usually above every sampled point
        self._peak_rose: tuple[float, float] | None = None

    def apply(self, t: float, fig: dict[str, Any]) -> None:
        prev = self.latest
        pk = fig.get("peak_allocated")
        if pk is not None:
            seen = prev.get("peak_allocated") if prev else None
            if self._peak_rose is None or seen is None or pk != seen:  # rose, or was reset
                self._peak_rose = (t, pk)
        for m in CHART_METRICS:
            self.series[m].append(t, fig.get(_SAMPLE_KEY[m]))
        if prev:
            if _gt(fig.get("alloc_retries"), prev.get("alloc_retries")):
                self.retries_rose_t = t
            if _gt(fig.get("ooms"), prev.get("ooms")):
                self.ooms_rose_t = t
        if self.total is None and fig.get("nvml_total"):
            self.total = fig["nvml_total"]
        self.latest = fig

    def get(self, key: str) -> Any:
        return self.latest.get(key)

    @property
    def peak_allocated(self) -> float | None:
        """The agent's peak (torch's own, exact between samples) when it has one."""
        p = self.latest.get("peak_allocated")
        return p if p is not None else self.series["allocated"].peak

    @property
    def peak_reserved(self) -> float | None:
        p = self.latest.get("peak_reserved")
        return p if p is not None else self.series["reserved"].peak

    @property
    def peak_point(self) -> tuple[float, float] | None:
        """Where the allocated peak goes on a chart: (when it was first seen, its bytes). The
        agent's exact peak when it has one, else the highest sample."""
        if self.latest.get("peak_allocated") is not None and self._peak_rose is not None:
            return self._peak_rose
        s = self.series["allocated"]
        return (s.peak_t, s.peak) if s.peak is not None else None

    def gap(self) -> float | None:
        """reserved - allocated: the allocator's cache, including fragmented free blocks."""
        return _sub(self.get("reserved"), self.get("allocated"))

    def non_pytorch(self) -> float | None:
        """NVML process used - reserved: CUDA context, NCCL, cuBLAS workspaces, other libs."""
        return _sub(self.get("proc_used"), self.get("reserved"))

    def free(self) -> float | None:
        """Free on the whole device (all processes), from NVML."""
        total = self.get("nvml_total") or self.total
        return _sub(total, self.get("nvml_used"))

    def reset_peaks(self) -> None:
        for s in self.series.values():
            s.reset_peak()


class ProcessModel:
    """One attached agent (one process, one or more devices)."""

    def __init__(self, key: str, hello: dict[str, Any] | None = None, **series_kw: Any) -> None:
        self.key = key
        self.hello: dict[str, Any] = {}
        self.devices: dict[int, DeviceModel] = {}
        self.state = State.CONNECTING
        self.state_detail = ""
        self.state_since: float | None = None
        self.last_seq: int | None = None
        self.last_t: float | None = None
        self.first_t: float | None = None
        self.last_recv_t: float | None = None
        self.delay_s: float | None = None     # receive time - sample time of the latest sample
        self.cost_us: float | None = None
        self.phase: str | None = None
        self.step: int | None = None
        self.samples = 0
        self.recording = Recording()
        self.events: collections.deque = collections.deque(maxlen=50)
        self.oom_times: collections.deque = collections.deque(maxlen=64)
        self.history_done = False
        # the breakdown by role (phases part's model), fed the same messages
        self.breakdown = BreakdownModel()
        # phase changes (t, phase), for colouring the timeline; bounded
        self.phase_marks: collections.deque = collections.deque(maxlen=4096)
        self._series_kw = series_kw
        if hello:
            self.set_hello(hello)

    # -- identity ------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.hello.get("pid")

    @property
    def rank(self) -> int | None:
        return self.hello.get("rank")

    @property
    def world_size(self) -> int | None:
        return self.hello.get("world_size")

    @property
    def host(self) -> str | None:
        """The node, for a process on another node (attach --hosts/--slurm); else None."""
        return self.hello.get("host")

    @property
    def source(self) -> str:
        return self.hello.get("source") or "?"

    @property
    def commands(self) -> list[str]:
        return list(self.hello.get("commands") or [])

    @property
    def label(self) -> str:
        if self.rank is not None:
            return f"rank {self.rank}"
        return f"pid {self.pid}" if self.pid is not None else self.key

    @property
    def command_line(self) -> str:
        argv = self.hello.get("argv") or []
        return " ".join(str(a) for a in argv) if argv else "?"

    # -- feeding -------------------------------------------------------------------------
    def set_hello(self, hello: dict[str, Any]) -> None:
        if self.hello and hello.get("source") != self.hello.get("source"):
            self._restart()  # the agent's stream replaces NVML's (or the other way round)
        self.hello = dict(hello)
        for d in hello.get("devices") or []:
            idx = d.get("index")
            if idx is None:
                continue
            dev = self.devices.get(idx)
            if dev is None:
                self.devices[idx] = DeviceModel(idx, d.get("name"), d.get("total"),
                                                **self._series_kw)
            else:
                dev.name = d.get("name") or dev.name
                dev.total = d.get("total") or dev.total
        if self.state in (State.CONNECTING, State.UNREACHABLE) and hello.get("source") != "nvml":
            self.state = State.RUNNING
            self.state_detail = ""

    def _restart(self) -> None:
        """A new stream for the same process: its figures start again (history included)."""
        for dev in self.devices.values():
            dev.series = {m: Series(**self._series_kw) for m in CHART_METRICS}
            dev.latest = {}
        self.last_t = self.first_t = self.last_seq = None
        self.samples = 0
        self.history_done = False
        self.phase_marks.clear()

    def apply(self, msg: dict[str, Any], recv_t: float | None = None) -> None:
        kind = msg.get("type")
        if kind in ("sample", "history", "event"):
            try:
                self.breakdown.feed(msg)
            except Exception:  # a malformed phases payload must not stop the live view
                pass
        if kind == "sample":
            self._sample(msg, recv_t)
        elif kind == "history":
            for s in msg.get("samples") or []:
                self._sample(s, None)
            if msg.get("last"):
                self.history_done = True
        elif kind == "event":
            self._event(msg)
        elif kind == "hello":
            self.set_hello(msg)

    def apply_all(self, msgs: Iterable[dict[str, Any]], recv_t: float | None = None) -> None:
        for m in msgs:
            self.apply(m, recv_t)

    def _sample(self, s: dict[str, Any], recv_t: float | None) -> None:
        t = s.get("t")
        if not isinstance(t, (int, float)):
            return
        if self.last_t is not None and t <= self.last_t:
            return  # a re-sent history after a reconnect
        self.last_t = t
        if self.first_t is None:
            self.first_t = t
        self.last_seq = s.get("seq")
        self.cost_us = s.get("cost_us")
        phase = s.get("phase")
        if phase != self.phase or not self.phase_marks:
            self.phase_marks.append((t, phase))
        self.phase = phase
        self.step = s.get("step")
        self.samples += 1
        if recv_t is not None:
            self.last_recv_t = recv_t
            self.delay_s = max(0.0, recv_t - t)
        for fig in s.get("devices") or []:
            idx = fig.get("index")
            if idx is None:
                continue
            dev = self.devices.get(idx)
            if dev is None:
                dev = self.devices[idx] = DeviceModel(idx, **self._series_kw)
            dev.apply(t, fig)

    def _event(self, e: dict[str, Any]) -> None:
        self.events.append(e)
        kind = e.get("kind")
        rec = self.recording
        if kind == "recording":
            state = e.get("state")
            when = e.get("since") or e.get("t") or self.last_t
            if state == "started":
                rec.active, rec.by, rec.who, rec.since = True, e.get("by"), e.get("who"), when
                if not (rec.spans and rec.spans[-1][0] == when):
                    rec.spans.append([when, None])
            elif state == "stopped":
                end = e.get("until") or e.get("t") or self.last_t
                if rec.spans and rec.spans[-1][1] is None:
                    rec.spans[-1][1] = end
                rec.active = False
                if e.get("path"):
                    rec.last_path = e["path"]
        elif kind == "snapshot":
            if e.get("path"):
                rec.last_path = e["path"]
                rec.last_error = None
            elif e.get("ok") is False:
                rec.last_error = e.get("error") or "snapshot failed"
        elif kind == "oom":
            self.oom_times.append(e.get("time") or self.last_t)
        elif kind == "exit":
            self.mark_exited(e.get("status"), e.get("t"), e.get("signal"))

    def set_recording_status(self, st: dict[str, Any]) -> None:
        """From a snapshot_status reply: the recording state when we attached mid-way."""
        rec = self.recording
        if st.get("recording") and not rec.active:
            rec.active, rec.by, rec.who, rec.since = True, st.get("by"), st.get("who"), \
                st.get("since")
            if rec.since is not None:
                rec.spans.append([rec.since, None])
        last = st.get("last") or {}
        if last.get("path") and not rec.last_path:
            rec.last_path = last["path"]

    def reset_peaks(self) -> None:
        for d in self.devices.values():
            d.reset_peaks()

    # -- state ---------------------------------------------------------------------------
    def set_client_state(self, state: str, line: str, when: float | None = None,
                         status: int | None = None, signal: int | None = None,
                         how: str | None = None) -> None:
        """From the client's state message (gpumon.client): serving, waiting for CUDA, NVML
        only, unreachable, exited (with its status or signal when known; how "job_ended":
        its job ended, as Slurm or the end of every rank said)."""
        if state in ("exited", "no_process"):
            self.mark_exited(status, when, signal)
            if how == "job_ended" and status is None and signal is None:
                self.state_detail = "job ended"
        elif state == "unreachable":
            self.mark_unreachable(line, when)
        elif state in _CLIENT_STATES:
            self.state = _CLIENT_STATES[state]
            self.state_detail = {"waiting": "agent waits for the first CUDA call",
                                 "no_agent": "NVML only", "not_python": "not Python"}.get(
                                     state, "")
            self.state_since = when

    def mark_exited(self, status: int | None = None, when: float | None = None,
                    signal: int | None = None) -> None:
        self.state = State.EXITED
        if signal is not None:
            import signal as _signal
            try:
                self.state_detail = f"killed by {_signal.Signals(signal).name}"
            except ValueError:
                self.state_detail = f"killed by signal {signal}"
        else:
            self.state_detail = f"exit status {status}" if status is not None else \
                "exit status unknown"
        self.state_since = when if when is not None else self.last_t
        if self.recording.active:
            self.recording.active = False
            if self.recording.spans and self.recording.spans[-1][1] is None:
                self.recording.spans[-1][1] = self.last_t

    def mark_unreachable(self, reason: str, when: float | None = None) -> None:
        if self.state == State.EXITED:
            return
        self.state = State.UNREACHABLE
        self.state_detail = reason
        self.state_since = when if when is not None else self.last_t

    @property
    def alive(self) -> bool:
        return self.state not in (State.EXITED, State.UNREACHABLE)


@dataclass
class Imbalance:
    metric: str
    high_label: str
    high: float
    low_label: str
    low: float

    @property
    def ratio(self) -> float:
        return self.high / self.low if self.low else float("inf")

    @property
    def spread(self) -> float:
        """(high - low) / low: +0.25 means the heaviest rank uses 25% more."""
        return (self.high - self.low) / self.low if self.low else float("inf")


def imbalance(rows: Iterable[tuple[str, DeviceModel]], metric: str = "peak_allocated"
              ) -> Imbalance | None:
    """The heaviest and lightest of several ranks/devices by a figure (None if < 2 known)."""
    vals = []
    for label, dev in rows:
        v = dev.peak_allocated if metric == "peak_allocated" else dev.get(metric)
        if v is not None:
            vals.append((float(v), label))
    if len(vals) < 2:
        return None
    hi = max(vals)
    lo = min(vals)
    return Imbalance(metric, hi[1], hi[0], lo[1], lo[0])


def _gt(a: Any, b: Any) -> bool:
    return a is not None and b is not None and a > b


def _sub(a: Any, b: Any) -> float | None:
    if a is None or b is None:
        return None
    return a - b
