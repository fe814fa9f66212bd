"""Text panels of the live view. Each keeps a fixed size (set in attach.tcss) and is redrawn
with refresh() (no layout) when the app's frame timer hands it a model."""
from __future__ import annotations
import functools

from typing import Callable

from rich.console import Group
from rich.table import Table
from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from gpumon.model.process import DeviceModel, ProcessModel, State, imbalance
from gpumon.tui.format import (fmt_bytes, fmt_clock, fmt_count_short, fmt_duration, fmt_ms,
                               fmt_us)

STATE_STYLE = {State.RUNNING: "bold green", State.CONNECTING: "yellow",
               State.WAITING: "yellow", State.NO_AGENT: "magenta",
               State.EXITED: "bold red", State.UNREACHABLE: "bold yellow"}
STATE_MARK = {State.RUNNING: "●", State.CONNECTING: "○", State.WAITING: "◌",
              State.NO_AGENT: "○", State.EXITED: "✗", State.UNREACHABLE: "?"}


def state_text(p: ProcessModel, now: float) -> Text:
    t = Text()
    t.append(f"{STATE_MARK[p.state]} {p.state.value}", STATE_STYLE[p.state])
    if p.state_detail:
        t.append(f" ({p.state_detail})", STATE_STYLE[p.state])
    if p.state in (State.EXITED, State.UNREACHABLE) and p.state_since:
        t.append(f" at {fmt_clock(p.state_since)}")
    return t


def recording_text(p: ProcessModel, now: float, me: str) -> Text | None:
    rec = p.recording
    if not rec.active:
        return None
    who = "you" if rec.by == me else (rec.who or rec.by or "another client")
    t = Text()
    t.append(" ● REC ", "bold white on red")
    t.append(f" {fmt_duration(now - rec.since) if rec.since else ''} by {who}", "red")
    if rec.by != me and rec.since:
        t.append(f" since {fmt_clock(rec.since)}", "red")
    return t


class ProcessHeader(Widget):
    """Two lines: who the process is; its state, device, uptime, source, recording."""

    DEFAULT_CSS = "ProcessHeader { height: 2; }"

    def __init__(self, proc: ProcessModel, dev_index: int | None, me: str,
                 clock: Callable[[], float], **kw) -> None:
        super().__init__(**kw)
        self.proc, self.dev_index, self.me, self.clock = proc, dev_index, me, clock
        self._text: Text | None = None

    def update_if_changed(self) -> bool:
        """Rebuild the text; refresh (no layout) only when it differs from what is shown."""
        t = self._build()
        if self._text is not None and t == self._text:
            return False
        self._text = t
        self.refresh()
        return True

    def render(self) -> Text:
        if self._text is None:
            self._text = self._build()
        return self._text

    def _build(self) -> Text:
        p, now = self.proc, self.clock()
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f"pid {p.pid}", "bold")
        if p.rank is not None:
            t.append(f"  rank {p.rank}/{p.world_size if p.world_size is not None else '?'}",
                     "bold")
            if p.hello.get("local_rank") is not None:
                t.append(f" (local {p.hello.get('local_rank')})")
        host = p.hello.get("hostname")
        if host:
            t.append(f"  {host}", "dim")
        t.append("  ")
        t.append(p.command_line, "italic")
        t.append("\n")
        t.append_text(state_text(p, now))
        start = p.hello.get("start_time")
        if start and p.alive:
            t.append(f"  up {fmt_duration(now - start)}")
        elif start and p.state_since:
            t.append(f"  ran {fmt_duration(p.state_since - start)}")
        # narrow (80 columns): what changes first (a recording, the source), the device's
        # long name last, so the end of the line that does not fit is the least needed
        narrow = 0 < self.size.width < 100
        rec = recording_text(p, now, self.me)
        if narrow and rec is not None:
            t.append("  ")
            t.append_text(rec)
        src = p.source
        if narrow:
            t.append("  ")
            t.append(src, "bold magenta" if src == "simulated" else "bold cyan")
        dev = p.devices.get(self.dev_index) if self.dev_index is not None else None
        if dev is not None:
            # recording at 80 columns: the name goes (it was cut mid-word; the tab and the
            # figures' panel say the device), the line fits whole
            name = "" if narrow and rec is not None else f" {dev.name}"
            t.append(f"  cuda:{dev.index}{name}", "bold")
            if dev.total:
                t.append(f" {fmt_bytes(dev.total)}")
        if not narrow:
            t.append("  source: ")
            t.append(src, "bold magenta" if src == "simulated" else "bold cyan")
            if rec is not None:
                t.append("  ")
                t.append_text(rec)
        return t


