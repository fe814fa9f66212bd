"""The breakdown by role: a stacked bar (now and at the run's peak), a role table (with the
estimate beside it, when one is given), the recent steps and the advice. Only renders: the data
is a gpumon.model.breakdown.BreakdownModel that the screen feeds.

API (for the attach screen):

    view = BreakdownView(id="breakdown")          # mount it anywhere (e.g. DevicePane.extras)
    model = BreakdownModel()                      # the screen owns it
    model.feed(msg)                               # every protocol message of that agent
    model.set_estimate(json.load(f))              # optional: `gpumon estimate --json` output
    view.update_model(model)                      # at the screen's redraw rate; diffs in place
    phase_colour("forward")                       # the colour of a phase (chart colouring)

The table has the columns role / at end (of the last phase boundary) / at peak, plus estimate /
error when the model has an estimate (added and removed in place; the comparison itself is
gpumon.estimate.compare's). ``at peak`` is at the run's high-water mark (exact); the
steps table marks lower bounds with ">=". Colours: ROLE_COLOURS, PHASE_COLOURS; glyphs GLYPH
keep the bar readable in monochrome.
"""
from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from gpumon.model.advice import advise
from gpumon.model.breakdown import ROLES, BreakdownModel
from gpumon.model.spikes import describe
from gpumon.tui.format import hanging

SPIKE_LINES = 5  # the latest spikes listed under the advice

ROLE_COLOURS = {"parameters": "blue", "gradients": "yellow", "optimizer_state": "green",
                "activations": "red", "allocator_cache": "grey50", "non_pytorch": "magenta"}
COLOURS = ROLE_COLOURS  # the earlier name
GLYPH = {"parameters": "P", "gradients": "G", "optimizer_state": "O", "activations": "A",
         "allocator_cache": "c", "non_pytorch": "n"}
LABEL = {"parameters": "parameters", "gradients": "gradients",
         "optimizer_state": "optimizer state", "activations": "activations+temps",
         "allocator_cache": "allocator cache", "non_pytorch": "non-PyTorch", "peak": "allocated (total)"}
PHASE_COLOURS = {"forward": "dodger_blue1", "backward": "dark_orange", "optimizer": "green3",
                 "eval": "medium_purple1", "other": "grey50"}
_USER_PHASE_COLOURS = ("cyan", "gold1", "hot_pink", "spring_green2", "orchid", "khaki1")
# "at end": the roles at the last phase boundary (a breakdown is taken there), which the live
# figures beside it have moved past
ROLE_COLUMNS = ("role", "at end", "at peak")
ESTIMATE_COLUMNS = ("estimate", "error")


def phase_colour(name: str | None) -> str:
    """A stable colour per phase: fixed for the automatic ones, hashed for users' marks."""
    if name is None:
        return "grey50"
    c = PHASE_COLOURS.get(name)
    if c is not None:
        return c
    h = 0
    for ch in name:  # stable across runs (str hash is salted)
        h = (h * 31 + ord(ch)) & 0xFFFFFFFF
    return _USER_PHASE_COLOURS[h % len(_USER_PHASE_COLOURS)]


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
            t.append(GLYPH[r] * n, style=f"bold {ROLE_COLOURS[r]} on {ROLE_COLOURS[r]}")
            used += n
    return t.append(" " * max(0, width - used))


def _error_cell(row) -> Text:
    if row is None:
        return Text("")
    if row.error_pct is not None:
        e = row.error_pct
        style = "green" if abs(e) <= 10 else ("yellow" if abs(e) <= 25 else "red")
        return Text(f"{e:+.1f}%", style=style)
    note = {"within the expected range": "in range", "below the expected range": "below range",
            "above the expected range": "above range"}.get(row.note, "")
    return Text(note, style="green" if note == "in range" else ("yellow" if note else "dim"))


def _estimate_cell(row) -> str:
    if row is None or row.estimate is None:
        return "-"
    if row.estimate_range:
        lo, hi = row.estimate_range
        return f"{_h(lo)}..{_h(hi)}"
    return _h(row.estimate)


_MAIN = object()  # update_model's default device: the one with the highest peak



