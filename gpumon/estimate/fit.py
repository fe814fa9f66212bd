"""--fit: the largest batch (or sequence length) whose predicted device figure fits a GPU.

A value fits when the upper end of its predicted nvidia-smi / NVML figure does: the requested
peak with the allocator's block rounding (upper end), plus the allocator's cache at the peak
(the fraction the estimate predicts, `slack`, unless the user gives one), plus the CUDA context and workspaces (CUDA_CONTEXT_BYTES, upper
end). A fitted batch therefore never has a predicted range that passes the card. The peak is
monotone in batch and sequence length, so a doubling search followed by a bisection finds the
largest value in O(log n) estimates.
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
    slack: float           # the allocator cache kept free, as a fraction of the peak
    limit: int

    @property
    def needed(self) -> int:
        """What the device must hold at `value`: peak x (1 + slack) + context."""
        return needed(self.estimate.peak_bytes, self.context_bytes, self.slack) if self.estimate else 0

    def to_dict(self) -> dict:
        return {"fit": self.what, "value": self.value, "capacity_bytes": self.capacity,
                "budget_bytes": self.budget, "margin_bytes": self.margin, "context_bytes": self.context_bytes,
                "slack": self.slack, "peak_bytes": self.estimate.peak_bytes if self.estimate else None,
                "needed_bytes": self.needed, "searched_up_to": self.limit}


def needed(peak: int, context: int, slack: float) -> int:
    # the allocator's block rounding (upper end) and its cache on top of the requested peak
    return int(peak * (1 + ALLOCATOR_ROUNDING[1]) * (1 + slack) + context)


def fits(peak: int, capacity: int, context: int, slack: float) -> bool:
    return needed(peak, context, slack) <= capacity


def fit(setup: Setup, capacity: int, what: str = "batch", slack: float | None = None,
        context: int = CUDA_CONTEXT_BYTES[1], limit: int = 1 << 24,
        estimator: Callable[[Setup], Estimate] = estimate) -> FitResult:
    """slack None: the upper end of the allocator cache the estimate predicts for this setup."""
    if what not in ("batch", "seq"):
        raise ValueError("fit what: batch or seq")
    if slack is None:
        slack = allocator_cache_fraction(setup.checkpointing)[1]
    if what == "seq" and setup.arch is not None:
        limit = min(limit, setup.arch.max_positions)

    def est(v: int) -> Estimate:
        return estimator(replace(setup, **{what: v}))

    def ok(e: Estimate) -> bool:
        return fits(e.peak_bytes, capacity, context, slack)

    e1 = est(1)
    if not ok(e1):
        return FitResult(what, 0, e1, capacity, e1.peak_bytes, capacity - e1.peak_bytes, context, slack, limit)
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
    return FitResult(what, lo, lo_e, capacity, lo_e.peak_bytes, capacity - lo_e.peak_bytes, context, slack, limit)
