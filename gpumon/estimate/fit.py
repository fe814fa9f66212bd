"""--fit: the largest batch (or sequence length) whose predicted peak fits a GPU.

The budget is the GPU's capacity minus a margin for what torch's allocated figure does not
include: the CUDA context and workspaces (CUDA_CONTEXT_BYTES, upper end) and the allocator's
cache (a fraction of the peak, `slack`). The peak is monotone in batch and sequence length, so a
doubling search followed by a bisection finds the largest value in O(log n) estimates.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .core import CUDA_CONTEXT_BYTES, Estimate, Setup, estimate


@dataclass
class FitResult:
    what: str              # "batch" | "seq"
    value: int             # 0 when not even 1 fits
    estimate: Estimate | None
    capacity: int
    budget: int            # what the allocated peak may use at `value`
    margin: int            # capacity - budget at `value`
    context_bytes: int
    slack: float
    limit: int

    def to_dict(self) -> dict:
        return {"fit": self.what, "value": self.value, "capacity_bytes": self.capacity,
                "budget_bytes": self.budget, "margin_bytes": self.margin, "context_bytes": self.context_bytes,
                "slack": self.slack, "peak_bytes": self.estimate.peak_bytes if self.estimate else None,
                "searched_up_to": self.limit}


def fits(peak: int, capacity: int, context: int, slack: float) -> bool:
    return peak * (1 + slack) + context <= capacity


def fit(setup: Setup, capacity: int, what: str = "batch", slack: float = 0.10,
        context: int = CUDA_CONTEXT_BYTES[1], limit: int = 1 << 24,
        estimator: Callable[[Setup], Estimate] = estimate) -> FitResult:
    if what not in ("batch", "seq"):
        raise ValueError("fit what: batch or seq")

    def est(v: int) -> Estimate:
        return estimator(replace(setup, **{what: v}))

    def ok(e: Estimate) -> bool:
        return fits(e.peak_bytes, capacity, context, slack)

    best, best_e = 0, None
    e1 = est(1)
    if not ok(e1):
        return FitResult(what, 0, e1, capacity, capacity - context, context, context, slack, limit)
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
    best, best_e = lo, lo_e
    margin = capacity - best_e.peak_bytes
    return FitResult(what, best, best_e, capacity, best_e.peak_bytes, margin, context, slack, limit)
