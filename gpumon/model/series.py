"""A time series that keeps a whole run's history in bounded memory.

Two tiers:
- a raw tail: the most recent samples exactly as they came (bounded, trimmed in chunks);
- a coarse history: fixed-width time buckets holding min / max / last, from the first sample on.
  When the bucket count reaches its cap, neighbouring buckets merge pairwise and the width
  doubles, so a ten-hour run costs the same memory as a ten-minute one, and no spike is lost:
  min/max decimation keeps every extreme, only its exact time is blurred to a bucket.

`columns()` hands a chart what it draws: one (min, max, last) per pixel column, from whichever
tier is fine enough for the requested window. Pure Python, no Textual, no torch.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from typing import NamedTuple

NAN = float("nan")


class Column(NamedTuple):
    lo: float
    hi: float
    last: float


class Series:
    """Samples (t, value) with t non-decreasing; later-or-equal times only."""

    __slots__ = ("_rt", "_rv", "_raw_cap", "_trimmed", "_t0", "_width", "_cap",
                 "_cmin", "_cmax", "_clast", "peak", "peak_t", "last", "last_t", "count")

    def __init__(self, raw_capacity: int = 6000, buckets: int = 1024,
                 bucket_width: float = 0.1) -> None:
        if raw_capacity < 2 or buckets < 4 or bucket_width <= 0:
            raise ValueError("raw_capacity >= 2, buckets >= 4, bucket_width > 0")
        self._rt: list[float] = []
        self._rv: list[float] = []
        self._raw_cap = raw_capacity
        self._trimmed = False  # True once the raw tail no longer starts at the first sample
        self._t0: float | None = None
        self._width = bucket_width
        self._cap = buckets
        self._cmin: list[float] = []
        self._cmax: list[float] = []
        self._clast: list[float] = []
        self.peak: float | None = None
        self.peak_t: float | None = None
        self.last: float | None = None
        self.last_t: float | None = None
        self.count = 0

    # -- writing -------------------------------------------------------------------------
    def append(self, t: float, v: float | None) -> None:
        """Add one sample. None (figure unavailable) is skipped; out-of-order times are dropped."""
        if v is None:
            return
        if self.last_t is not None and t < self.last_t:
            return
        v = float(v)
        if math.isnan(v):
            return
        self.count += 1
        self.last, self.last_t = v, t
        if self.peak is None or v > self.peak:
            self.peak, self.peak_t = v, t
        # raw tail
        self._rt.append(t)
        self._rv.append(v)
        if len(self._rt) > self._raw_cap + self._raw_cap // 4:
            cut = len(self._rt) - self._raw_cap
            del self._rt[:cut]
            del self._rv[:cut]
            self._trimmed = True
        # coarse buckets
        if self._t0 is None:
            self._t0 = t
        i = int((t - self._t0) / self._width)
        while i >= self._cap:
            self._merge()
            i = int((t - self._t0) / self._width)
        n = len(self._cmin)
        if i >= n:
            pad = i - n + 1
            self._cmin.extend([NAN] * pad)
            self._cmax.extend([NAN] * pad)
            self._clast.extend([NAN] * pad)
        lo = self._cmin[i]
        if lo != lo or v < lo:  # NaN check without a call
            self._cmin[i] = v
        hi = self._cmax[i]
        if hi != hi or v > hi:
            self._cmax[i] = v
        self._clast[i] = v

    def _merge(self) -> None:
        """Halve the resolution of the coarse tier: bucket pairs become one bucket."""
        cmin, cmax, clast = self._cmin, self._cmax, self._clast
        nmin, nmax, nlast = [], [], []
        for j in range(0, len(cmin), 2):
            a_lo, a_hi, a_last = cmin[j], cmax[j], clast[j]
            if j + 1 < len(cmin):
                b_lo, b_hi, b_last = cmin[j + 1], cmax[j + 1], clast[j + 1]
            else:
                b_lo = b_hi = b_last = NAN
            nmin.append(_nanmin(a_lo, b_lo))
            nmax.append(_nanmax(a_hi, b_hi))
            nlast.append(b_last if b_last == b_last else a_last)
        self._cmin, self._cmax, self._clast = nmin, nmax, nlast
        self._width *= 2

    def reset_peak(self) -> None:
        """Peak restarts from the current value (as torch's reset_peak_memory_stats does)."""
        self.peak, self.peak_t = self.last, self.last_t

    # -- reading -------------------------------------------------------------------------
    @property
    def first_t(self) -> float | None:
        return self._t0

    @property
    def bucket_width(self) -> float:
        return self._width

    def stored_values(self) -> int:
        """How many floats this series holds: bounded whatever the run's length."""
        return 2 * len(self._rt) + 3 * len(self._cmin)

    def columns(self, t_start: float, t_end: float, n: int) -> list[Column | None]:
        """Per column i (covering [t_start + i*dt, t_start + (i+1)*dt)), the min, max and last
        value seen there, or None where there is no sample."""
        out: list[Column | None] = [None] * max(n, 0)
        if n <= 0 or t_end <= t_start or self._t0 is None:
            return out
        dt = (t_end - t_start) / n
        raw_covers = bool(self._rt) and (not self._trimmed or self._rt[0] <= t_start)
        if raw_covers and (dt < self._width or not self._cmin):
            self._columns_raw(t_start, t_end, n, dt, out)
        else:
            self._columns_coarse(t_start, t_end, n, dt, out)
        return out

    def _columns_raw(self, t_start, t_end, n, dt, out) -> None:
        rt, rv = self._rt, self._rv
        a = bisect_left(rt, t_start)
        b = bisect_right(rt, t_end)
        inv = 1.0 / dt
        cur = -1
        lo = hi = last = 0.0
        for k in range(a, b):
            c = int((rt[k] - t_start) * inv)
            if c >= n:
                c = n - 1
            v = rv[k]
            if c != cur:
                if cur >= 0:
                    out[cur] = Column(lo, hi, last)
                cur, lo, hi = c, v, v
            elif v < lo:
                lo = v
            elif v > hi:
                hi = v
            last = v
        if cur >= 0:
            out[cur] = Column(lo, hi, last)

    def _columns_coarse(self, t_start, t_end, n, dt, out) -> None:
        t0, w = self._t0, self._width
        cmin, cmax, clast = self._cmin, self._cmax, self._clast
        nb = len(cmin)
        for c in range(n):
            ct0 = t_start + c * dt
            i0 = int((ct0 - t0) // w)
            i1 = int((ct0 + dt - t0) // w)
            if i1 > i0 and (ct0 + dt - t0) % w == 0:
                i1 -= 1  # the column's end is exclusive
            if i1 < 0 or i0 >= nb:
                continue
            i0 = max(i0, 0)
            i1 = min(i1, nb - 1)
            lo = hi = last = NAN
            for i in range(i0, i1 + 1):
                x = cmin[i]
                if x == x:
                    lo = x if lo != lo or x < lo else lo
                    y = cmax[i]
                    hi = y if hi != hi or y > hi else hi
                    last = clast[i]
            if lo == lo:
                out[c] = Column(lo, hi, last)


def _nanmin(a: float, b: float) -> float:
    if a != a:
        return b
    if b != b:
        return a
    return a if a < b else b


def _nanmax(a: float, b: float) -> float:
    if a != a:
        return b
    if b != b:
        return a
    return a if a > b else b
