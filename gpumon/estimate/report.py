"""Plain-text and JSON rendering of an estimate (no terminal library needed)."""
from __future__ import annotations

import json
import textwrap

from .core import Estimate
from .fit import FitResult
from .units import fmt_bytes


WIDTH = 80      # the default: an 80x24 terminal, and what a pipe gets


def text_width() -> int:
    """The terminal's width (COLUMNS, else the terminal's, else 80 as in a pipe), kept to 60-100:
    wider than 100 the paragraphs are harder to read, not more useful."""
    import shutil
    return min(max(shutil.get_terminal_size((WIDTH, 24)).columns, 60), 100)


# Shorter names for the table's first column (the full ones stay in --json's "label").
SHORT_LABELS = {
    "activations (saved for backward)": "activations (saved)",
    "optimizer step temporaries": "optimizer temporaries",
    "autocast 16-bit weight copies": "autocast weight copies",
    "logits and loss transients": "logits and loss",
    "FSDP gathered parameters": "FSDP gathered params",
}


def _wrap(text: str, width: int, indent: str = "  ", more: str = "    ") -> list[str]:
    """One paragraph filled to width: the first line indented by indent, the rest by more."""
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=more,
                         break_on_hyphens=False, break_long_words=True) or [indent.rstrip()]


def render_text(e: Estimate, fit: FitResult | None = None, width: int = WIDTH) -> str:
    """The estimate as plain text, every line at most `width` columns (80 by default): the terms
    table abbreviates its labels and keeps to the numbers, each term's "how" follows it as a
    wrapped line, and every paragraph is wrapped (it was ~130 columns and wrapped at 80)."""
    width = max(width, 60)
    s = e.setup
    prec = f"{s['dtype']} autocast, fp32 master weights" if s["amp"] else s["dtype"]
    head = (f"gpumon estimate: {e.n_params:,} parameters ({e.n_trainable:,} trainable), batch {s['batch']}, "
            f"seq {s['seq']}, {prec}, {s['optimizer']}"
            + f" ({s['impl']}{'' if s.get('impl_source', 'given') == 'given' else ': the default on ' + s.get('device', 'cuda')})"
            + (", gradient checkpointing" if s["checkpointing"] else ""))
    lines = _wrap(head, width, "", "  ") + [""]
    labels = [SHORT_LABELS.get(t.label, t.label) for t in e.terms]
    w = max(len(x) for x in labels + ["term"])
    row = "  {:<%d}  {:>9}  {:>9}  {:>6}" % w
    lines.append(row.format("term", "bytes", "at peak", "share"))
    for t, label in zip(e.terms, labels):
        share = f"{100 * t.at_peak / e.peak_bytes:5.1f}%" if t.at_peak and e.peak_bytes else "-"
        at = fmt_bytes(t.at_peak) if t.at_peak else "-"
        lines.append(row.format(label, fmt_bytes(t.bytes), at, share))
    lines += ["", "  how each term is counted:"]
    for t, label in zip(e.terms, labels):
        if t.note:
            lines += _wrap(f"{label}: {t.note}", width, "    ", "      ")
    lines.append("")
    lines += _wrap(f"peak allocated: {fmt_bytes(e.peak_bytes)} ({e.peak_bytes:,} B) in the {e.peak_phase}: "
                   f"{e.peak_moment}", width)
    other = {k: v for k, v in e.phases.items() if k != e.peak_phase}
    for k, v in other.items():
        lines += _wrap(f"{k} high-water mark: {fmt_bytes(v)}", width)
    lines += _wrap(f"predicts the bytes the tensors request at the peak; torch.cuda.max_memory_allocated() "
                   f"adds the allocator's block rounding: {fmt_bytes(e.allocated_range[0])} - "
                   f"{fmt_bytes(e.allocated_range[1])}; nvidia-smi / NVML will show about "
                   f"{fmt_bytes(e.nvml_range[0])} - {fmt_bytes(e.nvml_range[1])}", width)
    lines.append("")
    lines += _wrap("formula: " + e.formula, width)
    b = e.blog
    lines += _wrap(f"the blog's heuristic (for comparison): {b['activations_per_token']:,.0f} activations/token -> "
                   f"activations {fmt_bytes(b['activations_bytes'])}, total {fmt_bytes(b['total_bytes'])}", width)
    lines.append("  assumptions:")
    for a in e.assumptions:
        lines += _wrap(a, width, "    - ", "      ")
    if fit:
        lines.append("")
        if fit.value == 0:
            msg = (f"fit: even {fit.what} 1 does not fit {fmt_bytes(fit.capacity)}: it needs "
                   f"{fmt_bytes(fit.needed)} (peak {fmt_bytes(fit.estimate.peak_bytes)} + {fit.slack:.0%} "
                   f"allocator cache + CUDA context {fmt_bytes(fit.context_bytes)})")
        else:
            msg = (f"fit: largest {fit.what} that fits {fmt_bytes(fit.capacity)}: {fit.value} "
                   f"(peak {fmt_bytes(fit.budget)}; with the allocator cache ({fit.slack:.0%} of the peak) and "
                   f"the CUDA context ({fmt_bytes(fit.context_bytes)}) nvidia-smi would show up to "
                   f"{fmt_bytes(fit.needed)})")
        lines += _wrap(msg, width)
    return "\n".join(lines)


def render_json(e: Estimate, fit: FitResult | None = None) -> str:
    d = e.to_dict()
    if fit:
        d["fit"] = fit.to_dict()
    return json.dumps(d, indent=2, default=str)