# each phase's time in a step, by its initial: at 80 columns "data:50ms forward:400ms
# backward:350ms o" cut the optimizer's and zero_grad's times; the header says the initials
PHASE_INITIALS = {"data": "d", "forward": "f", "backward": "b", "optimizer": "o",
                  "zero_grad": "z", "eval": "e", "other": "oth"}
PHASES_HEAD = "phases (ms)"  # d data, f forward, b backward, o optimizer, z zero_grad, oth other


def phase_times(phases: dict) -> str:
    return " ".join(f"{PHASE_INITIALS.get(k, k[:3])}{v.get('time_s', 0) * 1000:.0f}"
                    for k, v in phases.items() if isinstance(v, dict))

class BreakdownView(Vertical):
    modules_key = "m"  # the live view's key that measures per module (GPUMON_KEYS may move it)

    DEFAULT_CSS = """
    BreakdownView { height: auto; }
    BreakdownView > .bars { height: auto; min-height: 3; }
    BreakdownView > DataTable { height: auto; max-height: 12; }
    BreakdownView > .advice { height: auto; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="bd-bars", classes="bars")
        yield DataTable(id="bd-roles", show_cursor=False)
        # advice before the steps, newest step first: a short pane clips the bottom, and what
        # is lost there should be the oldest steps, not the advice
        yield Static(id="bd-advice", classes="advice")
        # the last per-module measurement; hidden until one is asked for
        yield Static(id="bd-modules", classes="advice")
        yield DataTable(id="bd-steps", show_cursor=False)

    def on_mount(self) -> None:
        rt = self.query_one("#bd-roles", DataTable)
        for c in ROLE_COLUMNS:
            rt.add_column(c, key=c)
        st = self.query_one("#bd-steps", DataTable)
        self._step_col = st.add_columns("step", "time", "peak", "peak phase", PHASES_HEAD)[0]
        self._roles_rows = False
        self._estimate_cols = False
        self._steps_seen = 0
        self.update_model(BreakdownModel())

    def _set_estimate_columns(self, on: bool) -> None:
        rt = self.query_one("#bd-roles", DataTable)
        if on and not self._estimate_cols:
            for c in ESTIMATE_COLUMNS:
                rt.add_column(c, key=c, default="")
        elif not on and self._estimate_cols:
            for c in ESTIMATE_COLUMNS:
                rt.remove_column(c)
        self._estimate_cols = on

    def update_model(self, model: BreakdownModel, logits_bytes: int | None = None,
                     device: Any = _MAIN, note: str | None = None) -> None:
        """device: whose breakdown to show (an index or "cpu"; default: the device with the
        highest peak). note: one line shown first (e.g. why another device's roles are shown)."""
        d = model.main_device() if device is _MAIN else model.device(device)
        bars = self.query_one("#bd-bars", Static)
        roles_t = self.query_one("#bd-roles", DataTable)
        comp = model.estimate_comparison(None if device is _MAIN or d is None else device)
        self._set_estimate_columns(model.estimate is not None)
        est = {r.role: r for r in comp.rows} if comp is not None else {}
        head = Text(note + "\n", style="yellow") if note else Text()
        if d is None:
            bars.update(head.append(Text("breakdown: waiting for the first phase boundary",
                                         style="dim")))
        else:
            at = d.at_run_peak or d.at_peak
            scale = max(sum(v or 0 for v in (d.now or {}).values()),
                        sum(v or 0 for v in (at or {}).values()), 1)
            width = max(10, (self.size.width or 80) - 14)
            pk = ""
            if d.run_peak_phase is not None:
                pk = f"  peak {_h(d.run_peak)} in {d.run_peak_phase} (step {d.run_peak_step})"
            t = head.append("at end  ").append_text(stacked_bar(d.now, width, scale)).append("\n")
            t.append("at peak ").append_text(stacked_bar(at, width, scale)).append("\n")
            t.append(f"device {d.index}{pk}", style="bold")
            ended, step = model.breakdown_at or (None, None)
            if ended:
                t.append(f"  at end of {ended}" + (f" (step {step})" if step is not None else ""))
            if model.phase:
                t.append("  phase now: ").append(model.phase, style=phase_colour(model.phase))
            bars.update(t)
            table_rows = [(r, Text(f"{GLYPH[r]} {LABEL[r]}", style=ROLE_COLOURS[r]),
                           _h((d.now or {}).get(r)), _h(at.get(r)) if at else "-")
                          for r in ROLES]
            table_rows.append(("peak", Text("  " + LABEL["peak"], style="bold"),
                               _h(d.allocated), _h(d.run_peak)))
            for key, *cells in table_rows:
                if self._estimate_cols:
                    cells += [_estimate_cell(est.get(key)), _error_cell(est.get(key))]
                if self._roles_rows:
                    for col, v in zip(ROLE_COLUMNS + ESTIMATE_COLUMNS, cells):
                        roles_t.update_cell(key, col, v)
                else:
                    roles_t.add_row(*cells, key=key)
            self._roles_rows = True
        steps_t = self.query_one("#bd-steps", DataTable)
        new = [s for s in model.steps if s.step > self._steps_seen]
        for s in new[-20:]:
            phases = phase_times(s.phases)
            steps_t.add_row(str(s.step), f"{s.time_s * 1000:.0f} ms",
                            "-" if s.peak is None else ("" if s.peak_exact else ">= ") + _h(s.peak),
                            Text(s.peak_phase or "-", style=phase_colour(s.peak_phase)), phases)
            self._steps_seen = s.step
        while steps_t.row_count > 20:
            steps_t.remove_row(next(iter(steps_t.rows)))  # rows keep insertion order: the oldest
        if new:
            steps_t.sort(self._step_col, key=int, reverse=True)
        adv = advise(model, logits_bytes=logits_bytes)
        a = Text()
        if model.note:
            a.append(f"note: {model.note}\n", style="yellow")
        last_step = model.steps[-1] if model.steps else None
        if model.every_step and last_step is not None and not last_step.peak_exact \
                and last_step.exact_note:
            a.append(f"steps: lower bounds ({last_step.exact_note})\n", style="dim")
        for e in model.spikes()[-SPIKE_LINES:]:
            a.append("spike: ", style="bold yellow").append(describe(e) + "\n")
        worst = model.worst_steps()[:3]
        if worst:
            a.append("worst steps: ", style="bold").append("; ".join(
                f"{w['step']:,} {_h(w['peak'])}" + (f" in {w['phase']}" if w.get("exact")
                                                     and w.get("phase") else " (>=)")
                for w in worst) + "\n", style="dim")
        if model.measured_every > 1 and not model.every_step:
            # (agents before issue 35, which report measured steps only) the cadence is the
            # last measured step's; the budget stretches it, so say which was measured last
            last = model.steps[-1].step if model.steps else None
            when = (f"; the last measured: step {last} of {model.step}"
                    if last is not None and model.step is not None and model.step > last else "")
            a.append(f"steps: 1 in {model.measured_every} or fewer measured{when} (short steps: "
                     "gpumon keeps its own time under 0.1%)\n", style="dim")
        if model.estimate_error:
            a.append(f"estimate: {model.estimate_error}\n", style="yellow")
        elif comp is not None:
            a.append("estimate: ", style="bold").append(
                f"peak {_h(model.estimate.get('peak_bytes'))} predicted in "
                f"{comp.estimate_phase}; rows at the end of {comp.phase}; error = (estimate - "
                "measured) / measured\n", style="dim")
            for n in comp.notes:
                a.append(f"  {n}\n", style="dim")
        # (before its first layout the widget has no width yet: the screen's)
        width = max(20, (self.size.width or self.app.size.width or 80) - 2)
        for item in adv:  # hanging indents: a wrapped line stays under its item
            a.append(hanging(f"* {item.title}", width, "  ") + "\n", style="bold").append(
                hanging(f"  because {item.trigger}; saves {item.saving}", width, "    ") + "\n")
        self.query_one("#bd-advice", Static).update(a)
        from gpumon.tui.widgets.modules import modules_text
        mt = modules_text(model.modules, model.modules_error, model.modules_pending,
                          width, key=self.modules_key)
        box = self.query_one("#bd-modules", Static)
        box.update(mt)
        box.display = bool(mt.plain)  # nothing until a measurement is asked for
