"""The timeline chart of `gpumon view`: allocated bytes over the trace's events, drawn with
eighth-block characters (readable in monochrome and over slow links), the reserved bytes as a
line of ─ above them, a cursor column, the peak and the optimizer-step boundaries. It only renders what the DeviceTrace hands it."""
from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from gpumon.snapshot.analysis import DeviceTrace

from .frame import (AXIS_W, CATEGORY_RGB, chart_rows, default_show_reserved, nav_cursor,
                    nav_events_per_col, nav_zoom)

_STYLES = {**{"cat:" + k: Style(color="#%02x%02x%02x" % v) for k, v in CATEGORY_RGB.items()},
           "bar": Style(color="cyan"), "res": Style(color="yellow"),
           "peak": Style(color="red", bold=True), "cur": Style(reverse=True),
           "curmark": Style(bold=True), "mark": Style(color="green"),
           "phase": Style(dim=True)}


class TimelineChart(Widget, can_focus=True):
    DEFAULT_CSS = """
    TimelineChart { height: 1fr; min-height: 6; }
    """

    def __init__(self, trace: DeviceTrace, steps: list[tuple[int, str]], oom_event: int = -1,
                 phases=None, **kw):
        super().__init__(**kw)
        self.phases = phases or []
        self.trace = trace
        self.steps = steps
        self.oom_event = oom_event
        self.show_reserved = default_show_reserved(trace)
        n = max(1, trace.n)
        self.lo, self.hi = 0, n          # visible window of events [lo, hi)
        self.cursor = trace.peak_index if trace.peak_index >= 0 else 0

    # -- geometry --------------------------------------------------------------------------
    @property
    def plot_cols(self) -> int:
        return max(1, self.size.width - AXIS_W)

    def col_of(self, event: int) -> int:
        span = max(1, self.hi - self.lo)
        return (event - self.lo) * self.plot_cols // span

    def event_of(self, col: int) -> int:
        span = max(1, self.hi - self.lo)
        return min(self.hi - 1, self.lo + span * col // self.plot_cols)

    def events_per_col(self) -> int:
        return nav_events_per_col(self.lo, self.hi, self.plot_cols)

    # -- navigation (called by the screen) -------------------------------------------------
    def set_cursor(self, event: int):
        self.cursor, self.lo, self.hi = nav_cursor(self.trace.n, self.lo, self.hi, event)
        self.refresh()

    def move_cols(self, k: int):
        self.set_cursor(self.cursor + k * self.events_per_col())

    def zoom(self, factor: float):
        self.lo, self.hi = nav_zoom(self.trace.n, self.lo, self.hi, self.cursor, factor)
        self.refresh()

    # -- drawing ---------------------------------------------------------------------------
    def render(self) -> Text:
        tr = self.trace
        rows = chart_rows(tr, self.lo, self.hi, self.cursor, self.steps, self.oom_event,
                          self.show_reserved, self.size.width, self.size.height, self.phases)
        out = Text(no_wrap=True, overflow="crop")
        for k, line in enumerate(rows):
            if k:
                out.append("\n")
            for text, st in line:
                out.append(text, _STYLES.get(st) or (_STYLES["cat:unknown"]
                                                     if st.startswith("cat:") else None))
        return out
