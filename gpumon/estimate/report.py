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


def largest_term(e: Estimate):
    """The term with the most bytes live at the peak."""
    return max(e.terms, key=lambda t: t.at_peak)


def _card(gpu: dict | None, capacity: int) -> str:
    """'H100-80GB (79.2 GiB usable)' for a card by name, '80 GiB' for a size."""
    label = (gpu or {}).get("label")
    if not label or label == fmt_bytes(capacity):
        return fmt_bytes(capacity)
    return f"{label} ({fmt_bytes(capacity)} usable)"


def verdict_lines(e: Estimate, fit: FitResult | None = None, gpu: dict | None = None,
                  width: int = WIDTH) -> list[str]:
    """The answer first (issue 34: the "does NOT fit" verdict was the last 2 lines of 50): fits or
    not on which card, the peak, and the largest term. gpu: {"label", "capacity", "needed",
    "cache"} for --gpu without --fit."""
    big = largest_term(e)
    share = f" ({100 * big.at_peak / e.peak_bytes:.0f}% of the peak)" if e.peak_bytes else ""
    peak = (f"peak {fmt_bytes(e.peak_bytes)} in the {e.peak_phase}; largest term: "
            f"{big.label} {fmt_bytes(big.at_peak)}{share}")
    lines: list[str] = []
    if fit is not None:
        cap = _card(gpu, fit.capacity)
        if fit.value == 0:
            head = (f"does NOT fit on {cap}, not even {fit.what} 1: it needs {fmt_bytes(fit.needed)} "
                    f"(the peak with the allocator's rounding and the CUDA context)")
        else:
            head = (f"largest {fit.what} that fits on {cap}: {fit.value}, needing {fmt_bytes(fit.needed)} "
                    f"(the peak with the allocator's rounding and the CUDA context"
                    + (f", + {fit.slack:.0%} margin" if fit.slack else "") + ")")
        lines += _wrap(head, width, "", "  ")
        cache = fit.cache_may_form
        if cache:
            over = fit.needed + cache > fit.capacity
            lines += _wrap(f"cache that may form: up to {fmt_bytes(cache)} of allocator cache beside it "
                           f"(not needed: the allocator frees it before failing)"
                           + ("; with all of it the card would be full: PYTORCH_CUDA_ALLOC_CONF="
                              "expandable_segments:True keeps it small" if over else ""), width, "  ", "    ")
    elif gpu is not None:
        ok = gpu["needed"] <= gpu["capacity"]
        card = _card(gpu, gpu["capacity"])
        lines += _wrap(f"{'fits' if ok else 'does NOT fit'} on {card}: it needs {fmt_bytes(gpu['needed'])} "
                       f"(the peak with the allocator's rounding and the CUDA context)", width, "", "  ")
        if gpu.get("cache"):
            over = ok and gpu["needed"] + gpu["cache"] > gpu["capacity"]
            lines += _wrap(f"cache that may form: up to {fmt_bytes(gpu['cache'])} of allocator cache beside it "
                           "(not needed: the allocator frees it before failing)"
                           + ("; with all of it the card would be full: PYTORCH_CUDA_ALLOC_CONF="
                              "expandable_segments:True keeps it small" if over else ""), width, "  ", "    ")
    if e.activation_method == "heuristic":
        from .core import heuristic_ratio
        lo, hi = heuristic_ratio(e.n_params)
        peak += (f"; a rough upper bound (--params alone: the activations may be {lo:g}x to {hi:g}x too high "
                 "for a model this size; give --config for the formula)")
    if lines:
        lines += _wrap(peak, width, "  ", "    ")
    else:
        lines += _wrap("gpumon estimate: " + peak, width, "", "  ")
    return lines


def render_text(e: Estimate, fit: FitResult | None = None, width: int = WIDTH, gpu: dict | None = None) -> str:
    """The estimate as plain text, every line at most `width` columns (80 by default): the verdict
    first (fits or not, the peak, the largest term), then the terms table, which abbreviates its
    labels and keeps to the numbers, each term's "how" as a wrapped line, every paragraph wrapped."""
    width = max(width, 60)
    s = e.setup
    prec = f"{s['dtype']} autocast, fp32 master weights" if s["amp"] else s["dtype"]
    idle = f", {e.n_no_grad:,} never run: no gradient" if e.n_no_grad else ""
    head = (f"the run: {e.n_params:,} parameters ({e.n_trainable:,} trainable{idle}), batch {s['batch']}, "
            f"seq {s['seq']}, {prec}, {s['optimizer']}"
            + f" ({s['impl']}{'' if s.get('impl_source', 'given') == 'given' else ': the default on ' + s.get('device', 'cuda')})"
            + (", gradient checkpointing" if s["checkpointing"] else ""))
    lines = verdict_lines(e, fit, gpu, width) + [""] + _wrap(head, width, "", "  ") + [""]
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
    lo, hi = e.nvml_range
    cap = (fit.capacity if fit is not None else gpu["capacity"] if gpu is not None else None)
    # no card shows more than it has: the cache fills what is free, no further
    nvml = (f"{fmt_bytes(min(lo, cap))} - {fmt_bytes(cap)} (the card: its cache may fill it)"
            if cap is not None and hi > cap else f"{fmt_bytes(lo)} - {fmt_bytes(hi)}")
    lines += _wrap(f"predicts the bytes the tensors request at the peak; torch.cuda.max_memory_allocated() "
                   f"adds the allocator's block rounding: {fmt_bytes(e.allocated_range[0])} - "
                   f"{fmt_bytes(e.allocated_range[1])}; nvidia-smi / NVML will show about {nvml}", width)
    lines.append("")
    lines += _wrap("formula: " + e.formula, width)
    b = e.blog
    lines += _wrap(f"the blog's heuristic (for comparison): {b['activations_per_token']:,.0f} activations/token -> "
                   f"activations {fmt_bytes(b['activations_bytes'])}, total {fmt_bytes(b['total_bytes'])}", width)
    lines.append("  assumptions:")
    for a in e.assumptions:
        lines += _wrap(a, width, "    - ", "      ")
    return "\n".join(lines)


def render_json(e: Estimate, fit: FitResult | None = None, gpu: dict | None = None) -> str:
    d = e.to_dict()
    big = largest_term(e)
    d["largest_term"] = {"key": big.key, "label": big.label, "at_peak": big.at_peak}
    if fit:
        d["fit"] = fit.to_dict()
    if gpu:
        d["gpu"] = {**gpu, **({"fits": gpu["needed"] <= gpu["capacity"]} if "needed" in gpu else {})}
    return json.dumps(d, indent=2, default=str)
