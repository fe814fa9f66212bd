"""An estimate beside a live run's measured breakdown, term by term, with the error in %.

Pure: no torch, no textual. Takes the estimate as an `Estimate` or as its JSON (what
`gpumon estimate ... --json` prints), and the measured figures as plain data from the live
agent's `breakdown` events (gpumon/agent/phases.py documents them; gpumon.model.breakdown
folds them into `DeviceBreakdown`).

For the TUI (`gpumon attach --estimate EST.json`):

    import json
    from gpumon.estimate.compare import compare_device, render_comparison
    est = json.load(open("EST.json"))
    c = compare_device(est, model.main_device())     # a DeviceBreakdown, or a breakdown event's device dict
    for r in c.rows: r.label, r.estimate, r.measured, r.error_pct, r.note   # bytes, bytes, % or None
    c.peak_error_pct                                  # the headline figure (None until a peak is measured)
    print(render_comparison(c))                       # the same as plain text

Or with figures in hand: `compare_live(est, Measured(peak=..., peak_phase="backward",
roles={"parameters": ..., "gradients": ..., "optimizer_state": ...}))`.

How the two sides line up. The agent measures parameters, gradients and optimizer state
exactly (tensor storages) at the end of each phase (forward, backward, optimizer), the run's
peak allocated (= torch.cuda.max_memory_allocated) and the phase where it was set; "activations &
temporaries" is the peak minus those three. The estimate gives the same figures for each
phase (Estimate.live_phases), so each row compares like with like at the measured peak phase:

    parameters        params (+ FSDP gathered layers)
    gradients         the gradients alive at the end of that phase (0 after forward, all after backward)
    optimizer state   opt_state
    activations & temporaries  peak - the three above: saved activations, logits and loss,
                      autocast weight copies, optimizer step temporaries, cuBLAS workspace
    peak allocated    the estimate's peak vs max_memory_allocated; the note says whether the
                      peak falls in the same phase
    allocator cache, non-PyTorch: outside torch's allocated figure; a range, no % error

A figure the run does not give (a CPU run has no allocator figures) is None, and so is its error.
"""
from __future__ import annotations

from dataclasses import dataclass, asdict, field
from typing import Any

from .core import ALLOCATOR_SLACK, CUDA_CONTEXT_BYTES
from .units import fmt_bytes

LIVE_PHASES = ("forward", "backward", "optimizer")
PERSISTENT = ("parameters", "gradients", "optimizer_state")
LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
          "activations": "activations & temporaries", "peak": "peak allocated",
          "allocator_cache": "allocator cache", "non_pytorch": "non-PyTorch (CUDA context...)"}
# the estimate's own phase names -> the agent's
_EST_PHASE = {"optimizer step": "optimizer", "forward/backward": None}


@dataclass
class Measured:
    """What the live run measured. peak: max_memory_allocated (None: not measured, e.g. a CPU
    run); peak_phase: the agent's phase name where it was set; roles: bytes by role at the end
    of that phase (any of parameters, gradients, optimizer_state, allocator_cache, non_pytorch)."""
    peak: int | None = None
    peak_phase: str | None = None
    peak_step: int | None = None
    roles: dict = field(default_factory=dict)


@dataclass
class CompareRow:
    role: str
    label: str
    estimate: int | None        # bytes (for the two range rows: the middle of the range)
    measured: int | None
    error_pct: float | None     # (estimate - measured) / measured x 100; None when not comparable
    estimate_range: tuple[int, int] | None = None
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Comparison:
    rows: list[CompareRow]
    phase: str                  # the agent's phase the rows are taken at
    estimate_phase: str         # where the estimate puts the peak (agent's vocabulary)
    measured_phase: str | None
    peak_error_pct: float | None
    notes: list[str] = field(default_factory=list)

    def row(self, role: str) -> CompareRow:
        for r in self.rows:
            if r.role == role:
                return r
        raise KeyError(role)

    def to_dict(self) -> dict:
        return {"rows": [r.to_dict() for r in self.rows], "phase": self.phase,
                "estimate_phase": self.estimate_phase, "measured_phase": self.measured_phase,
                "peak_error_pct": self.peak_error_pct, "notes": list(self.notes)}


def error_pct(est: int | None, meas: int | None) -> float | None:
    if est is None or meas is None or meas <= 0:
        return None
    return 100.0 * (est - meas) / meas