# labels longer than the narrow label column (12), abbreviated rather than cut
SHORT_LABELS = {"inactive split": "inact. split", "alloc retries": "alloc retry"}


def _row_(table: list, label: str, now: str, peak: str = "", style: str = "",
         narrow: bool = False) -> None:
    if narrow:
        label = SHORT_LABELS.get(label, label)
    table.append((Text(label, "dim" if not style else style), Text(now, style),
                  Text(peak, style)))


class _Cached(Widget):
    """A panel whose content is a comparable value built by `_content()`: update_if_changed()
    rebuilds that value each frame (cheap) and refreshes (no layout) only when it differs, so
    Rich renders it, and Textual recomposites it, only when what it shows changes."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._shown = None

    def _content(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def update_if_changed(self) -> bool:
        c = (self.content_size.width, self._content())
        if c == self._shown:
            return False
        self._shown = c
        self.refresh()
        return True

    def render(self):
        c = (self.content_size.width, self._content())
        self._shown = c
        return self._render_content_of(c[1])


class FiguresPanel(_Cached):
    """The figures of one device of one process, now and at peak."""

    DEFAULT_CSS = "FiguresPanel { width: 40; }"

    def __init__(self, proc: ProcessModel, dev_index: int, clock: Callable[[], float],
                 **kw) -> None:
        super().__init__(**kw)
        self.proc, self.dev_index, self.clock = proc, dev_index, clock

    def _render_content_of(self, content):
        return _FastGrid(self, content)

    def _rich_grid(self, content, avail: int):
        rows, extra = content
        table = Table.grid(padding=(0, 1))
        label_w = 14 if avail >= 38 else 12
        table.add_column(no_wrap=True, width=label_w, overflow="ellipsis")
        table.add_column(justify="right", no_wrap=True, width=10)
        table.add_column(justify="right", no_wrap=True, width=max(8, avail - label_w - 12),
                         overflow="ellipsis")
        for r in rows:
            table.add_row(*r)
        if not extra:
            return table
        extra = [t.copy() for t in extra]
        for t in extra:
            t.overflow = "fold"
        return Group(table, *extra)

    def _content(self):
        p = self.proc
        d: DeviceModel | None = p.devices.get(self.dev_index)
        table: list = []
        extra: list[Text] = []
        if d is None or not d.latest:
            table.append(("no samples yet", "", ""))
            return tuple(table), ()
        narrow = max(24, self.content_size.width or 40) < 38  # _FastGrid's 12-column labels
        _row = functools.partial(_row_, narrow=narrow)
        table.append((Text(""), Text("now", "bold"), Text("peak", "bold")))
        _row(table, "allocated", fmt_bytes(d.get("allocated")), fmt_bytes(d.peak_allocated),
             "green")
        _row(table, "reserved", fmt_bytes(d.get("reserved")), fmt_bytes(d.peak_reserved),
             "yellow")
        _row(table, "active", fmt_bytes(d.get("active")), fmt_bytes(d.get("peak_active")), "cyan")
        _row(table, "res - alloc", fmt_bytes(d.gap()))
        _row(table, "inactive split", fmt_bytes(d.get("inactive_split")))
        _row(table, "NVML process", fmt_bytes(d.get("proc_used")), "", "magenta")
        _row(table, "non-PyTorch", fmt_bytes(d.non_pytorch()))
        total = d.get("nvml_total") or d.total
        used = d.get("nvml_used")
        _row(table, "device used", fmt_bytes(used), ("/" if narrow else "of ") + fmt_bytes(total))
        _row(table, "device free", fmt_bytes(d.free()))
        retries, ooms = d.get("alloc_retries"), d.get("ooms")
        hot = lambda rose: rose is not None and p.last_t is not None and p.last_t - rose < 60  # noqa: E731
        r_style = "bold white on red" if hot(d.retries_rose_t) else ("bold red" if retries else "")
        o_style = "bold white on red" if hot(d.ooms_rose_t) else ("bold red" if ooms else "")
        table.append((Text(SHORT_LABELS["alloc retries"] if narrow else "alloc retries", "dim"), Text(_n(retries), r_style),
                      Text(f"OOMs {_n(ooms)}", o_style)))
        _row(table, "segments", _n(d.get("segments")))
        _row(table, "cudaMalloc", _n(d.get("device_alloc")), f"free {fmt_count_short(d.get('device_free'))}")
        alloc = p.hello.get("allocator") or {}
        backend = alloc.get("backend") or "?"
        exp = alloc.get("expandable_segments")
        exp_s = "expandable" if exp else ("exp. off" if exp is not None else "")
        _row(table, "allocator", backend, exp_s)
        conf = alloc.get("conf")
        if conf:
            extra.append(Text.assemble(("conf ", "dim"), str(conf)))
        rate = p.hello.get("rate_hz")
        _row(table, "sample rate", f"{rate:g} Hz" if rate else "n/a",
             f"cost {fmt_us(p.cost_us)}")
        _row(table, "delay", fmt_ms(p.delay_s), f"{p.samples:,} smp")
        if p.step is not None or p.phase:
            _row(table, "step", _n(p.step), p.phase or "")
        if p.recording.last_path:
            extra.append(Text.assemble(("snapshot ", "dim"), p.recording.last_path))
        if p.hello.get("nvml"):
            extra.append(Text.assemble(("NVML: ", "dim"), (str(p.hello["nvml"]), "yellow")))
        return tuple(table), tuple(extra)


def _n(v) -> str:
    return "n/a" if v is None else f"{v:,}"


class OverviewTable(_Cached):
    """Every (process, device) side by side, with an imbalance line."""

    DEFAULT_CSS = "OverviewTable { height: auto; }"

    def __init__(self, rows_fn: Callable[[], list[tuple[ProcessModel, int]]],
                 clock: Callable[[], float], colors: list[str], **kw) -> None:
        super().__init__(**kw)
        self.rows_fn, self.clock, self.rank_colors = rows_fn, clock, colors

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(self.rows_fn()) + 3

    def _content(self):
        rows = self.rows_fn()
        cells = []
        devs = []
        hosts = any(p.host for p, _ in rows)  # ranks of several nodes: a host column
        for i, (p, idx) in enumerate(rows):
            d = p.devices.get(idx)
            if d is None:
                continue
            label = f"{p.label}"
            devs.append((f"{label}{' on ' + p.host if p.host else ''} cuda:{idx}", d))
            total = d.get("nvml_total") or d.total
            retries = d.get("alloc_retries")
            cells.append({
                "mark": Text("■", self.rank_colors[i % len(self.rank_colors)]),
                "process": Text(label, "bold"), "host": p.host or "", "dev": f"cuda:{idx}",
                "state": Text(f"{STATE_MARK[p.state]} {p.state.value}", STATE_STYLE[p.state]),
                "state_mark": Text(STATE_MARK[p.state], STATE_STYLE[p.state]),
                "allocated": fmt_bytes(d.get("allocated")),
                "reserved": fmt_bytes(d.get("reserved")),
                "peak": fmt_bytes(d.peak_allocated), "non_pytorch": fmt_bytes(d.non_pytorch()),
                "retries": Text(_n(retries), "bold red" if retries else ""),
                "bar": _bar(d.get("allocated"), d.get("reserved"), total, 20)})
        cols = self._fit([c for c in self.ALL_COLUMNS if hosts or c[2] != "host"], cells,
                         self.content_size.width)
        self.COLUMNS = tuple((name, just) for name, just, _ in cols)
        out = tuple(tuple(r[k] for _, _, k in cols) for r in cells)
        caption = None
        imb = imbalance(devs)
        if imb is not None and imb.low > 0:
            spread = imb.spread
            style = "bold red" if spread > 0.10 else "green"
            # the spread first: at 80 columns the tail of the line may be cut
            msg = (f"imbalance {spread:+.0%}: peak allocated {imb.high_label} "
                   f"{fmt_bytes(imb.high)} vs {imb.low_label} {fmt_bytes(imb.low)}")
            if spread <= 0.10:
                msg = f"balanced: peak allocated within {spread:.0%} across {len(devs)} devices"
            caption = Text(msg, style)
        return out, caption

    # (header, justification, cell key); the last, the capacity bar, takes what is left
    ALL_COLUMNS = (("", "left", "mark"), ("process", "left", "process"),
                   ("host", "left", "host"), ("dev", "left", "dev"),
                   ("state", "left", "state"), ("allocated", "right", "allocated"),
                   ("reserved", "right", "reserved"), ("peak alloc", "right", "peak"),
                   ("non-PyTorch", "right", "non_pytorch"), ("retries", "right", "retries"),
                   ("of capacity", "left", "bar"))
    SHORT_HEADERS = {"allocated": "alloc", "peak alloc": "peak", "non-PyTorch": "non-PT",
                     "retries": "retry"}

    @classmethod
    def _fit(cls, cols, cells, width: int):
        """The columns shown at this width: every one where they fit; on a narrower terminal
        (80 columns with a host column), rather than every cell cut to "ho…" and "2.7 G…",
        whole figures: first the capacity bar goes, then the state is its mark alone, then
        shorter headers, then non-PyTorch, retries, dev (each rank's tab has them all)."""
        def need(cs):  # each column's widest cell or header, one space either side
            return sum(2 + max([len(name)] + [Text(r[k]).cell_len if isinstance(r[k], str)
                                               else r[k].cell_len for r in cells])
                       for name, _, k in cs)
        steps = [
            lambda cs: [c for c in cs if c[2] != "bar"],
            lambda cs: [("", "left", "state_mark") if c[2] == "state" else c for c in cs],
            lambda cs: [(cls.SHORT_HEADERS.get(c[0], c[0]),) + tuple(c[1:]) for c in cs],
            lambda cs: [c for c in cs if c[2] != "non_pytorch"],
            lambda cs: [c for c in cs if c[2] != "retries"],
            lambda cs: [c for c in cs if c[2] != "dev"],
        ]
        if width <= 0:
            return cols
        for step in steps:
            if need(cols) <= width:
                return cols
            cols = step(cols)
        return cols

    COLUMNS = tuple((name, just) for name, just, key in ALL_COLUMNS if key != "host")
    HOST_COLUMNS = tuple((name, just) for name, just, _ in ALL_COLUMNS)

    def _rich_table(self, rows, caption) -> Table:
        table = Table(box=None, padding=(0, 1), expand=True, show_edge=False)
        for name, just in self.COLUMNS:
            table.add_column(name, justify=just, no_wrap=True,
                             ratio=1 if name == "of capacity" else None)
        for r in rows:
            table.add_row(*r)
        if caption is not None:
            table.caption = caption
            table.caption_justify = "left"
        return table

    def _render_content_of(self, content):
        rows, caption = content
        return _FastTable(self, rows, caption)


class _FastGrid:
    """FiguresPanel's grid (three fixed-width columns, one space apart) padded and justified
    here instead of by Rich's table each frame; Rich draws it when a cell does not fit."""

    def __init__(self, owner: "FiguresPanel", content) -> None:
        self.owner, self.content = owner, content

    def __rich_console__(self, console, options):
        owner = self.owner
        avail = max(24, owner.content_size.width or 40)
        rows, extra = self.content
        label_w = 14 if avail >= 38 else 12
        widths = (label_w, 10, max(8, avail - label_w - 12))
        texts = [[c if isinstance(c, Text) else Text(c) for c in r] for r in rows]
        if any(t.cell_len > w for r in texts for t, w in zip(r, widths)) \
                or options.max_width < sum(widths) + 2:
            yield owner._rich_grid(self.content, avail)
            return
        from rich.segment import Segment
        gap = Segment(" ", Style.null())
        new_line = Segment.line()
        for r in texts:
            for k, (t, w, just) in enumerate(zip(r, widths, ("left", "right", "right"))):
                if k:
                    yield gap
                yield from _aligned(t, just, w, console, None)
            yield new_line
        for t in extra:
            t = t.copy()
            t.overflow = "fold"
            yield from console.render(t, options)


class _FastTable:
    """The overview's Rich table, drawn without Rich's per-frame measuring: the column widths
    come from Rich (Table._calculate_column_widths) and are cached for as long as every cell's
    width stays the same; the cells are then padded and justified here, segment for segment
    as Rich lays them out (tests/tui/test_app.py compares the two). Falls back to Rich itself
    when a cell does not fit its column (narrow terminals), where Rich would crop."""

    def __init__(self, owner: "OverviewTable", rows, caption) -> None:
        self.owner, self.rows, self.caption = owner, rows, caption

    def __rich_console__(self, console, options):
        from rich.segment import Segment
        owner, rows = self.owner, self.rows
        width = options.max_width
        texts = [[c if isinstance(c, Text) else Text(c) for c in r] for r in rows]
        lens = tuple(max([len(name)] + [t.cell_len for t in (r[i] for r in texts)])
                     for i, (name, _) in enumerate(owner.COLUMNS))
        key = (width, lens, owner.COLUMNS)
        cache = getattr(owner, "_widths_cache", None)
        if cache is None or cache[0] != key:
            table = owner._rich_table(rows, None)
            cache = owner._widths_cache = (key, table._calculate_column_widths(
                console, options.update_width(width)))
        widths = cache[1]
        if any(n > w - 2 for n, w in zip(lens, widths)):
            yield owner._rich_table(rows, self.caption)
            return
        null = Style.null()
        header = console.get_style("table.header")
        pad = Segment(" ", null)
        new_line = Segment.line()
        segs = []
        for (name, just), w in zip(owner.COLUMNS, widths):
            segs.append(Segment(" ", header))
            segs.extend(_aligned(Text(name), just, w - 2, console, header))
            segs.append(Segment(" ", header))
        yield from segs
        yield new_line
        for r in texts:
            for (name, just), w, t in zip(owner.COLUMNS, widths, r):
                yield pad
                yield from _aligned(t, just, w - 2, console, None)
                yield pad
            yield new_line
        if self.caption is not None:
            yield from console.render(self.caption, options.update(
                width=sum(widths), highlight=False, height=None, justify="left"))


def _aligned(t: Text, just: str, w: int, console, style):
    t = t.copy()
    if style is not None:
        t.style = style
    t.align(just, w)
    if t.style:  # Text.render leaves the base style out when there are no spans
        t.stylize_before(t.style)
    return t.render(console, end="")


def _bar(alloc, reserved, total, width: int) -> Text:
    """allocated (#) and the reserved cache (+) as a share of the device."""
    t = Text()
    if not total or alloc is None:
        return Text("n/a", "dim")
    width = max(width, 4)
    a = min(width, int(round(alloc / total * width)))
    r = min(width - a, int(round(max(0, (reserved or 0) - alloc) / total * width)))
    t.append("█" * a, "green")
    t.append("▒" * r, "yellow")
    t.append("·" * (width - a - r), "dim")
    t.append(f" {alloc / total:.0%}")
    return t
