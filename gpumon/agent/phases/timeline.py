"""The steps and phases of the recent past, for snapshot sidecars: a snapshot taken in the middle
of a run carries no ``Optimizer.step`` annotations from torch, but the tracker knows where every
step and phase began (measured steps or not).

Sidecar format (``"timeline"`` of ``<snapshot>.pickle.json``; times in the clock and unit of the
trace entries' ``time_us``, which is unix time in microseconds on torch 2.x; ``end_us`` null
for what is still running when the snapshot was taken)::

    {"clock": "time_us",
     "steps": [{"step": int, "start_us": int, "end_us": int|null,
                "peak": int|null, "peak_phase": str|null, "peak_exact": bool,
                "phases": [{"phase": str, "start_us": int, "end_us": int|null}]}]}

``peak``: the step's peak allocated (what the step event said: exact, in ``peak_phase``, or a
lower bound with no phase); absent for the step still running.

Bounded: the last MAX_KEPT phase boundaries and MAX_STEPS step ends are kept (a deque
append per boundary); an export holds at most MAX_PHASES phases (the latest steps).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

MAX_KEPT = 16384
MAX_STEPS = 8192
MAX_PHASES = 4000


class Timeline:
    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time) -> None:
        self._clock, self._wall = clock, wall
        self.phases: deque = deque(maxlen=MAX_KEPT)   # (t, phase entered)
        self.ends: deque = deque(maxlen=MAX_STEPS)          # (step, t at its end)
        self.pending: tuple | None = None  # (step, t): ended by its optimizer, not closed yet
        self.peaks: dict = {}   # step -> (peak, phase, exact), the last MAX_STEPS steps

    def phase(self, t: float, label: str) -> None:
        self.phases.append((t, label))

    def step_end(self, step: int, t: float) -> None:
        self.pending = None
        self.ends.append((step, t))

    def step_peak(self, step: int, peak: int | None, phase: str | None, exact: bool) -> None:
        self.peaks[step] = (peak, phase, bool(exact))
        if len(self.peaks) > MAX_STEPS:
            self.peaks.pop(next(iter(self.peaks)))  # the oldest (insertion order)

    def export(self, start_us: int | None = None, end_us: int | None = None,
               max_phases: int = MAX_PHASES) -> dict:
        """The steps that overlap [start_us, end_us] (unix microseconds; None: open)."""
        offset = self._wall() - self._clock()

        def us(t: float) -> int:
            return int(round((t + offset) * 1e6))

        phases = list(self.phases)
        ends = list(self.ends)
        pending = self.pending
        peaks = dict(self.peaks)
        if pending is not None and (not ends or pending[0] > ends[-1][0]):
            ends.append(pending)  # its optimizer step ended: so did the step (unless another
            # optimizer steps before the next forward, which moves the end)
        if not phases:
            return {"clock": "time_us", "steps": []}
        # step k runs from the end of step k-1 (or the first boundary) to its own end
        spans = []
        prev_t = phases[0][0]
        for step, t_end in ends:
            if t_end >= prev_t:
                spans.append((step, prev_t, t_end))
            prev_t = t_end
        nxt = (ends[-1][0] + 1) if ends else 1
        spans.append((nxt, prev_t, None))
        out: list = []
        n = 0
        j = len(phases) - 1
        for step, t0, t1 in reversed(spans):
            if end_us is not None and us(t0) > end_us:
                continue
            if start_us is not None and t1 is not None and us(t1) < start_us:
                break
            # the phases inside (t0, t1), and the one in force at t0
            inside = []
            while j >= 0 and t1 is not None and phases[j][0] >= t1:
                j -= 1
            k = j
            while k >= 0 and phases[k][0] > t0:
                inside.append(phases[k])
                k -= 1
            if k >= 0:
                inside.append((t0, phases[k][1]))
            inside.reverse()
            if n + len(inside) > max_phases:
                break
            n += len(inside)
            ph = []
            for idx, (t, label) in enumerate(inside):
                te = inside[idx + 1][0] if idx + 1 < len(inside) else t1
                ph.append({"phase": label, "start_us": us(t),
                           "end_us": us(te) if te is not None else None})
            entry = {"step": step, "start_us": us(t0),
                     "end_us": us(t1) if t1 is not None else None, "phases": ph}
            pk = peaks.get(step)
            if pk is not None:
                entry["peak"], entry["peak_phase"], entry["peak_exact"] = pk
            out.append(entry)
            j = k
        out.reverse()
        return {"clock": "time_us", "steps": out}
