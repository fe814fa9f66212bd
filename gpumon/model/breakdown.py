"""Folds the agent's ``step`` and ``breakdown`` events (gpumon/agent/phases.py documents the
payloads) and samples into what a breakdown view renders. Pure data: no Textual, no torch.

    m = BreakdownModel()
    m.feed(msg)                  # any protocol message (hello/history/sample/event); True = changed
    m.set_estimate(d)            # optional: `gpumon estimate --json` output (dict), or None
    d = m.main_device()          # DeviceBreakdown of the device with the highest peak, or None
    d = m.device(0)              # ... of one device (int index or "cpu"), or None
    d.now, d.at_run_peak         # {role: bytes|None} now, and at the run's high-water mark
    m.steps                      # deque of StepRow (step, time_s, peak, peak_phase, exact, ...):
                                 # the latest max_steps steps (every step of the run passes)
    m.worst_steps()              # the run's highest steps, highest first (spike entries)
    m.spikes()                   # the latest steps whose peak stood out, newest last
    m.estimate_comparison()      # gpumon.estimate.compare.Comparison (rows, notes) or None
    m.modules                    # the last per-module measurement (a ``modules`` event), or None

Roles, in display order: ROLES. A step's ``peak_exact`` False means its figure is a lower bound
(the agent could not replay that step: ``exact_note`` says why; see gpumon/agent/phases/): such a
step names no phase. The breakdown's ``peak``/``peak_phase``/``at_peak`` come from exactly
measured steps only, and so does the advice (gpumon/model/advice.py).
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from gpumon.model.spikes import from_wire

TOP_STEPS = 10     # the run's worst steps kept (however long the run)
KEEP_SPIKES = 32

ROLES = ("parameters", "gradients", "optimizer_state", "activations", "allocator_cache",
         "non_pytorch")


@dataclass
class DeviceBreakdown:
    index: Any
    now: dict = field(default_factory=dict)
    at_peak: dict | None = None
    peak: int | None = None
    peak_phase: str | None = None
    peak_step: int | None = None
    peak_exact: bool = False
    run_peak: int | None = None
    run_peak_phase: str | None = None
    run_peak_step: int | None = None
    at_run_peak: dict | None = None
    allocated: int | None = None
    reserved: int | None = None
    retries: int | None = None
    retries_rising: bool = False


@dataclass
class StepRow:
    step: int
    time_s: float
    peak: int | None
    peak_phase: str | None
    peak_exact: bool
    phases: dict
    boundaries: list
    note: str | None
    exact_note: str | None = None  # why peak is only a lower bound
    tags: list = field(default_factory=list)  # the step's phases beyond forward/backward/...
    spike: dict | None = None  # the spike finder's entry when the step stood out


class BreakdownModel:
    def __init__(self, max_steps: int = 200) -> None:
        self.devices: dict[Any, DeviceBreakdown] = {}
        self.steps: collections.deque[StepRow] = collections.deque(maxlen=max_steps)
        self.phase: str | None = None
        self.step: int | None = None
        # (the phase that ended, its step) of the last breakdown: the devices' `now` roles are
        # from then, not from the latest sample
        self.breakdown_at: tuple[str | None, int | None] | None = None
        self.note: str | None = None
        self.measured_every = 1  # the tracker measures one step in this many (its cost budget)
        # agents that report every step (issue 35) say whether each was replayed; then
        # measured_every is only the replay's cadence (the roles at the peak)
        self.every_step = False
        self.optimizers: list[str] = []
        self.optimizer_impl: list = []         # "fused" | "foreach" | "for-loop" | None each
        self.output_bytes: int | None = None   # largest tensor the model's forward returned
        self.autocast: str | bool | None = None  # autocast dtype of the forward, False: off
        self.estimate: dict | None = None
        self.estimate_error: str | None = None
        self.modules = None              # gpumon.model.modules.ModuleReport (the last one)
        self.modules_error: str | None = None
        self.modules_pending = False     # a measurement was asked for and has not ended
        self._proc_used: dict[Any, int] = {}
        self._sample_peaks: dict[tuple, int] = {}  # (step, phase, dev) -> max sampled allocated
        self._worst: dict[int, dict] = {}   # step -> entry: the run's highest (agent's + seen)
        self._spikes: dict[int, dict] = {}  # step -> entry: the latest spikes

    def feed(self, msg: dict) -> bool:
        """Any protocol message; returns True when something visible changed."""
        t = msg.get("type")
        if t == "sample":
            return self._sample(msg)
        if t == "history":
            return any([self._sample(s) for s in msg.get("samples", ())])
        if t == "event" and msg.get("kind") == "step":
            self._step(msg)
            return True
        if t == "event" and msg.get("kind") == "breakdown":
            self._breakdown(msg)
            return True
        if t == "event" and msg.get("kind") == "modules":
            self.set_modules(msg)
            return True
        return False

    def set_modules(self, result: dict) -> None:
        """The agent's per-module measurement (``modules`` event, or the modules_measure
        reply): gpumon.model.modules.ModuleReport, or a one-line error."""
        from gpumon.model.modules import ModuleReport  # pure; loaded when used
        try:
            self.modules, self.modules_error = ModuleReport.from_result(result), None
        except ValueError as e:
            self.modules_error = str(e).splitlines()[0] if str(e) else "measurement failed"
        self.modules_pending = False

    def _sample(self, s: dict) -> bool:
        changed = (s.get("phase"), s.get("step")) != (self.phase, self.step)
        self.phase, self.step = s.get("phase"), s.get("step")
        for d in s.get("devices") or ():
            i = d.get("index")
            if d.get("proc_used") is not None:
                self._proc_used[i] = d["proc_used"]
            a = d.get("allocated")
            if a is not None and self.phase is not None:
                k = (self.step, self.phase, i)
                if a > self._sample_peaks.get(k, -1):
                    self._sample_peaks[k] = a
            if len(self._sample_peaks) > 4096:
                self._sample_peaks.clear()
        return changed

    def sampled_peak(self, step: int, phase: str, dev: Any) -> int | None:
        """The largest allocated seen in samples during (step, phase): a lower bound."""
        return self._sample_peaks.get((step, phase, dev))

    def _step(self, e: dict) -> None:
        peak, phase, exact = e.get("peak"), e.get("peak_phase"), bool(e.get("peak_exact"))
        if not exact:
            phase = None  # a lower bound says nothing of where the true peak was
            if e.get("peak_device") is not None:
                # a better lower bound: the largest figure the samples saw during the step
                for ph in e.get("phases", {}):
                    sp = self.sampled_peak(e["step"], ph, e["peak_device"])
                    if sp is not None and (peak is None or sp > peak):
                        peak = sp
        spike = e.get("spike") if isinstance(e.get("spike"), dict) else None
        tags = e.get("tags") if isinstance(e.get("tags"), list) else []
        self.steps.append(StepRow(e["step"], float(e.get("time_s") or 0.0), peak, phase, exact,
                                  e.get("phases") or {}, e.get("boundaries") or [],
                                  e.get("phases_note"), e.get("exact_note"), tags, spike))
        if isinstance(peak, int):
            self._keep_worst([spike or {"step": e["step"], "peak": peak, "above": None,
                                        "steady": None, "phase": phase, "exact": exact,
                                        "tags": tags, "t": e.get("t")}])
        if spike is not None:
            self._keep_spikes(from_wire([spike]))
        self.note = e.get("phases_note")
        me = e.get("measured_every")
        self.measured_every = me if isinstance(me, int) and me > 0 else 1
        self.every_step = "replayed" in e
        if e.get("optimizers"):
            self.optimizers = list(e["optimizers"])
            impl = e.get("optimizer_impl")
            self.optimizer_impl = list(impl) if isinstance(impl, list) else []
        if e.get("output_bytes") is not None:
            self.output_bytes = e["output_bytes"]
        ac = e.get("autocast")
        if ac is False or isinstance(ac, str):
            self.autocast = ac

    def _keep_worst(self, items: list) -> None:
        for it in items:
            self._worst[it["step"]] = it
        if len(self._worst) > TOP_STEPS:
            keep = sorted(self._worst.values(), key=lambda x: (x["peak"], -x["step"]),
                          reverse=True)[:TOP_STEPS]
            self._worst = {x["step"]: x for x in keep}

    def _keep_spikes(self, items: list) -> None:
        for it in items:
            self._spikes[it["step"]] = it
        while len(self._spikes) > KEEP_SPIKES:
            del self._spikes[min(self._spikes)]

    def worst_steps(self) -> list[dict]:
        """The run's highest steps, highest first: the agent's list (it sees every step, from
        the run's start) merged with the steps this client saw."""
        return sorted(self._worst.values(), key=lambda x: (x["peak"], -x["step"]), reverse=True)

    def spikes(self) -> list[dict]:
        """The latest steps whose peak stood out from the steady state, oldest first."""
        return [self._spikes[k] for k in sorted(self._spikes)]

    def _breakdown(self, e: dict) -> None:
        self.breakdown_at = (e.get("phase"), e.get("step"))
        self._keep_worst(from_wire(e.get("worst_steps")))
        self._keep_spikes(from_wire(e.get("spikes")))
        for d in e.get("devices") or ():
            i = d.get("index")
            dev = self.devices.get(i)
            if dev is None:
                dev = self.devices[i] = DeviceBreakdown(i)
            prev_retries = dev.retries
            for k in ("at_peak", "peak", "peak_phase", "peak_step", "peak_exact", "run_peak",
                      "run_peak_phase", "run_peak_step", "at_run_peak", "allocated", "reserved",
                      "retries"):
                if k in d:
                    setattr(dev, k, d[k])
            dev.now = dict(d.get("now") or {})
            dev.at_peak = dict(dev.at_peak) if dev.at_peak else None
            dev.at_run_peak = dict(dev.at_run_peak) if dev.at_run_peak else None
            dev.retries_rising = (prev_retries is not None and dev.retries is not None
                                  and dev.retries > prev_retries)
            # non-PyTorch memory from the samples when the agent had no NVML figure
            pu = self._proc_used.get(i)
            if pu is not None and dev.reserved is not None:
                for roles in (dev.now, dev.at_peak, dev.at_run_peak):
                    if roles is not None and roles.get("non_pytorch") is None:
                        roles["non_pytorch"] = max(0, pu - dev.reserved)

    def device(self, index: Any) -> DeviceBreakdown | None:
        """The breakdown of one device (an int index, or "cpu"), or None if the agent sent
        none for it."""
        return self.devices.get(index)

    def main_device(self) -> DeviceBreakdown | None:
        if not self.devices:
            return None
        return max(self.devices.values(), key=lambda d: (d.run_peak or 0, d.allocated or 0))

    # ------------------------------------------------------------------ the estimate beside it
    def set_estimate(self, estimate: dict | None) -> None:
        """Show an estimate (``gpumon estimate --json``'s object, or Estimate.to_dict()) beside
        the measured roles; None removes it. One that gpumon.estimate.compare rejects is kept
        out, with a one-line estimate_error."""
        self.estimate, self.estimate_error = None, None
        if estimate is None:
            return
        from gpumon.estimate.compare import Measured, compare_live  # pure; loaded when used
        try:
            compare_live(estimate, Measured())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            self.estimate_error = str(e).splitlines()[0] if str(e) else "not a gpumon estimate"
            return
        self.estimate = estimate

    def estimate_comparison(self, index: Any = None):
        """gpumon.estimate.compare's Comparison of the estimate with the main device's run peak
        (rows: .role .label .estimate .measured .error_pct .estimate_range .note; .notes,
        .peak_error_pct), or None without an estimate. The measured roles are those at the
        run's high-water mark (``at_run_peak``: persistent roles at the end of the phase that
        set it). index: compare that device's breakdown instead of the main device's."""
        if self.estimate is None:
            return None
        from gpumon.estimate.compare import Measured, compare_device, compare_live
        d = self.main_device() if index is None else self.devices.get(index)
        try:
            if d is None:
                return compare_live(self.estimate, Measured())
            ends = {d.run_peak_phase: d.at_run_peak} if d.at_run_peak and d.run_peak_phase \
                else None
            return compare_device(self.estimate, d, phase_ends=ends)
        except (ValueError, KeyError, TypeError) as e:
            self.estimate_error = f"cannot compare with this estimate: {e}"
            return None

    def estimate_rows(self) -> list | None:
        c = self.estimate_comparison()
        return None if c is None else c.rows
