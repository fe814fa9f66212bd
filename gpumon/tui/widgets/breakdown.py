"""The breakdown by role: a stacked bar (now and at the step's peak), a role table, the recent
steps and the advice. Renders a gpumon.model.breakdown.BreakdownModel; call update_model()."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from gpumon.model.advice import advise
from gpumon.model.breakdown import ROLES, BreakdownModel

COLOURS = {"parameters": "blue", "gradients": "yellow", "optimizer_state": "green",
           "activations": "red", "allocator_cache": "grey50", "non_pytorch": "magenta"}
GLYPH = {"parameters": "P", "gradients": "G", "optimizer_state": "O", "activations": "A",
         "allocator_cache": "c", "non_pytorch": "n"}


def _h(n) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def stacked_bar(roles: dict | None, width: int, scale: int) -> Text:
    t = Text()
    if not roles or scale <= 0:
        return t.append("(no figures yet)", style="dim")
    used = 0
    for r in ROLES:
        v = roles.get(r) or 0
        n = int(round(width * v / scale))
        n = min(n, width - used)
        if n > 0:
            t.append(GLYPH[r] * n, style=f"bold {COLOURS[r]} on {COLOURS[r]}")
            used += n
    return t.append(" " * max(0, width - used))


class BreakdownView(Vertical):
    DEFAULT_CSS = """
    BreakdownView { height: auto; }
    BreakdownView > .bars { height: 3; }
    BreakdownView > DataTable { height: auto; max-height: 12; }
    BreakdownView > .advice { height: auto; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="bd-bars", classes="bars")
        yield DataTable(id="bd-roles", show_cursor=False)
        yield DataTable(id="bd-steps", show_cursor=False)
        yield Static(id="bd-advice", classes="advice")

    def on_mount(self) -> None:
        rt = self.query_one("#bd-roles", DataTable)
        for c in ("role", "now", "at step peak"):
            rt.add_column(c, key=c)
        self.query_one("#bd-steps", DataTable).add_columns(
            "step", "time", "peak", "peak phase", "phases")
        self._roles_rows = False
        self._steps_seen = 0
        self.update_model(BreakdownModel())

    def update_model(self, model: BreakdownModel, logits_bytes: int | None = None) -> None:
        d = model.main_device()
        bars = self.query_one("#bd-bars", Static)
        roles_t = self.query_one("#bd-roles", DataTable)
        if d is None:
            bars.update(Text("breakdown: waiting for the first phase boundary", style="dim"))
        else:
            scale = max(sum(v or 0 for v in (d.now or {}).values()),
                        sum(v or 0 for v in (d.at_peak or {}).values()), 1)
            width = max(10, (self.size.width or 80) - 14)
            pk = "" if d.peak_phase is None else (
                f"  peak {'' if d.peak_exact else '>= '}{_h(d.peak)} in {d.peak_phase}")
            t = Text("now     ").append_text(stacked_bar(d.now, width, scale)).append("\n")
            t.append("at peak ").append_text(stacked_bar(d.at_peak, width, scale)).append("\n")
            t.append(f"device {d.index}{pk}" + (f"  phase now: {model.phase}" if model.phase
                                                 else ""), style="bold")
            bars.update(t)
            for r in ROLES:
                cells = (Text(f"{GLYPH[r]} {r}", style=COLOURS[r]), _h((d.now or {}).get(r)),
                         _h((d.at_peak or {}).get(r)) if d.at_peak else "-")
                if self._roles_rows:
                    for col, v in zip(("role", "now", "at step peak"), cells):
                        roles_t.update_cell(r, col, v)
                else:
                    roles_t.add_row(*cells, key=r)
            if not self._roles_rows:
                self._roles_rows = True
        steps_t = self.query_one("#bd-steps", DataTable)
        rows = list(model.steps)
        new = [s for s in rows if s.step > self._steps_seen]
        for s in new[-20:]:
            phases = " ".join(f"{k}:{v.get('time_s', 0) * 1000:.0f}ms"
                              for k, v in s.phases.items() if isinstance(v, dict))
            steps_t.add_row(str(s.step), f"{s.time_s * 1000:.0f} ms",
                            ("" if s.peak_exact else ">= ") + _h(s.peak),
                            s.peak_phase or "-", phases)
            self._steps_seen = s.step
        while steps_t.row_count > 20:
            steps_t.remove_row(next(iter(steps_t.rows)))
        adv = advise(model, logits_bytes=logits_bytes)
        a = Text()
        if model.note:
            a.append(f"note: {model.note}\n", style="yellow")
        for item in adv:
            a.append(f"* {item.title}\n", style="bold").append(
                f"  because {item.trigger}; saves {item.saving}\n")
        self.query_one("#bd-advice", Static).update(a)
