"""Plain-text and JSON rendering of an estimate (no terminal library needed)."""
from __future__ import annotations

import json

from .core import Estimate
from .fit import FitResult
from .units import fmt_bytes


def render_text(e: Estimate, fit: FitResult | None = None) -> str:
    s = e.setup
    prec = f"{s['dtype']} autocast, fp32 master weights" if s["amp"] else s["dtype"]
    head = (f"gpumon estimate: {e.n_params:,} parameters ({e.n_trainable:,} trainable), batch {s['batch']}, "
            f"seq {s['seq']}, {prec}, {s['optimizer']}"
            + f" ({s['impl']}{'' if s.get('impl_source', 'given') == 'given' else ': the default on ' + s.get('device', 'cuda')})"
            + (", gradient checkpointing" if s["checkpointing"] else ""))
    lines = [head, ""]
    w = max(len(t.label) for t in e.terms)
    lines.append(f"  {'term':<{w}}  {'bytes':>10}  {'at peak':>10}  {'share':>6}  how")
    for t in e.terms:
        share = f"{100 * t.at_peak / e.peak_bytes:5.1f}%" if t.at_peak and e.peak_bytes else "     -"
        at = fmt_bytes(t.at_peak) if t.at_peak else "-"
        lines.append(f"  {t.label:<{w}}  {fmt_bytes(t.bytes):>10}  {at:>10}  {share:>6}  {t.note}")
    lines.append("")
    lines.append(f"  peak allocated: {fmt_bytes(e.peak_bytes)} ({e.peak_bytes:,} B) in the {e.peak_phase}: "
                 f"{e.peak_moment}")
    other = {k: v for k, v in e.phases.items() if k != e.peak_phase}
    for k, v in other.items():
        lines.append(f"  {k} high-water mark: {fmt_bytes(v)}")
    lines.append(f"  predicts torch.cuda.max_memory_allocated(); nvidia-smi / NVML will show about "
                 f"{fmt_bytes(e.nvml_range[0])} - {fmt_bytes(e.nvml_range[1])}")
    lines.append("")
    lines.append("  formula: " + e.formula)
    b = e.blog
    lines.append(f"  the blog's heuristic (for comparison): {b['activations_per_token']:,.0f} activations/token -> "
                 f"activations {fmt_bytes(b['activations_bytes'])}, total {fmt_bytes(b['total_bytes'])}")
    lines.append("  assumptions:")
    for a in e.assumptions:
        lines.append(f"    - {a}")
    if fit:
        lines.append("")
        if fit.value == 0:
            lines.append(f"  fit: even {fit.what} 1 does not fit {fmt_bytes(fit.capacity)}: it needs "
                         f"{fmt_bytes(fit.needed)} (peak {fmt_bytes(fit.estimate.peak_bytes)} + {fit.slack:.0%} "
                         f"allocator cache + CUDA context {fmt_bytes(fit.context_bytes)})")
        else:
            lines.append(f"  fit: largest {fit.what} that fits {fmt_bytes(fit.capacity)}: {fit.value} "
                         f"(peak {fmt_bytes(fit.budget)}; with the allocator cache ({fit.slack:.0%} of the peak) and "
                         f"the CUDA context ({fmt_bytes(fit.context_bytes)}) nvidia-smi would show up to "
                         f"{fmt_bytes(fit.needed)})")
    return "\n".join(lines)


def render_json(e: Estimate, fit: FitResult | None = None) -> str:
    d = e.to_dict()
    if fit:
        d["fit"] = fit.to_dict()
    return json.dumps(d, indent=2, default=str)
