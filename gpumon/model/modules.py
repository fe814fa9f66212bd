"""Per-module memory, as the agent's ``modules`` result gives it (gpumon/agent/modules.py
documents the payload): the module tree with inclusive sums and a depth limit, the flat list
of the modules that hold the most, the peak's parts, and plain-text rendering for
``gpumon modules``. Pure data: no Textual, no torch.

    r = ModuleReport.from_result(payload)      # ValueError for a payload that is not one
    r.tree(depth=2)      # [(depth, Row)] in tree order; Row figures include the children's
    r.top(10)            # [Row] largest own memory first (parameters .. backward at the peak)
    r.parts              # the peak's parts, in PEAK_PARTS order (they sum to r.peak)
    render(r, depth=2, top=10)   # the text ``gpumon modules`` prints
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

PEAK_PARTS = ("parameters", "buffers", "gradients", "optimizer_state", "activations",
              "backward", "outside_forward", "outside_backward", "optimizer_temporaries",
              "other", "before_step", "rounding")
PART_LABELS = {
    "parameters": "parameters", "buffers": "buffers", "gradients": "gradients",
    "optimizer_state": "optimizer state", "activations": "activations (module forwards)",
    "backward": "backward (module backwards)", "outside_forward": "forward outside modules (loss)",
    "outside_backward": "backward outside modules", "optimizer_temporaries":
    "optimizer step temporaries", "other": "between steps (data, zero_grad)",
    "before_step": "live before the step (batch, held tensors)",
    "rounding": "allocator rounding"}
ADDITIVE = ("params", "buffers", "grads", "optimizer_state", "act_at_peak", "bwd_at_peak")
ROOT_LABEL = "(root)"


@dataclass(frozen=True)
class Row:
    path: str
    type: str
    calls: int = 0
    params: int = 0
    buffers: int = 0
    grads: int = 0
    optimizer_state: int = 0
    act_at_peak: int = 0
    bwd_at_peak: int = 0
    fwd_retained: int | None = None
    fwd_transient: int | None = None
    bwd_transient: int | None = None

    @property
    def own(self) -> int:
        """What this row holds at the peak: persistent tensors and live activations."""
        return sum(getattr(self, k) for k in ADDITIVE)

    @property
    def label(self) -> str:
        return self.path or ROOT_LABEL

    @property
    def depth(self) -> int:
        return 0 if not self.path else self.path.count(".") + 1


def parent(path: str) -> str | None:
    if not path:
        return None
    return path.rsplit(".", 1)[0] if "." in path else ""


def _int(v: Any, name: str, null: bool = False) -> Any:
    if v is None and null:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"modules result: {name} is not a byte count")
    return v


@dataclass
class ModuleReport:
    rows: list
    peak: int | None
    peak_step: int | None
    peak_phase: str | None
    peak_stack: list
    parts: dict | None
    exact: bool
    note: str | None
    steps: int
    device: Any
    compiled: list
    step_time: dict
    cost: dict
    t: float | None

    @classmethod
    def from_result(cls, d: Any) -> "ModuleReport":
        if not isinstance(d, dict):
            raise ValueError("modules result: not an object")
        if not d.get("ok"):
            raise ValueError(str(d.get("error") or "the measurement failed"))
        rows = []
        for m in d.get("modules") or []:
            if not isinstance(m, dict) or not isinstance(m.get("path"), str):
                raise ValueError("modules result: a module without a path")
            rows.append(Row(
                m["path"], str(m.get("type") or "?"), _int(m.get("calls", 0), "calls"),
                *(_int(m.get(k, 0), k) for k in ("params", "buffers", "grads",
                                                 "optimizer_state", "act_at_peak",
                                                 "bwd_at_peak")),
                *(_int(m.get(k), k, null=True) for k in ("fwd_retained", "fwd_transient",
                                                         "bwd_transient"))))
        parts = d.get("at_peak")
        if parts is not None:
            if not isinstance(parts, dict):
                raise ValueError("modules result: at_peak is not an object")
            parts = {k: _int(parts.get(k, 0), k) for k in PEAK_PARTS}
        st = d.get("step_time_s") if isinstance(d.get("step_time_s"), dict) else {}
        return cls(rows=rows, peak=_int(d.get("peak"), "peak", null=True),
                   peak_step=d.get("peak_step"), peak_phase=d.get("peak_phase"),
                   peak_stack=[str(p) for p in d.get("peak_stack") or []], parts=parts,
                   exact=bool(d.get("exact")), note=d.get("note"),
                   steps=int(d.get("steps") or 0), device=d.get("device"),
                   compiled=[str(p) for p in d.get("compiled") or []], step_time=st,
                   cost=d.get("cost") if isinstance(d.get("cost"), dict) else {},
                   t=d.get("t"))

    # ------------------------------------------------------------------ views
    def by_path(self) -> dict:
        return {r.path: r for r in self.rows}

    def inclusive(self) -> dict:
        """path -> Row whose additive figures include every descendant's."""
        out = {r.path: r for r in self.rows}
        for r in self.rows:
            p = parent(r.path)
            while p is not None and p not in out:
                # a module the hooks never saw (a container that never runs forward, such as
                # a ModuleList): a node of the tree all the same
                out[p] = Row(p, "")
                p = parent(p)
        sums = {p: {k: getattr(r, k) for k in ADDITIVE} for p, r in out.items()}
        # deepest first: each sum is complete before it is added to its parent's
        for path in sorted(out, key=lambda p: -Row(p, "").depth):
            p = parent(path)
            if p is not None:
                for k in ADDITIVE:
                    sums[p][k] += sums[path][k]
        return {p: replace(row, **sums[p]) for p, row in out.items()}

    def tree(self, depth: int | None = None) -> list:
        """[(depth, Row)] in tree order (children by the memory they hold, largest first),
        down to ``depth`` levels below the root (None: all)."""
        inc = self.inclusive()
        children: dict = {}
        for p in inc:
            children.setdefault(parent(p), []).append(p)
        out: list = []

        def visit(p: str, d: int) -> None:
            out.append((d, inc[p]))
            if depth is not None and d >= depth:
                return
            for c in sorted(children.get(p, ()), key=lambda c: (-inc[c].own, _natural(c))):
                visit(c, d + 1)
        for root in sorted(children.get(None, ()), key=_natural):
            visit(root, 0)
        return out

    def top(self, k: int = 10) -> list:
        """The k modules holding the most memory of their own at the peak (children apart)."""
        rows = [r for r in self.rows if r.own > 0]
        rows.sort(key=lambda r: (-r.own, _natural(r.path)))
        return rows[:k]

    def top_activations(self, k: int = 10) -> list:
        rows = [r for r in self.rows if r.act_at_peak + r.bwd_at_peak > 0]
        rows.sort(key=lambda r: (-(r.act_at_peak + r.bwd_at_peak), _natural(r.path)))
        return rows[:k]

    def peak_module(self) -> str | None:
        """The innermost module running at the peak (its path, or the root label)."""
        if not self.peak_stack:
            return None
        return self.peak_stack[-1] or ROOT_LABEL


