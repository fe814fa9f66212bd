"""The timeline chart of `gpumon view`: allocated bytes over the trace's events, drawn with
eighth-block characters (readable in monochrome and over slow links), the reserved bytes as a
line of ─ above them, a cursor column, the peak and the optimizer-step boundaries. It only renders what the DeviceTrace hands it."""
from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from gpumon.snapshot.analysis import DeviceTrace, fmt_bytes

_EIGHTHS = " ▁▂▃▄▅▆▇█"
AXIS_W = 13


class TimelineChart(Widget, can_focus=True):
    DEFAULT_CSS = """
    TimelineChart { height: 1fr; min-height: 6; }
    """

    def __init__(self, trace: DeviceTrace, steps: list[tuple[int, str]], oom_event: int = -1,
                 **kw):
        super().__init__(**kw)
        self.trace = trace
        self.steps = steps
        self.oom_event = oom_event
        self.show_reserved = True
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
        return max(1, (self.hi - self.lo) // self.plot_cols)

    # -- navigation (called by the screen) -------------------------------------------------
    def set_cursor(self, event: int):
        n = max(1, self.trace.n)
        self.cursor = max(0, min(n - 1, event))
        if not self.lo <= self.cursor < self.hi:
            span = self.hi - self.lo
            self.lo = max(0, min(n - span, self.cursor - span // 2))
            self.hi = self.lo + span
        self.refresh()

    def move_cols(self, k: int):
        self.set_cursor(self.cursor + k * self.events_per_col())

    def zoom(self, factor: float):
        n = max(1, self.trace.n)
        span = max(8, min(n, int((self.hi - self.lo) * factor)))
        self.lo = max(0, min(n - span, self.cursor - span // 2))
        self.hi = min(n, self.lo + span)
        self.refresh()

    # -- drawing ---------------------------------------------------------------------------
    def render(self) -> Text:
        w, h = self.size.width, self.size.height
        tr = self.trace
        cols = self.plot_cols
        rows = max(1, h - 2)  # last two rows: markers and the axis
        dec = tr.decimate(self.lo, self.hi, cols) if tr.n else []
        rdec = tr.decimate_series(tr.reserved, self.lo, self.hi, cols) \
            if tr.n and self.show_reserved else []
        top = max([mx for _, mx in dec] + [mx for _, mx in rdec] + [tr.peak, 1])
        cur_col = self.col_of(self.cursor) if tr.n else -1
        peak_col = self.col_of(tr.peak_index) if self.lo <= tr.peak_index < self.hi else -1
        oom_col = self.col_of(self.oom_event) if self.lo <= self.oom_event < self.hi else -1
        bar = Style(color="cyan")
        res_style = Style(color="yellow")
        peak_style = Style(color="red", bold=True)
        cur_style = Style(reverse=True)
        out = Text(no_wrap=True, overflow="crop")
        heights = [mx * rows * 8 / top for _, mx in dec]
        # the reserved line: the row whose band holds each column's reserved maximum
        res_row = [rows - 1 - min(rows - 1, int(mx * rows / top)) for _, mx in rdec]
        for r in range(rows):
            level_lo = (rows - 1 - r) * 8
            if r == 0:
                label = fmt_bytes(top)
            elif r == rows - 1:
                label = "0"
            elif r == rows // 2:
                label = fmt_bytes(top / 2)
            else:
                label = ""
            label = label[:AXIS_W - 2]
            out.append(f"{label:>{AXIS_W - 2}} ┤" if label else " " * (AXIS_W - 1) + "│")
            cells = []
            for c in range(cols):
                if c < len(heights):
                    v = heights[c] - level_lo
                    ch = _EIGHTHS[8] if v >= 8 else _EIGHTHS[max(0, int(v))]
                else:
                    ch = " "
                st = bar
                if c < len(res_row) and res_row[c] == r and ch != _EIGHTHS[8]:
                    ch, st = "─", res_style
                if c == cur_col:
                    ch, st = (ch if ch != " " else "│"), cur_style
                elif c == peak_col:
                    ch, st = (ch if ch != " " else "┊"), peak_style
                cells.append((ch, st))
            # one span per run of one style
            k = 0
            while k < len(cells):
                st = cells[k][1]
                e = k
                while e < len(cells) and cells[e][1] is st:
                    e += 1
                out.append("".join(ch for ch, _ in cells[k:e]), st)
                k = e
            out.append("\n")
        # markers: steps (|), peak (^), OOM (X), cursor (▲)
        marks = [" "] * cols
        for e, _ in self.steps:
            if self.lo <= e < self.hi:
                c = self.col_of(e)
                if 0 <= c < cols:
                    marks[c] = "|"
        if 0 <= peak_col < cols:
            marks[peak_col] = "^"
        if 0 <= oom_col < cols:
            marks[oom_col] = "X"
        if 0 <= cur_col < cols:
            marks[cur_col] = "▲"
        out.append(" " * (AXIS_W - 1) + "└")
        for ch in marks:
            out.append(ch, peak_style if ch in "^X" else (Style(bold=True) if ch == "▲" else
                                                           Style(color="green")))
        out.append("\n")
        left = f"event {self.lo:,}"
        right = f"{max(self.lo, self.hi - 1):,}  ({self.events_per_col():,} events/col)"
        gap = max(1, w - AXIS_W - len(left) - len(right))
        out.append(" " * AXIS_W + left + " " * gap + right)
        return out
