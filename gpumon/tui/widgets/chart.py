"""A hand-rolled braille line chart (2 x 4 dots per cell), drawn with the Line API.

Why hand-rolled: plotting libraries measured 4-10x slower (../shared/DESIGN.md). The chart keeps
its rendered rows (Strips); `plot()` rebuilds them from min/max columns handed by the model
and calls refresh() without layout, and render_line() only returns a cached row. Nothing here
runs per sample: the app calls plot() on its frame timer, for the visible tab only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

from gpumon.model.series import Series
from gpumon.tui.format import axis_unit, fmt_bytes, nice_step

# dot bits of a braille cell: _BITS[x % 2][y % 4]
_BITS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
_BRAILLE = [chr(0x2800 + i) for i in range(256)]


@dataclass
class Line:
    """One series to draw: drawn in list order, later on top."""
    label: str
    series: Series
    color: str


@dataclass
class HLine:
    """A horizontal reference (capacity): dashed."""
    value: float
    label: str
    color: str


@dataclass
class VMark:
    """A vertical marker at a time (recording start/end)."""
    t: float
    char: str
    color: str


@dataclass
class ChartSpec:
    lines: list[Line]
    t_start: float
    t_end: float
    hlines: list[HLine] = field(default_factory=list)
    marks: list[VMark] = field(default_factory=list)
    peak: tuple[float, float] | None = None   # (t, value) marked with a diamond
    peak_color: str = "red"
    y_max: float | None = None                # fixed top of the y axis (capacity mode)
    legend: Sequence[tuple[str, str]] = ()    # (text, color) pieces of the first row
    empty_text: str = "waiting for samples..."
    bands: Sequence[tuple[float, float, str]] = ()  # (t0, t1, colour): phases under the x axis


class BrailleChart(Widget):
    DEFAULT_CSS = """
    BrailleChart { height: 1fr; min-height: 6; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._spec: ChartSpec | None = None
        self._strips: list[Strip] = []
        self._built_for: tuple[int, int] = (0, 0)
        self._styles: dict[str, Style] = {}
        self._plain = Style()  # never None: Textual's monochrome filter needs a style per segment
        self.frames = 0

    def plot(self, spec: ChartSpec) -> None:
        """Take new data and redraw (no layout)."""
        self._spec = spec
        self._rebuild()
        self.refresh()

    def on_resize(self) -> None:
        self._rebuild()
        self.refresh()

    def render_line(self, y: int) -> Strip:
        if y < len(self._strips):
            return self._strips[y]
        return Strip.blank(self.size.width, self._plain)

    # -- drawing -----------------------------------------------------------------------
    def _style(self, color: str, dim: bool = False, bold: bool = False) -> Style:
        key = f"{color}|{dim}|{bold}"
        st = self._styles.get(key)
        if st is None:
            st = Style.parse(color) if color else Style()
            if dim or bold:
                st = st + Style(dim=dim or None, bold=bold or None)
            self._styles[key] = st
        return st

    def _rebuild(self) -> None:
        w, h = self.size.width, self.size.height
        self._built_for = (w, h)
        spec = self._spec
        if w <= 0 or h <= 0:
            self._strips = []
            return
        if spec is None or h < 3 or w < 16:
            self._strips = [Strip([Segment((spec.empty_text if spec else "")[:w].ljust(w), self._plain)])] + \
                [Strip.blank(w, self._plain) for _ in range(h - 1)]
            return
        self.frames += 1
        rows: list[Strip] = [self._legend_row(spec, w)]
        plot_h = h - 2
        label_w = 9
        plot_w = w - label_w - 1
        px_w, px_h = plot_w * 2, plot_h * 4
        t0, t1 = spec.t_start, spec.t_end

        # the columns of every line, and the y range they need
        cols_per_line = [ln.series.columns(t0, t1, px_w) for ln in spec.lines]
        vmax = 0.0
        for cols in cols_per_line:
            for c in cols:
                if c is not None and c.hi > vmax:
                    vmax = c.hi
        if spec.peak is not None and t0 <= spec.peak[0] <= t1 and spec.peak[1] > vmax:
            vmax = spec.peak[1]   # an exact peak between samples is above every sampled point
        if spec.y_max:
            vmax = max(vmax, spec.y_max) if vmax > spec.y_max else spec.y_max
        else:
            vmax *= 1.08
        if vmax <= 0:
            vmax = 1.0
        unit, size = axis_unit(vmax)
        n_ticks = max(1, plot_h // 3)
        step = nice_step(vmax / size, n_ticks) * size
        top = step * -(-vmax // step) if not spec.y_max else vmax  # round the top up to a step
        scale = (px_h - 1) / top

        def py_of(v: float) -> int:
            p = px_h - 1 - int(v * scale + 0.5)
            return 0 if p < 0 else (px_h - 1 if p >= px_h else p)

        n_cells = plot_w * plot_h
        bits = [0] * n_cells
        owner = [-1] * n_cells
        # reference lines (dashed), under the data
        for k, hl in enumerate(spec.hlines):
            if hl.value > top * 1.0001:
                continue
            py = py_of(hl.value)
            row, dot = divmod(py, 4)
            for px in range(0, px_w, 3):
                ci = row * plot_w + (px >> 1)
                bits[ci] |= _BITS[px & 1][dot]
                owner[ci] = -2 - k
        # the lines, each column a vertical run from min to max, joined to the last column
        for li, cols in enumerate(cols_per_line):
            prev = None
            for px, c in enumerate(cols):
                if c is None:
                    continue
                a = py_of(c.hi)
                b = py_of(c.lo)
                if prev is not None:
                    if prev < a:
                        a = prev
                    elif prev > b:
                        b = prev
                prev = py_of(c.last)
                xb = _BITS[px & 1]
                cx = px >> 1
                for py in range(a, b + 1):
                    ci = (py >> 2) * plot_w + cx
                    bits[ci] |= xb[py & 3]
                    owner[ci] = li
        overrides: dict[int, tuple[str, str]] = {}
        span = t1 - t0
        for m in spec.marks:
            if span > 0 and t0 <= m.t <= t1:
                cx = min(plot_w - 1, int((m.t - t0) / span * plot_w))
                for row in range(plot_h):
                    ci = row * plot_w + cx
                    if bits[ci] == 0:
                        overrides[ci] = (m.char, m.color)
        if spec.peak is not None and span > 0:
            pt, pv = spec.peak
            if t0 <= pt <= t1 and pv <= top:
                cx = min(plot_w - 1, int((pt - t0) / span * plot_w))
                overrides[(py_of(pv) >> 2) * plot_w + cx] = ("◆", spec.peak_color)

        # y tick labels by row
        labels: dict[int, str] = {}
        v = 0.0
        while v <= top * 1.0001:
            labels[py_of(v) >> 2] = _tick(v / size, unit)
            v += step
        line_styles = [self._style(ln.color) for ln in spec.lines]
        href_styles = [self._style(hl.color, dim=True) for hl in spec.hlines]
        axis_style = self._style("", dim=True)
        ov_rows: dict[int, bool] = {}
        for ci in overrides:
            ov_rows[ci // plot_w] = True
        for row in range(plot_h):
            segs = [Segment(labels.get(row, "").rjust(label_w - 1)[: label_w - 1] + " ", axis_style),
                    Segment("┤" if row in labels else "│", axis_style)]
            base = row * plot_w
            if not ov_rows.get(row) and not any(bits[base:base + plot_w]):
                # an empty row (most rows above the data): one blank run, as the loop would give
                segs.append(Segment(" " * plot_w, self._plain))
                rows.append(Strip(segs, w))
                continue
            run_style = None
            run: list[str] = []
            for cx in range(plot_w):
                ci = base + cx
                ov = overrides.get(ci)
                if ov is not None:
                    ch, st = ov[0], self._style(ov[1], bold=True)
                else:
                    b = bits[ci]
                    o = owner[ci]
                    ch = _BRAILLE[b] if b else " "
                    st = line_styles[o] if o >= 0 else (href_styles[-2 - o] if o <= -2 else self._plain)
                if st is not run_style and run:
                    segs.append(Segment("".join(run), run_style))
                    run = []
                run_style = st
                run.append(ch)
            if run:
                segs.append(Segment("".join(run), run_style))
            rows.append(Strip(segs, w))
        rows.append(self._x_axis(spec, w, label_w, plot_w, axis_style))
        self._strips = rows

    def _legend_row(self, spec: ChartSpec, w: int) -> Strip:
        segs, used = [], 0
        items = list(spec.legend)
        for i, (text, color) in enumerate(items):
            need = len(text)
            if len(text.strip()) == 1 and i + 1 < len(items):  # a line's glyph: with its name
                need += len(items[i + 1][0].rstrip())
            if used + need > w:
                break
            segs.append(Segment(text, self._style(color) if color else self._plain))
            used += len(text)
        if used < w:
            segs.append(Segment(" " * (w - used), self._plain))
        return Strip(segs, w)

    def _x_axis(self, spec: ChartSpec, w: int, label_w: int, plot_w: int, st: Style) -> Strip:
        span = spec.t_end - spec.t_start
        line = [" "] * w
        line[label_w] = "└"
        if span > 0 and plot_w > 4:
            step = _time_step(span, max(1, plot_w // 12))
            k = 0
            while True:
                ago = k * step
                if ago > span:
                    break
                x = label_w + 1 + int((span - ago) / span * (plot_w - 1))
                text = "now" if k == 0 else "-" + _fmt_ago(ago)
                start = min(max(label_w + 1, x - len(text) + 1 if k == 0 else x - len(text) // 2),
                            w - len(text))
                if all(c == " " for c in line[max(label_w + 1, start - 1): start + len(text) + 1]):
                    line[start: start + len(text)] = list(text)
                k += 1
        if not spec.bands or span <= 0:
            return Strip([Segment("".join(line), st)], w)
        # colour the time axis by phase: each column takes the colour of the phase it falls in
        colours: list[str | None] = [None] * w
        for a, b, colour in spec.bands:
            x0 = label_w + 1 + int((a - spec.t_start) / span * (plot_w - 1))
            x1 = label_w + 1 + int((b - spec.t_start) / span * (plot_w - 1))
            for x in range(max(label_w + 1, x0), min(w, x1 + 1)):
                colours[x] = colour
        segs = []
        for x, ch in enumerate(line):
            c = colours[x]
            if c is None or ch != " ":  # a label (-30s, now) keeps one colour, read as one word
                segs.append(Segment(ch, st))
            else:
                segs.append(Segment(ch if ch != " " else "▔", self._style(c)))
        return Strip(Segment.simplify(segs), w)


def _tick(v: float, unit: str) -> str:
    if v == 0:
        return "0"
    s = f"{v:.0f}" if v >= 10 or v == int(v) else f"{v:.1f}" if v >= 1 else f"{v:.2f}"
    return f"{s} {unit}"


def _time_step(span: float, n: int) -> float:
    raw = span / n
    for s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600,
              43200, 86400):
        if s >= raw:
            return s
    return 86400 * (int(raw // 86400) + 1)


def _fmt_ago(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m" if s % 60 == 0 else f"{s // 60}m{s % 60}s"
    return f"{s // 3600}h" if s % 3600 == 0 else f"{s // 3600}h{(s % 3600) // 60}m"


__all__ = ["BrailleChart", "ChartSpec", "Line", "HLine", "VMark", "fmt_bytes"]
