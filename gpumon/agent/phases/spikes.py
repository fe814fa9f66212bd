"""The spike finder: the steps whose peak stands out from the run. The tracker runs it over
every step it reports; the step events carry its verdict (``spike``) and the breakdown events
the run's worst steps and latest spikes (gpumon/model/spikes.py formats them for clients).

The steady state is the median of the last ``window`` step peaks; a step is a spike when its
peak is above it by more than ``max(min_bytes, rel * steady)``. The run's ``top`` highest steps
are kept whatever the window says: a 10,000-step run keeps its worst steps, not all of them.

    f = SpikeFinder()
    spike = f.add(step=4102, peak=..., phase="forward", exact=True, tags=["eval"], t=...)
    # -> {"step": 4102, "peak": ..., "above": bytes over the steady state, "steady": ...,
    #     "phase": "forward" (None unless exact), "exact": True, "tags": ["eval"], "t": ...}
    #    if it stands out, else None
    f.spikes        # the latest spikes (a ring of ``keep``)
    f.worst()       # the run's ``top`` highest steps, highest first ("above" None for steps
                    # before the steady state was known)

Standard library only.
"""
from __future__ import annotations

import bisect
import collections
import heapq

MiB = 1 << 20
WINDOW = 64
MIN_STEPS = 5          # steps needed before anything is called a spike
MIN_BYTES = 64 * MiB   # a spike is at least this far above the steady state ...
REL = 0.05             # ... and this fraction of it
TOP = 10
KEEP = 32


class SpikeFinder:
    def __init__(self, window: int = WINDOW, min_bytes: int = MIN_BYTES, rel: float = REL,
                 top: int = TOP, keep: int = KEEP) -> None:
        self.window, self.min_bytes, self.rel, self.top = window, min_bytes, rel, top
        self._recent: collections.deque = collections.deque()
        self._sorted: list[int] = []
        self._heap: list = []  # (peak, step, entry): the run's highest steps
        self.spikes: collections.deque = collections.deque(maxlen=keep)

    def steady(self) -> int | None:
        s = self._sorted
        if len(s) < MIN_STEPS:
            return None
        return s[len(s) // 2]

    def threshold(self, steady: int) -> int:
        return max(self.min_bytes, int(self.rel * steady))

    def add(self, step: int, peak: int | None, phase: str | None, exact: bool,
            tags: list | None = None, t: float | None = None) -> dict | None:
        """One step (in order). Returns its spike entry if it stands out, else None."""
        if peak is None:
            return None
        steady = self.steady()
        above = None if steady is None else peak - steady
        entry = {"step": step, "peak": peak, "above": above, "steady": steady,
                 "phase": phase if exact else None, "exact": bool(exact),
                 "tags": list(tags or []), "t": t}
        spike = above is not None and above > self.threshold(steady)
        if spike:
            self.spikes.append(entry)
        item = (peak, -step, entry)
        if len(self._heap) < self.top:
            heapq.heappush(self._heap, item)
        elif item > self._heap[0]:
            heapq.heapreplace(self._heap, item)
        self._recent.append(peak)
        bisect.insort(self._sorted, peak)
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        return entry if spike else None

    def worst(self) -> list[dict]:
        return [e for _, _, e in sorted(self._heap, reverse=True)]
