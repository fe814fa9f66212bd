"""--fit: the largest batch (or sequence length) whose needed memory fits a GPU.

What is *needed*: the requested peak with the allocator's block rounding (upper end) and the CUDA
context (upper end), plus `slack` x the peak when the user asks for a margin (--slack). What is
apart: the allocator's cache that *may form* (reserved but unallocated blocks, 2-32% of the peak
measured): the allocator frees it and retries before it reports out of memory, so it is shown
beside the verdict, not counted as needed (issue 34: --fit said "even batch 1 does not fit" for a
62.8 GiB peak on an 80 GB card because 35% of cache was counted as needed). The peak is monotone
in batch and sequence length, so a doubling search followed by a bisection finds the largest
value in O(log n) estimates.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .core import ALLOCATOR_ROUNDING, CUDA_CONTEXT_BYTES, Estimate, Setup, allocator_cache_fraction, estimate


@dataclass
class FitResult:
    what: str              # "batch" | "seq"
    value: int             # 0 when not even 1 fits
    estimate: Estimate | None
    capacity: int
    budget: int            # the allocated peak at `value` (at 1 when nothing fits)
    margin: int            # capacity - peak at `value`
    context_bytes: int
    slack: float           # a margin counted as needed, as a fraction of the peak (--slack; default 0)
    limit: int
    cache_fraction: float = 0.0   # the upper end of the allocator cache that may form, fraction of the peak

    @property
    def needed(self) -> int:
        """What the device must hold at `value`: peak x (1 + slack) + context."""
        return needed(self.estimate.peak_bytes, self.context_bytes, self.slack) if self.estimate else 0

    @property
    def cache_may_form(self) -> int:
        """The allocator cache that may form on top at `value` (upper end): not needed, but it shows in nvidia-smi."""
        return cache_may_form(self.estimate.peak_bytes, self.cache_fraction) if self.estimate else 0

    def to_dict(self) -> dict:
        return {"fit": self.what, "value": self.value, "capacity_bytes": self.capacity,
                "budget_bytes": self.budget, "margin_bytes": self.margin, "context_bytes": self.context_bytes,
                "slack": self.slack, "peak_bytes": self.estimate.peak_bytes if self.estimate else None,
                "needed_bytes": self.needed, "cache_may_form_bytes": self.cache_may_form,
                "searched_up_to": self.limit}


def needed(peak: int, context: int, slack: float = 0.0) -> int:
    # the allocator's block rounding (upper end) on the requested peak, a margin if asked, the context
    return int(peak * (1 + ALLOCATOR_ROUNDING[1]) * (1 + slack) + context)


def cache_may_form(peak: int, fraction: float) -> int:
    """The allocator's reserved-but-unallocated bytes that may sit beside the peak (upper end)."""
    return int(peak * (1 + ALLOCATOR_ROUNDING[1]) * fraction)


def fits(peak: int, capacity: int, context: int, slack: float) -> bool:
    return needed(peak, context, slack) <= capacity


def fit(setup: Setup, capacity: int, what: str = "batch", slack: float | None = None,
        context: int = CUDA_CONTEXT_BYTES[1], limit: int = 1 << 24,
        estimator: Callable[[Setup], Estimate] = estimate) -> FitResult:
    """slack None: no margin beyond the rounding and the context (the cache that may form is
    reported apart: FitResult.cache_may_form)."""
    if what not in ("batch", "seq"):
        raise ValueError("fit what: batch or seq")
    cache = allocator_cache_fraction(setup.checkpointing)[1]
    if slack is None:
        slack = 0.0
    if what == "seq" and setup.arch is not None:
        limit = min(limit, setup.arch.max_positions)

    def est(v: int) -> Estimate:
        return estimator(replace(setup, **{what: v}))

    def ok(e: Estimate) -> bool:
        return fits(e.peak_bytes, capacity, context, slack)

    e1 = est(1)
    if not ok(e1):
        return FitResult(what, 0, e1, capacity, e1.peak_bytes, capacity - e1.peak_bytes, context, slack, limit, cache)
    lo, lo_e = 1, e1
    hi = 2
    while hi <= limit:
        e = est(hi)
        if not ok(e):
            break
        lo, lo_e = hi, e
        hi *= 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:       # invariant: lo fits, hi does not (or is past the limit)
        mid = (lo + hi) // 2
        e = est(mid)
        if ok(e):
            lo, lo_e = mid, e
        else:
            hi = mid
    return FitResult(what, lo, lo_e, capacity, lo_e.peak_bytes, capacity - lo_e.peak_bytes, context, slack, limit, cache)