def as_estimate_dict(estimate: Any) -> dict:
    """The estimate as a dict (an Estimate or its JSON), checked; ValueError if it is not one."""
    d = estimate.to_dict() if hasattr(estimate, "to_dict") else estimate
    bad = ValueError("not a gpumon estimate (write one with: gpumon estimate ... --json > EST.json)")
    if not isinstance(d, dict) or not isinstance(d.get("live_phases"), dict) or not _is_int(d.get("peak_bytes")):
        raise bad
    for ph in LIVE_PHASES:
        v = d["live_phases"].get(ph)
        if not isinstance(v, dict) or not all(_is_int(v.get(k)) for k in ("peak",) + PERSISTENT):
            raise bad
    if not isinstance(d.get("terms", []), list) or not all(
            isinstance(t, dict) and isinstance(t.get("key"), str) and isinstance(t.get("label"), str)
            and _is_int(t.get("at_peak")) for t in d.get("terms", [])):
        raise bad
    return d


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def estimate_peak_phase(d: dict) -> str:
    """The agent's phase in which the estimate's peak falls."""
    lp = d["live_phases"]
    return max(LIVE_PHASES, key=lambda k: (lp[k]["peak"], k == "optimizer"))


def compare_live(estimate: Any, measured: Measured) -> Comparison:
    """Rows: parameters, gradients, optimizer state, activations & temporaries, peak allocated,
    allocator cache, non-PyTorch (in that order)."""
    d = as_estimate_dict(estimate)
    lp = d["live_phases"]
    est_phase = estimate_peak_phase(d)
    notes: list[str] = []
    phase = measured.peak_phase if measured.peak_phase in LIVE_PHASES else est_phase
    if measured.peak_phase is not None and measured.peak_phase not in LIVE_PHASES:
        notes.append(f"the run's peak is in the phase {measured.peak_phase!r}, which the estimate does not "
                     f"model: rows taken at the estimate's peak phase ({est_phase})")
    e = lp[phase]
    roles = measured.roles or {}
    rows: list[CompareRow] = []
    for role in PERSISTENT:
        rows.append(CompareRow(role, LABELS[role], e[role], roles.get(role), error_pct(e[role], roles.get(role)),
                               note=f"at the end of {phase}" if role == "gradients" else ""))
    est_act = e["peak"] - sum(e[r] for r in PERSISTENT)
    meas_act = None
    if measured.peak is not None and all(roles.get(r) is not None for r in PERSISTENT) and phase == measured.peak_phase:
        meas_act = measured.peak - sum(roles[r] for r in PERSISTENT)
    rows.append(CompareRow("activations", LABELS["activations"], est_act, meas_act, error_pct(est_act, meas_act),
                           note=_activation_note(d, phase)))
    peak_err = error_pct(d["peak_bytes"], measured.peak)
    same = measured.peak_phase == est_phase
    pnote = f"estimate: in {est_phase}"
    if measured.peak_phase:
        pnote += f"; measured: in {measured.peak_phase}" + (" (same phase)" if same else " (a different phase)")
    if measured.peak_step is not None:
        pnote += f", step {measured.peak_step}"
    rounding = d.get("allocated_range")
    if measured.peak is not None and rounding and rounding[0] <= measured.peak <= rounding[1] \
            and measured.peak > d["peak_bytes"]:
        pnote += ("; the difference is within the allocator's block rounding (the estimate counts the bytes "
                  "requested, max_memory_allocated whole blocks)")
    rows.append(CompareRow("peak", LABELS["peak"], d["peak_bytes"], measured.peak, peak_err, note=pnote))
    fr = d.get("allocator_cache") or ALLOCATOR_SLACK
    lo, hi = int(d["peak_bytes"] * fr[0]), int(d["peak_bytes"] * fr[1])
    m = roles.get("allocator_cache")
    rows.append(CompareRow("allocator_cache", LABELS["allocator_cache"], (lo + hi) // 2, m, None, (lo, hi),
                           _range_note(m, lo, hi)))
    lo, hi = CUDA_CONTEXT_BYTES
    m = roles.get("non_pytorch")
    rows.append(CompareRow("non_pytorch", LABELS["non_pytorch"], (lo + hi) // 2, m, None, (lo, hi),
                           _range_note(m, lo, hi)))
    if measured.peak is None:
        notes.append("no allocator figures from this run (CPU or simulated source): only parameters, "
                     "gradients and optimizer state are compared")
    if measured.peak_step is not None and measured.peak_step < 2:
        notes.append("the measured peak is from step 1, before the optimizer state existed: "
                     "the estimate is of a steady-state step")
    return Comparison(rows, phase, est_phase, measured.peak_phase, peak_err, notes)


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def measured_from_device(device: Any, phase_ends: dict | None = None,
                         fallback_phase: str | None = None) -> Measured:
    """Measured figures of one device from a breakdown event's device dict or a DeviceBreakdown.

    The peak is the run's (`run_peak`: max_memory_allocated, exact). The roles are those read at
    the end of the run's peak phase: from `phase_ends` ({phase: roles}, e.g. the `now` of the
    breakdown events whose `phase` ended) when given, else the device's `at_run_peak` (the
    agent's roles at the run's high-water mark), else its `at_peak` roles when they belong to
    that phase, else its `now`. A run with no peak phase (a CPU run: no allocator figures) is
    read at the end of `fallback_phase` (the estimate's peak phase) where that end was seen: the
    latest `now` may be any phase's end (after zero_grad, no gradients)."""
    peak = _get(device, "run_peak")
    phase = _get(device, "run_peak_phase")
    step = _get(device, "run_peak_step")
    if peak is None:
        peak, phase, step = _get(device, "peak"), _get(device, "peak_phase"), _get(device, "peak_step")
    roles = None
    pick = phase or fallback_phase
    if phase_ends and pick in phase_ends:
        roles = phase_ends[pick]
    elif _get(device, "at_run_peak") and _get(device, "run_peak") is not None:
        roles = _get(device, "at_run_peak")
    elif _get(device, "at_peak") and _get(device, "peak_phase") == phase:
        roles = _get(device, "at_peak")
    else:
        roles = _get(device, "now") or {}
    return Measured(peak=peak, peak_phase=phase, peak_step=step, roles=dict(roles))


