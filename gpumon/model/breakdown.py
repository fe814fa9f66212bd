"""Folds the agent's ``step`` and ``breakdown`` events (gpumon/agent/phases.py documents the
payloads) and samples into what a breakdown view renders. Pure data: no Textual, no torch."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

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


class BreakdownModel:
    def __init__(self, max_steps: int = 200) -> None:
        self.devices: dict[Any, DeviceBreakdown] = {}
        self.steps: collections.deque[StepRow] = collections.deque(maxlen=max_steps)
        self.phase: str | None = None
        self.step: int | None = None
        self.note: str | None = None
        self.optimizers: list[str] = []
        self._proc_used: dict[Any, int] = {}
        self._sample_peaks: dict[tuple, int] = {}  # (step, phase, dev) -> max sampled allocated

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
        return False

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
        if not exact and e.get("peak_device") is not None:
            # refine the lower bounds with what the samples saw during each phase
            for ph in e.get("phases", {}):
                sp = self.sampled_peak(e["step"], ph, e["peak_device"])
                if sp is not None and (peak is None or sp > peak):
                    peak, phase = sp, ph
        self.steps.append(StepRow(e["step"], float(e.get("time_s") or 0.0), peak, phase, exact,
                                  e.get("phases") or {}, e.get("boundaries") or [],
                                  e.get("phases_note")))
        self.note = e.get("phases_note")
        self.optimizers = e.get("optimizers") or self.optimizers

    def _breakdown(self, e: dict) -> None:
        for d in e.get("devices") or ():
            i = d.get("index")
            dev = self.devices.get(i)
            if dev is None:
                dev = self.devices[i] = DeviceBreakdown(i)
            prev_retries = dev.retries
            for k in ("at_peak", "peak", "peak_phase", "peak_step", "peak_exact", "run_peak",
                      "run_peak_phase", "run_peak_step", "allocated", "reserved", "retries"):
                if k in d:
                    setattr(dev, k, d[k])
            dev.now = dict(d.get("now") or {})
            dev.at_peak = dict(dev.at_peak) if dev.at_peak else None
            dev.retries_rising = (prev_retries is not None and dev.retries is not None
                                  and dev.retries > prev_retries)
            # non-PyTorch memory from the samples when the agent had no NVML figure
            pu = self._proc_used.get(i)
            if pu is not None and dev.reserved is not None:
                for roles in (dev.now, dev.at_peak):
                    if roles is not None and roles.get("non_pytorch") is None:
                        roles["non_pytorch"] = max(0, pu - dev.reserved)

    def main_device(self) -> DeviceBreakdown | None:
        if not self.devices:
            return None
        return max(self.devices.values(), key=lambda d: (d.run_peak or 0, d.allocated or 0))
