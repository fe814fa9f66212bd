"""Estimate vs a live run's measured breakdown, role by role (for the TUI's breakdown view).

The breakdown part (gpumon.model.breakdown) measures, on the user's run, bytes by role:
parameters, gradients, optimizer_state, activations (= allocated - the other three),
allocator_cache (= reserved - allocated), non_pytorch (= NVML process used - reserved).
The estimate predicts the same roles at the high-water mark of each phase
(Estimate.phase_roles), and a range for the two roles outside torch's allocated figure.

    rows = compare(estimate, measured_roles, phase="forward/backward", measured_peak=peak_allocated)
    for r in rows: print(r.label, r.estimate, r.measured, r.error_pct)

Pure: no torch, no textual; takes an Estimate or its to_dict() (e.g. received as JSON).
"""
from __future__ import annotations

from dataclasses import dataclass, asdict

from .core import ALLOCATOR_SLACK, CUDA_CONTEXT_BYTES

ROLES = ("parameters", "gradients", "optimizer_state", "activations", "allocator_cache", "non_pytorch")
LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
          "activations": "activations & temporaries", "allocator_cache": "allocator cache",
          "non_pytorch": "non-PyTorch (CUDA context...)", "peak": "peak allocated"}


@dataclass
class CompareRow:
    role: str
    label: str
    estimate: int | None        # bytes (the middle of the range for the two outer roles)
    measured: int | None
    error_pct: float | None     # (estimate - measured) / measured x 100; None when not comparable
    estimate_range: tuple[int, int] | None = None
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _err(est: int | None, meas: int | None) -> float | None:
    if est is None or meas is None or meas <= 0:
        return None
    return 100.0 * (est - meas) / meas


def compare(estimate, measured: dict, phase: str | None = None, measured_peak: int | None = None) -> list[CompareRow]:
    """Rows (one per role, then the peak) comparing an estimate with measured role bytes.

    estimate: an Estimate or Estimate.to_dict(); measured: {role: bytes} with any of ROLES;
    phase: which phase the measured figures were taken at ("forward/backward" or "optimizer step",
    at that phase's peak); default: the phase the estimate puts the peak in.
    measured_peak: torch's max_memory_allocated, compared with the estimated peak.
    """
    d = estimate.to_dict() if hasattr(estimate, "to_dict") else estimate
    phase = phase or d["peak_phase"]
    if phase not in d["phase_roles"]:
        raise ValueError(f"unknown phase {phase!r}; one of {', '.join(d['phase_roles'])}")
    roles = d["phase_roles"][phase]
    peak_phase_bytes = d["phases"][phase]
    rows: list[CompareRow] = []
    for role in ROLES[:4]:
        est = roles.get(role)
        meas = measured.get(role)
        rows.append(CompareRow(role, LABELS[role], est, meas, _err(est, meas)))
    lo = int(peak_phase_bytes * ALLOCATOR_SLACK[0])
    hi = int(peak_phase_bytes * ALLOCATOR_SLACK[1])
    meas = measured.get("allocator_cache")
    rows.append(CompareRow("allocator_cache", LABELS["allocator_cache"], (lo + hi) // 2, meas,
                           None, (lo, hi), _range_note(meas, lo, hi)))
    lo, hi = CUDA_CONTEXT_BYTES
    meas = measured.get("non_pytorch")
    rows.append(CompareRow("non_pytorch", LABELS["non_pytorch"], (lo + hi) // 2, meas, None, (lo, hi),
                           _range_note(meas, lo, hi)))
    rows.append(CompareRow("peak", LABELS["peak"], peak_phase_bytes, measured_peak,
                           _err(peak_phase_bytes, measured_peak),
                           note=f"{phase} high-water mark" + (" (the predicted peak)" if phase == d["peak_phase"] else "")))
    return rows


def _range_note(meas: int | None, lo: int, hi: int) -> str:
    if meas is None:
        return "range"
    if meas < lo:
        return "below the expected range"
    if meas > hi:
        return "above the expected range"
    return "within the expected range"