def _natural(s: str) -> tuple:
    """model.layers.10 after model.layers.9."""
    out = []
    for part in s.split("."):
        out.append((0, int(part), "") if part.isdigit() else (1, 0, part))
    return tuple(out)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"
    return str(n)


def _fmt_s(x: Any) -> str:
    return f"{x * 1000:.1f} ms" if isinstance(x, (int, float)) else "-"


def render(r: ModuleReport, depth: int | None = 2, top: int = 10) -> str:
    """The plain-text report of ``gpumon modules``."""
    lines = []
    where = f"device {r.device}" if r.device is not None else ""
    if r.peak is not None:
        stack = " > ".join(p or ROOT_LABEL for p in r.peak_stack) or "no module"
        lines.append(f"peak {fmt_bytes(r.peak)} on {where} in measured step {r.peak_step} of "
                     f"{r.steps}, {r.peak_phase}, running: {stack}")
    else:
        lines.append(f"{r.steps} step(s) measured on {where}: no peak (persistent parts only)")
    if r.note:
        lines.append(f"note: {r.note}")
    if r.compiled:
        lines.append("compiled (measured as one module, its submodules run inside the graph): "
                     + ", ".join(p or ROOT_LABEL for p in r.compiled))
    st = r.step_time
    meas = st.get("measured") or []
    lines.append("step time: before " + _fmt_s(st.get("before")) + ", measured "
                 + (", ".join(_fmt_s(x) for x in meas) or "-") + ", after "
                 + _fmt_s(st.get("after")))
    if r.parts:
        lines.append("")
        lines.append("at the peak" + ("" if r.exact else " (does not add up: see note)"))
        for k in PEAK_PARTS:
            v = r.parts.get(k, 0)
            if v:
                lines.append(f"  {PART_LABELS[k]:<44} {fmt_bytes(v):>10}")
        lines.append(f"  {'total':<44} {fmt_bytes(sum(r.parts.values())):>10}")
    # the figures first and the module last, as du prints: a path is never cut
    head = (f"{'params':>9} {'grads':>9} {'optim':>9} {'act@peak':>9} {'bwd@peak':>9} "
            f"{'fwd peak':>9} {'bwd peak':>9}  module")
    lines.append("")
    lines.append("by module" + (f" (depth {depth})" if depth is not None else "")
                 + ", children included")
    lines.append(head)
    for d, row in r.tree(depth):
        name = row.label if d == 0 else row.path.rsplit(".", 1)[-1]
        typed = f"{name} ({row.type})" if row.type else name
        lines.append(_row_line("  " * min(d, 8) + typed, row))
    tops = r.top(top)
    if tops:
        lines.append("")
        lines.append(f"top {len(tops)} modules by their own memory at the peak")
        lines.append(head)
        for row in tops:
            lines.append(_row_line(row.label, row))
    return "\n".join(lines)


def _row_line(name: str, row: Row) -> str:
    return (f"{fmt_bytes(row.params + row.buffers):>9} {fmt_bytes(row.grads):>9} "
            f"{fmt_bytes(row.optimizer_state):>9} {fmt_bytes(row.act_at_peak):>9} "
            f"{fmt_bytes(row.bwd_at_peak):>9} {fmt_bytes(row.fwd_transient):>9} "
            f"{fmt_bytes(row.bwd_transient):>9}  {name}")