def compare_device(estimate: Any, device: Any, phase_ends: dict | None = None,
                   fallback_phase: str | None = None) -> Comparison:
    """compare_live() with the figures of a DeviceBreakdown or a breakdown event's device dict."""
    return compare_live(estimate, measured_from_device(device, phase_ends, fallback_phase))


def _activation_note(d: dict, phase: str) -> str:
    if phase != estimate_peak_phase(d):
        return ""
    parts = [f"{t['label']} {fmt_bytes(t['at_peak'])}" for t in d.get("terms", ())
             if t["key"] not in ("params", "grads", "opt_state") and t.get("at_peak")]
    return "estimate: " + " + ".join(parts) if parts else ""


def _range_note(meas: int | None, lo: int, hi: int) -> str:
    if meas is None:
        return "expected range"
    if meas < lo:
        return "below the expected range"
    if meas > hi:
        return "above the expected range"
    return "within the expected range"


def render_comparison(c: Comparison, width: int = 80) -> str:
    """Plain text, at most `width` columns: one line per row, each row's note wrapped under it,
    then the peak error and notes."""
    import textwrap

    def wrap(text, first="  ", more="    "):
        return textwrap.wrap(text, width=max(width, 60), initial_indent=first, subsequent_indent=more,
                             break_on_hyphens=False)

    w = max(len(r.label) for r in c.rows)
    lines = [f"  {'term':<{w}}  {'estimate':>11}  {'measured':>11}  {'error':>7}"]
    for r in c.rows:
        if r.estimate_range:
            est = f"{fmt_bytes(r.estimate_range[0])}-{fmt_bytes(r.estimate_range[1])}"
        else:
            est = fmt_bytes(r.estimate) if r.estimate is not None else "-"
        meas = fmt_bytes(r.measured) if r.measured is not None else "-"
        err = f"{r.error_pct:+.1f}%" if r.error_pct is not None else "-"
        lines.append(f"  {r.label:<{w}}  {est:>11}  {meas:>11}  {err:>7}".rstrip())
        if r.note:
            lines += wrap(r.note, "      ", "      ")
    lines.append("")
    if c.peak_error_pct is not None:
        lines += wrap(f"peak error: {c.peak_error_pct:+.1f}% (estimate vs max_memory_allocated), "
                      f"rows at the end of {c.phase}")
    else:
        lines.append("  peak error: not measured")
    for n in c.notes:
        lines += wrap(f"note: {n}")
    return "\n".join(lines)
