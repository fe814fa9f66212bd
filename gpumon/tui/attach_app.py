"""`gpumon attach`: the live dashboard.

Data flow: the client's target (gpumon/client: discovery, connections, NVML, each process's
state) queues tagged messages in a subscription; a single frame timer (at --fps) drains it into
one model per process (gpumon/model/process.py) and redraws only the visible tab. This module
only renders what the target says. Samples are never dropped while paused or hidden: pausing freezes the
time window, hiding skips the drawing.

Layout: a top bar; a TabbedContent with an Overview tab (once there are two or more
process/device panes) and one DevicePane per (process, device); the footer.
A DevicePane is: ProcessHeader / Horizontal#body(BrailleChart, FiguresPanel) / Vertical.extras
(empty: the place for more panes, e.g. the breakdown-by-role widget; see DevicePane.extras).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Iterable

from rich.text import Text
from textual import work
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.css.query import NoMatches
from textual.widgets import Footer, LoadingIndicator, Static, TabbedContent, TabPane

from gpumon.client.target import NO_CUDA_YET
from gpumon.model.process import ProcessModel, State
from gpumon.tui.footer import FittingFooter
from gpumon.interrupt import INTERRUPTED
from gpumon.tui.keys import (HELP_KEYS, HelpScreen, InterruptibleApp, apply_env_keymap,
                              help_lines, live_keys, raise_if_interrupted)
from gpumon.tui.format import fmt_bytes, fmt_clock, fmt_duration, fmt_window
from gpumon.tui.widgets.chart import BrailleChart, ChartSpec, HLine, Line, VMark
from gpumon.tui.widgets.panels import FiguresPanel, OverviewTable, ProcessHeader

ZOOMS: tuple[float | None, ...] = (30, 60, 120, 300, 600, 1800, 3600, None)  # None: whole run
DEFAULT_ZOOM = 1
SERIES_COLORS = {"nvml": "magenta", "reserved": "yellow", "allocated": "green", "active": "cyan"}
SERIES_LABELS = {"nvml": "NVML proc", "reserved": "reserved", "allocated": "allocated",
                 "active": "active"}
RANK_COLORS = ["green", "yellow", "cyan", "magenta", "blue", "red", "bright_green",
               "bright_yellow"]
SHORT_ROWS = 40  # fewer rows: the breakdown (`b`) takes the chart's place instead of sharing it
STOP_TIMEOUT_S = 600.0  # snapshot_stop symbolises C++ stacks: the first dump can take minutes
NO_SNAPSHOT = ("snapshots are not available in this agent (it has no snapshot_start command: "
               "the snapshot feature is missing or the agent is older)")


def _named(proc: ProcessModel) -> str:
    """A process in a message: its rank, and its node where it is on another one (a snapshot's
    path is that node's)."""
    return f"{proc.host} {proc.label}" if proc.host else proc.label


def _pane_id(key: str, dev: int) -> str:
    return "p-" + "".join(c if c.isalnum() else "_" for c in key) + f"-d{dev}"


DEMO_STARTING = ("gpumon demo: starting a small training run; it builds its model (~3 s), "
                 "then the figures come")
# the agent's commands as a person reads them in a failure's notification
COMMAND_WORDS = {"modules_measure": "the per-module measurement",
                 "snapshot_start": "the snapshot", "snapshot_stop": "the snapshot",
                 "reset_peaks": "the peak reset", "phases_breakdown": "the breakdown"}
# client states (gpumon.client) said in the notice line, and those of processes not shown
NOTICE_STATES = ("waiting", "no_agent", "not_python", "unreachable", "connecting", "ended")
HIDDEN_STATES = ("launcher", "helper")
NOTICE_ROWS = 3  # the notice box's height at most (attach.tcss): the rest is "+N more"
NARROW = 110     # columns below which the layout is compact (tabs, legend, footer)

# what each binding does, by binding id: the help screen and the palette are built from these
# and from the live bindings (so a key remapped with GPUMON_KEYS is shown as remapped)
KEY_HELP = {
    "snapshot": "start / stop a snapshot recording",
    "modules": "measure the next step per module",
    "reset_peaks": "reset the peaks (torch's and the chart's)",
    "pause": "pause / resume the scrolling",
    "zoom_in": "shorter time window (30 s)",
    "zoom_out": "longer time window (whole run)",
    "breakdown": "breakdown by role, steps, advice",
    "y_scale": "y axis: the data / the capacity",
    "next_tab": "next device or process",
    "prev_tab": "previous device or process",
    "bd_down": "scroll the breakdown down (when it does not fit)",
    "bd_up": "scroll the breakdown up",
    "notices": "every reason a process or node shows no figures",
    "help": "this help",
    "quit": "quit",
}
PALETTE_TITLES = {
    "snapshot": "Snapshot: start / stop recording", "reset_peaks": "Reset peaks",
    "modules": "Modules: measure the next step per module",
    "pause": "Pause / resume", "zoom_in": "Zoom in", "zoom_out": "Zoom out",
    "breakdown": "Breakdown by role", "y_scale": "Toggle y scale", "next_tab": "Next tab",
    "prev_tab": "Previous tab", "notices": "Every notice", "help": "Help",
}

HELP_HEAD = "[b]gpumon {command}: keys[/b] (binding ids in brackets)"
HELP_EXTRA = (("ctrl+p", "command palette"),
              ("ctrl+c", "quit (status 130); a recording you started is saved first"))
HELP_TAIL = """Remap keys with GPUMON_KEYS, e.g. GPUMON_KEYS="snapshot=S,quit=x".

[b]The chart[/b]
  the time axis is coloured by training phase (forward, backward,
  optimizer, ...) when the agent tracks phases; its labels keep one colour
  ◆ peak of allocated in the window; dashed: the device's capacity
  ┃ recording started   ┆ recording stopped   ! out of memory

[b]The steps[/b] (under b)
  phases (ms)   each phase's time: d data, f forward, b backward,
                o optimizer, z zero_grad, oth other (e eval); a phase
                of your own (gpumon.phase) by its first three letters
  peak          the step's exact peak; ">= x": a lower bound, its phase
                unknown; "-": no allocator figures (a CPU run)

[b]The figures[/b]
  [green]allocated[/]     bytes in live tensors (torch.cuda.memory_allocated)
  [yellow]reserved[/]      what the caching allocator holds from CUDA:
                allocated + its cache
  [cyan]active[/]        allocated plus blocks freed but still in use by a stream
  res - alloc   the allocator's cache: reusable, or fragmented into pieces
                too small
  inactive split (inact. split)  free pieces of split blocks:
                fragmentation that can't serve big requests
  [magenta]NVML process[/]  what the driver says this process uses: more than
                reserved, as it counts the CUDA context, cuBLAS/cuDNN
                workspaces and NCCL buffers
  non-PyTorch   NVML process - reserved: memory PyTorch does not manage
  device used / free  the whole GPU, every process on it
  alloc retries (alloc retry)  cudaMalloc failed and the allocator freed
                its cache to retry: a silent slowdown, the sign you are
                near the limit (highlighted when it rises)
  OOMs          out-of-memory errors raised so far
  delay         from the agent taking a sample to this client receiving it

Press escape to close."""


class DevicePane(Vertical):
    """One device of one process. `extras` is an empty container below the chart where other
    views (the breakdown by role) can be mounted: pane.extras.mount(widget)."""

    def __init__(self, app: "AttachApp", proc: ProcessModel, dev_index: int, **kw) -> None:
        super().__init__(**kw)
        self._main, self.proc, self.dev_index = app, proc, dev_index
        self.header = ProcessHeader(proc, dev_index, app.client_id, app.clock,
                                    classes="proc-header")
        self.chart = BrailleChart(classes="chart")
        self.figures = FiguresPanel(proc, dev_index, app.clock, classes="figures")
        self.extras = Vertical(classes="extras")
        self.breakdown = None  # the breakdown by role, mounted into extras on first `b`

    def compose(self) -> ComposeResult:
        yield self.header
        with Horizontal(classes="body"):
            yield self.chart
            yield self.figures
        yield self.extras

    def frame(self, data_changed: bool, view_changed: bool) -> None:
        self.header.update_if_changed()
        if data_changed or view_changed:
            self.figures.update_if_changed()
            self.chart.plot(self._main.device_spec(self.proc, self.dev_index))
        want = self._main.show_breakdown
        self.set_class(want, "bd-open")  # a short screen gives the breakdown the whole pane
        if want and self.breakdown is None:
            from gpumon.tui.widgets.breakdown import BreakdownView
            self.breakdown = BreakdownView(classes="breakdown")
            self.extras.mount(self.breakdown)
            self.call_after_refresh(self._update_breakdown)
        elif self.breakdown is not None:
            self.breakdown.display = want
            if want and (data_changed or view_changed or not self._breakdown_fed):
                self._update_breakdown()

    _breakdown_fed = False  # the mounted breakdown has been given this pane's model

    def _update_breakdown(self) -> None:
        # on_mount of the view (which shows an empty model) may run after the first call:
        # until the view is mounted and set up, try again on the next frame
        if self.breakdown is not None and self.breakdown.is_mounted \
                and hasattr(self.breakdown, "_roles_rows"):
            device, note = self.breakdown_device()
            self.breakdown.update_model(self.proc.breakdown, device=device, note=note)
            self._breakdown_fed = True

    def breakdown_device(self) -> tuple[Any, str | None]:
        """Whose breakdown this pane shows: its own device's; where the agent sends none for
        it but does for another device (the demo on a machine without CUDA: the model trains
        on the CPU while the chart is the simulated cuda:0), that one, with a line saying so."""
        bd, idx = self.proc.breakdown, self.dev_index
        if bd.device(idx) is not None or not bd.devices:
            return idx, None
        other = bd.main_device().index
        where = "the CPU" if other == "cpu" else f"cuda:{other}"
        if self.proc.source == "simulated":
            note = (f"breakdown: the model trains on {where}, not on this simulated "
                    f"cuda:{idx}; its roles are shown for device {other}")
        else:
            note = (f"breakdown: the agent reports no roles for cuda:{idx}; "
                    f"shown for device {other}")
        return other, note


class OverviewPane(Vertical):
    """Every rank/device lined up: one allocated line each on a shared chart, and a table."""

    def __init__(self, app: "AttachApp", **kw) -> None:
        super().__init__(**kw)
        self._main = app
        self.chart = BrailleChart(classes="chart overview-chart")
        self.table = OverviewTable(app.pane_rows, app.clock, RANK_COLORS, classes="overview-table")

    def compose(self) -> ComposeResult:
        yield self.table
        yield self.chart

    def frame(self, data_changed: bool, view_changed: bool) -> None:
        if data_changed or view_changed:
            n = len(self._main.pane_rows())
            if n != getattr(self, "_n", None):
                self.table.refresh(layout=True)
                self.table._shown = None
            else:
                self.table.update_if_changed()
            self._n = n
            self.chart.plot(self._main.overview_spec())


class TopBar(Widget):
    DEFAULT_CSS = "TopBar { height: 1; }"

    def __init__(self, app: "AttachApp", **kw) -> None:
        super().__init__(**kw)
        self._main = app
        self._text: Text | None = None

    def update_if_changed(self) -> None:
        t = self._build()
        if self._text is None or t != self._text:
            self._text = t
            self.refresh()

    def render(self) -> Text:
        if self._text is None:
            self._text = self._build()
        return self._text

    def _build(self) -> Text:
        a = self._main
        t = Text(no_wrap=True, overflow="ellipsis")
        narrow = 0 < self.size.width < 110
        t.append(" gpumon ", "bold reverse")
        help_key = (live_keys(a, a.BINDINGS).get("help") or "?").split("/")[0]
        t.append(f" {help_key} help", "dim")  # first: a narrow terminal cuts from the right
        # an NVML-only process where NVML does not answer is the source of nothing
        sources = sorted({p.source for p in a.procs.values() if p.hello and not (
            p.source == "nvml" and p.hello.get("nvml"))})
        if sources:  # at 80 columns the words go, the values stay (after `y` the bar was cut)
            t.append("  " if narrow else "  source: ")
            for i, s in enumerate(sources):
                if i:
                    t.append(", ")
                t.append(s, "bold magenta" if s == "simulated" else "bold cyan")
                if s == "simulated":
                    t.append(" (not a GPU)" if narrow else " (scripted memory, not a GPU)",
                             "magenta")
        procs = {k: p for k, p in a.procs.items() if k not in a.nodes}  # (not the nodes)
        n = len(procs)
        down = {h for k, h in a.nodes.items()
                if a.state_lines.get(k, ("",))[0] == "unreachable"}
        # narrow: the ranks of a node that is down are said by "node down" alone
        off = sum(1 for k, p in procs.items() if not p.alive and not (
            narrow and p.state == State.UNREACHABLE and a.state_hosts.get(k) in down))
        t.append(f"  {n} proc" if narrow else f"  {n} process{'es' if n != 1 else ''}")
        if off:
            t.append(f" ({off} not running)", "bold red")
        if down:
            nodes = f"{len(a.nodes)} node{'s' if len(a.nodes) != 1 else ''}"
            t.append(f"  {len(down)}/{nodes} down" if narrow else
                     f"  {len(down)} of {nodes} unreachable", "bold red")
        terse = narrow and (a.paused_at is not None or a.y_capacity)  # room for those marks
        t.append(f"  {fmt_window(ZOOMS[a.zoom])}" if terse else
                 f"  window {fmt_window(ZOOMS[a.zoom])}")
        if a.paused_at is not None:
            t.append("  ⏸ PAUSED", "bold reverse")
        if a.y_capacity:
            t.append("  y: capacity")
        return t


class AttachApp(InterruptibleApp):
    CSS_PATH = "attach.tcss"
    TITLE = "gpumon"
    # help and quit first: on a narrow terminal the footer cuts from the right
    BINDINGS = [
        Binding(HELP_KEYS, "help", "Help", key_display="?", id="help"),
        Binding("q,f10", "quit", "Quit", key_display="q", id="quit"),  # F10: htop's quit
        Binding("b", "breakdown", "Breakdown", id="breakdown"),
        # in the footer only while the breakdown goes on below the screen (check_action)
        Binding("pagedown", "scroll_breakdown(1)", "More", key_display="PgDn", id="bd_down"),
        Binding("s", "snapshot", "Snapshot", id="snapshot"),
        Binding("m", "modules", "Modules", id="modules", show=False),
        Binding("tab", "next_tab", "Next", id="next_tab", priority=True),
        Binding("p", "pause", "Pause", id="pause"),
        Binding("plus,equals_sign", "zoom_in", "Zoom in", key_display="+", id="zoom_in"),
        Binding("minus,underscore", "zoom_out", "Zoom out", key_display="-", id="zoom_out"),
        Binding("r", "reset_peaks", "Reset peaks", id="reset_peaks"),
        Binding("n", "notices", "Notices", id="notices", show=False),
        Binding("y", "toggle_scale", "Y scale", id="y_scale", show=False),
        Binding("shift+tab", "prev_tab", "Previous", id="prev_tab", show=False, priority=True),
        Binding("pageup", "scroll_breakdown(-1)", "Breakdown up", id="bd_up", show=False),
    ]

    def __init__(self, target: Any, fps: float = 4.0, no_color: bool = False,
                 clock: Callable[[], float] = time.time, notice: str | None = None,
                 client_id: str | None = None, estimate: dict | None = None,
                 demo: bool = False) -> None:
        # Textual decides monochrome from NO_COLOR in App.__init__ (and pops it): set it only
        # for that call and put back what the user had, so nothing leaks into the process.
        saved = os.environ.get("NO_COLOR")
        if no_color:
            os.environ["NO_COLOR"] = "1"
        try:
            super().__init__()
        finally:
            if saved is not None:
                os.environ["NO_COLOR"] = saved
            else:
                os.environ.pop("NO_COLOR", None)
        self.fps = max(0.5, float(fps))
        self.clock = clock
        # who the agents say started a recording: a target on other nodes maps its relays'
        # ids to its own
        self.client_id = client_id or getattr(target, "client_id", None) or f"pid:{os.getpid()}"
        self.notice = notice
        # `gpumon demo`: its workload's own line (hello "demo": what trains, what is
        # scripted) above the panes, and its start said as the demo's, not as an NVML error
        self.demo = demo
        self.estimate = estimate  # `gpumon estimate --json` output, shown beside the breakdown
        self.show_breakdown = False
        self._more_below = False  # the footer shows PgDn (the breakdown goes on below)
        self.who = _who()
        self.target = target  # gpumon.client.Target: subscribe, request, close
        self._sub = target.subscribe()  # before start(): histories are not missed
        self.procs: dict[str, ProcessModel] = {}
        self.state_lines: dict[str, tuple[str, str]] = {}  # key -> (client state, its line)
        self.state_hosts: dict[str, str] = {}  # key -> its node (attach --hosts/--slurm)
        self.nodes: dict[str, str] = {}  # the nodes' own members: key ("host:") -> host
        self.gpus: dict[str, tuple] = {}  # key -> NVML's GPUs (hello's, last sample's, error)
        self.panes: dict[str, DevicePane] = {}   # pane id -> pane
        self._pane_order: list[tuple[str, int]] = []
        self.zoom = DEFAULT_ZOOM
        self.paused_at: float | None = None
        self.y_capacity = False
        self._view_changed = True
        self._overview: OverviewPane | None = None
        self.frame_delays: list[float] = []  # sample taken -> drawn, seconds (for benchmarks)
        self.frames = 0
        self.keys_warning = apply_env_keymap(self, self.BINDINGS)  # said once, on mount
        # the snapshots written while the view was open: their toasts go with the screen,
        # so run_attach prints them after it ("gpumon view FILE" needs the path)
        self.saved: list[str] = []
        self.armed: set[str] = set()  # keys whose recording starts when their agent serves
        self.last_saved: str | None = None

    # -- structure -----------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        self._topbar = TopBar(self, id="topbar")
        self._tabs = TabbedContent(id="tabs")
        yield self._topbar
        self._notice = Static(self.notice or "", id="notice",
                              classes="" if self.notice else "hidden")
        yield self._notice
        # until the first figures: Textual's own indicator, so a slow start never looks hung
        self._loading = LoadingIndicator(id="loading")
        yield self._loading
        self._waiting = Static("connecting...", id="waiting")
        yield self._waiting
        yield self._tabs
        # while a snapshot is written (the first dump of C++ stacks can take a minute)
        with Horizontal(id="busy", classes="hidden"):
            yield LoadingIndicator(id="busy-spin")
            yield Static("", id="busy-text")
        # compact from the first frame on a narrow terminal (see _apply_width)
        yield FittingFooter(compact=0 < self.size.width < 110)

    def on_mount(self) -> None:
        self.run_worker(self.target.start, thread=True, group="target")
        self.set_interval(1.0 / self.fps, self._frame, name="frame")
        self._apply_width(self.size.width)
        if self.keys_warning:
            self.notify(self.keys_warning, severity="warning", timeout=15)

    def on_resize(self, event) -> None:
        self._apply_width(event.size.width, event.size.height)
        self._view_changed = True

    def _apply_width(self, width: int, height: int = 0) -> None:
        self.screen.set_class(width < NARROW, "narrow")
        self._retitle_all()  # tab titles are compact where the full ones do not fit
        if getattr(self, "notice_lines", None) is not None:
            self._status_text()
        # below 40 rows the breakdown under the chart showed its roles and no more: the advice
        # and the step table were cut off; there `b` shows it in the chart's place
        self.screen.set_class(0 < height < SHORT_ROWS, "short")
        for footer in self.query(Footer):
            footer.compact = width < 110  # one space between keys: help and quit stay in 80

    def _proc(self, key: str) -> ProcessModel:
        proc = self.procs.get(key)
        if proc is None:
            proc = self.procs[key] = ProcessModel(key)
            if self.estimate is not None:
                proc.breakdown.set_estimate(self.estimate)
        return proc

    def pane_rows(self) -> list[tuple[ProcessModel, int]]:
        return [(self.procs[k], d) for k, d in self._pane_order]

    def _closing_down(self) -> bool:
        tabs = getattr(self, "_tabs", None)
        return bool(self._exit or self._closing or self._closed or tabs is None
                    or tabs._closing or tabs._closed or tabs._pruning or not tabs.is_attached)

    async def _ensure_panes(self, proc: ProcessModel) -> None:
        tabs = self._tabs
        for idx in sorted(proc.devices):
            pid_ = _pane_id(proc.key, idx)
            if pid_ in self.panes:
                continue
            pane = DevicePane(self, proc, idx)
            self.panes[pid_] = pane
            self._pane_order.append((proc.key, idx))
            self._pane_order.sort(key=lambda kd: (self._sort_key(self.procs[kd[0]]), kd[1]))
            title = self._tab_title(proc, idx)
            # in rank order, not arrival order: before the pane that follows it, if mounted
            after = self._pane_order[self._pane_order.index((proc.key, idx)) + 1:]
            before = next((_pane_id(k, d) for k, d in after
                           if _pane_id(k, d) in self.panes and _pane_id(k, d) != pid_
                           and self._tab_mounted(_pane_id(k, d))), None)
            try:
                await tabs.add_pane(TabPane(title, pane, id=pid_), before=before)
            except ValueError:
                # Textual activates the first tab once it is mounted; when the app is closing
                # (q pressed as the first pane came) the tab is gone by then and Textual
                # raises "No Tab with id". The pane is added; only its activation failed:
                # nothing to do when closing, else activate it once its tab is there.
                if self._closing_down():
                    return
                self._activate(pid_)
            except NoMatches:  # the tab bar's switcher already removed: the app is closing
                if self._closing_down():
                    return
                raise
            self._waiting.add_class("hidden")
            self._loading.add_class("hidden")
            if len(self.panes) >= 2 and self._overview is None:
                # before the first tab of the bar (rank order, not the first to arrive)
                first = next((_pane_id(k, d) for k, d in self._pane_order
                              if _pane_id(k, d) in self.panes), None)
                self._overview = OverviewPane(self)
                # under load the first tab may still be mounting: then the overview goes
                # last (a failed add leaves a broken tab bar)
                before = first if first and self._tab_mounted(first) else None
                try:
                    await tabs.add_pane(TabPane("Overview", self._overview, id="tab-overview"),
                                        before=before)
                except (NoMatches, ValueError):  # the app exits (q, or a test's end) while
                    if self._closing_down():       # the tab mounts: its bar is being pruned
                        return
                    raise
                self._show_overview()
        self._retitle_all()  # (one more tab may make every title compact)

    def _retitle_all(self) -> None:
        compact = self._compact_tabs()
        for key, idx in self._pane_order:
            if key in self.procs:
                self._retitle(self.procs[key], idx, compact)

    def _tab_mounted(self, pane_id: str) -> bool:
        try:
            self._tabs.get_tab(pane_id)
            return True
        except Exception:
            return False

    def _activate(self, pane_id: str, tries: int = 40) -> None:
        """Make pane_id the active tab, trying again shortly while its tab is not mounted."""
        if self._closing_down() or self._tabs.active:
            return
        try:
            self._tabs.active = pane_id
        except Exception:
            if tries > 0:
                self.set_timer(0.05, lambda: self._activate(pane_id, tries - 1))

    def _show_overview(self, tries: int = 40) -> None:
        """Make the overview the active tab; under load its tab may not be mounted yet (the
        tab bar raises ValueError, or NoMatches for its underline), so try again shortly."""
        try:
            self._tabs.active = "tab-overview"
        except Exception:
            if tries > 0:
                self.set_timer(0.05, lambda: self._show_overview(tries - 1))

    @staticmethod
    def _sort_key(p: ProcessModel):
        return (p.rank if p.rank is not None else 1 << 30, p.host or "", p.pid or 0)

    def _tab_title(self, proc: ProcessModel, idx: int, compact: bool | None = None) -> str:
        """"gpu02 rank 5 cuda:1"; where every tab so titled does not fit the width, "gpu02 r5"
        (":1" where the process has several devices): four ranks' tabs fit 80 columns."""
        mark = {State.EXITED: " ✗", State.UNREACHABLE: " ?"}.get(proc.state, "")
        host = f"{proc.host} " if proc.host else ""
        if compact is None:
            compact = self._compact_tabs()
        if compact:
            name = f"r{proc.rank}" if proc.rank is not None else proc.label
            dev = f":{idx}" if len(proc.devices) > 1 else ""
            return f"{host}{name}{dev}{mark}"
        return f"{host}{proc.label} cuda:{idx}{mark}"

    def _compact_tabs(self) -> bool:
        """Whether the full tab titles (and the Overview's) overflow the width."""
        width = self.size.width
        if width <= 0:
            return False
        full = sum(len(self._tab_title(self.procs[k], d, False)) + 2
                   for k, d in self._pane_order if k in self.procs)
        return full + (len(" Overview ") if len(self._pane_order) >= 2 else 0) > width

    def _retitle(self, proc: ProcessModel, idx: int, compact: bool | None = None) -> None:
        try:
            tab = self._tabs.get_tab(_pane_id(proc.key, idx))
        except Exception:
            return
        title = self._tab_title(proc, idx, compact)
        if str(tab.label) != title:
            tab.label = title

    # -- the frame -----------------------------------------------------------------------
    _tabs_ready = False

    async def _frame(self) -> None:
        if not self._tabs_ready:  # panes go into the tab bar: wait until it is mounted
            try:
                self._tabs.query_one("#tabs-list")
            except Exception:
                return
            self._tabs_ready = True
        batch = self._sub.drain()
        touched: dict[str, tuple[int, State]] = {}
        states_changed = False
        for recv_t, msg in batch:
            key = msg.get("key")
            if key is None:
                continue
            kind = msg.get("type")
            if kind == "state":
                states_changed = True
                self._on_state(key, msg)
                if key in self.nodes:  # a node of attach --hosts/--slurm: its line only
                    continue
                if msg["state"] in HIDDEN_STATES:  # a launcher, a helper: not shown
                    if key in self.procs and not self.procs[key].devices:
                        del self.procs[key]
                        self.gpus.pop(key, None)
                        # (a node's member is "connecting", then a launcher, in one batch)
                        touched.pop(key, None)
                    continue
            elif self.state_lines.get(key, ("",))[0] in HIDDEN_STATES:
                continue
            proc = self._proc(key)
            if key not in touched:
                touched[key] = (len(proc.devices), proc.state)
            if kind == "state":
                proc.set_client_state(msg["state"], msg.get("line") or "", msg.get("since"),
                                      msg.get("status"), msg.get("signal"), msg.get("how"))
                continue
            if msg.get("source") == "nvml":
                self._note_gpus(key, msg)
            proc.apply(msg, recv_t)
            if kind == "event":
                self._on_event(proc, msg)
            elif kind == "hello" and key in self.armed and "snapshot_start" in proc.commands:
                self.armed.discard(key)  # the agent serves: the armed recording starts now
                self._command(key, "snapshot_start", {"who": self.who}, None)
            elif kind == "hello" and "snapshot_status" in proc.commands:
                self._command(key, "snapshot_status", {}, None)
        # the batch is applied: the top bar says so now, before the panes are mounted below
        # (each mount awaits, and the screen may be drawn meanwhile: the bar of the frame
        # before said "1 proc  1/2 nodes down" beside the overview of the ranks just come)
        self._topbar.update_if_changed()
        if states_changed:
            self._status_text()
        for key, (n_dev, state) in touched.items():
            proc = self.procs[key]
            if len(proc.devices) != n_dev or (proc.devices and not any(
                    k == key for k, _ in self._pane_order)):
                await self._ensure_panes(proc)
            elif proc.state != state:
                self._retitle_all()
        if states_changed or touched:
            self._status_text()
        self._draw(bool(batch))

    def _on_state(self, key: str, msg: dict) -> None:
        state, line = msg["state"], msg.get("line") or ""
        before = self.state_lines.get(key, (None, ""))[0]
        self.state_lines[key] = (state, line)
        host = msg.get("host")
        if isinstance(host, str):
            self.state_hosts[key] = host
            if key == f"{host}:":  # a node of attach --hosts/--slurm itself, not a process
                self.nodes[key] = host
        if state == "exited" and before not in (None, "exited") and key in self.procs \
                and msg.get("how") != "job_ended":  # (the job's end: one line per node)
            self.notify(line, severity="warning", timeout=10)
        if state in ("exited", "no_process") and key in self.armed:
            self.armed.discard(key)
            self.notify("the program ended before its first CUDA call: the armed snapshot never "
                        "started", severity="warning", timeout=10)

    def _saved_line(self) -> str:
        """The last snapshot's path on one line: its end (the file's name) where the line is
        too narrow; the whole path is printed after the view."""
        head = "saved: "
        room = max(20, (self.size.width or 80) - 2 - len(head))
        p = self.last_saved or ""
        return head + (p if len(p) <= room else "…" + p[-(room - 1):])

    def _note_gpus(self, key: str, msg: dict) -> None:
        """NVML's view of the node's GPUs, from an NVML-only member's hello and samples."""
        hello_gpus, last, error = self.gpus.get(key, ([], [], None))
        if msg.get("type") == "hello":
            hello_gpus, error = msg.get("gpus") or [], msg.get("nvml")
        elif msg.get("type") == "sample":
            last = msg.get("gpus") or []
        self.gpus[key] = (hello_gpus, last, error)

    def _status_text(self) -> None:
        """What is not serving and why (waiting for CUDA, no agent): in the notice line above
        the panes, or, with no pane yet, in the waiting box with what NVML knows of the GPUs."""
        down = {h for k, h in self.nodes.items()
                if self.state_lines.get(k, ("",))[0] == "unreachable"}
        # a node that cannot be reached is its one line, not one more per rank of it (they
        # say the same; the ranks are marked in the Overview and their tabs)
        lines = [line for key, (state, line) in sorted(self.state_lines.items())
                 if state in NOTICE_STATES and not (
                     key not in self.nodes and state == "unreachable"
                     and self.state_hosts.get(key) in down)]
        notice = self.notice
        if self.demo:
            said = next((p.hello.get("demo") for p in self.procs.values()
                         if p.hello and p.hello.get("demo")), None)
            notice = f"demo: {said}" if said else notice
        if self.last_saved:
            notice = "\n".join(filter(None, [notice, self._saved_line()]))
        self.notice_lines = (notice.split("\n") if notice else []) + (
            lines if self.panes else [])
        box = getattr(self, "_notice", None)
        if box is None or not box.is_mounted:
            return
        text = self._notice_text(self.notice_lines, (self.size.width or 80) - 2)
        box.update(text)
        box.set_class(not text, "hidden")
        if self.panes:
            return
        body = [line for key, (state, line) in sorted(self.state_lines.items())
                if state not in HIDDEN_STATES] or ["connecting..."]
        if self.demo:  # its agent waits while it builds its model, as under `gpumon run`
            body = [DEMO_STARTING]
        if self.armed:
            body.insert(0, "● SNAPSHOT ARMED: recording starts at the program's first CUDA call "
                        "(s: disarm)")
        elif not self.demo and any(state == "waiting" for state, _ in self.state_lines.values()):
            body.append(NO_CUDA_YET)  # (the demo's own line says what it waits for)
        for key, (hello_gpus, last, error) in sorted(self.gpus.items()):
            if error:
                body.append("no NVIDIA driver: the demo's GPU is simulated" if self.demo
                            and "no NVIDIA driver" in error else f"  NVML: {error}")
            used = {g[0]: g[1:] for g in last if isinstance(g, list) and len(g) == 3}
            for g in hello_gpus:
                u, total = used.get(g.get("index"), (None, g.get("total")))
                body.append(f"  NVML: cuda:{g.get('index')} {g.get('name') or '?'}: "
                            f"{fmt_bytes(u)} used of {fmt_bytes(total)} (all processes); "
                            "none by this process yet")
            break  # the GPUs are the node's: once
        self._waiting.update("\n".join(body))

    def _notice_text(self, lines: list[str], width: int) -> str:
        """The lines that fit the notice box (NOTICE_ROWS rows of width, a line wrapping
        over as many rows as it needs), whole; where they do not all fit, the last row says
        how many more and which key shows every one (action_notices)."""
        width = max(20, width)

        def rows(line: str) -> int:
            return max(1, -(-len(line) // width))
        if sum(rows(x) for x in lines) <= NOTICE_ROWS:
            return "\n".join(lines)
        key = live_keys(self, self.BINDINGS).get("notices") or "n"
        shown, used = [], 0
        for i, line in enumerate(lines):
            if used + rows(line) > NOTICE_ROWS - 1:
                break
            shown.append(line)
            used += rows(line)
        if not shown:  # one line longer than the box: its start, cut
            shown = [lines[0][:width * (NOTICE_ROWS - 1) - 1] + "…"]
        more = len(lines) - len(shown) + (0 if shown[0] == lines[0] else 1)
        return "\n".join(shown + [f"+{more} more: press {key} to see every one"])

    def action_notices(self) -> None:
        """Every notice line, whole, in a scrollable box (the notice box shows what fits)."""
        from gpumon.tui.keys import _esc
        lines = getattr(self, "notice_lines", [])
        body = "\n".join(f"• {_esc(x)}" for x in lines) or "nothing to say: every process shown serves"
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen("[b]Why some processes or nodes show no figures[/b]\n"
                                        + body))

    def _on_event(self, proc: ProcessModel, e: dict) -> None:
        kind = e.get("kind")
        if kind == "snapshot":
            if e.get("path"):
                self.notify(f"{_named(proc)}: snapshot saved: {e['path']}", timeout=10)
                self.saved.append(f"{_named(proc)}: snapshot saved: {e['path']}")
                self.last_saved = e["path"]  # stays in the notice line, after the toast
                self._status_text()
            elif e.get("ok") is False:
                self.notify(f"{_named(proc)}: {e.get('error') or 'snapshot failed'}",
                            severity="error", timeout=10)
        elif kind == "oom":
            req = e.get("requested")
            self.notify(f"{_named(proc)}: OUT OF MEMORY on cuda:{e.get('device')}"
                        f" (asked for {fmt_bytes(req)})"
                        + (f"; snapshot {e['path']}" if e.get("path") else ""),
                        severity="error", timeout=30)
            if e.get("path"):
                self.saved.append(f"{_named(proc)}: out-of-memory snapshot saved: {e['path']}")
        elif kind == "modules":  # the breakdown model took the result; say it once
            r = proc.breakdown.modules
            if proc.breakdown.modules_error:
                self.notify(f"{_named(proc)}: modules: {proc.breakdown.modules_error}",
                            severity="warning", timeout=8)
            elif r is not None and r.peak is not None:
                self.notify(f"{_named(proc)}: modules measured: peak in {r.peak_phase}, "
                            f"running {r.peak_module() or 'no module'}", timeout=8)
            elif r is not None:
                self.notify(f"{_named(proc)}: modules measured: persistent parts only "
                            "(no allocation history on this device)", timeout=8)
            self._view_changed = True
        elif kind == "recording" and e.get("by") != self.client_id:
            who = e.get("who") or e.get("by") or "another client"
            self.notify(f"{_named(proc)}: recording {e.get('state')} by {who}", timeout=6)

    def _draw(self, data_changed: bool) -> None:
        view_changed = self._view_changed
        self._view_changed = False
        self._topbar.update_if_changed()
        pane = self._visible_pane()
        if pane is None:
            return
        pane.frame(data_changed, view_changed)
        self.frames += 1
        more = self._breakdown_goes_on(pane)
        if more != self._more_below:  # the footer's PgDn comes and goes with it
            self._more_below = more
            self.refresh_bindings()
        if data_changed:
            procs = [pane.proc] if isinstance(pane, DevicePane) else list(self.procs.values())
            now = self.clock()
            for p in procs:
                if p.alive and p.last_t is not None:
                    self.frame_delays.append(now - p.last_t)
            if len(self.frame_delays) > 10000:
                del self.frame_delays[:5000]

    def _visible_pane(self):
        tabs = getattr(self, "_tabs", None)
        if tabs is None or not tabs.is_mounted:
            return None
        active = tabs.active
        if not active:
            return None
        if active == "tab-overview":
            return self._overview
        return self.panes.get(active)

    def _current_procs(self) -> list[ProcessModel]:
        pane = self._visible_pane()
        if isinstance(pane, DevicePane):
            return [pane.proc]
        return [p for p in self.procs.values() if p.hello]

    # -- chart specs (what the chart widgets draw) ---------------------------------------
    def _window(self, t_last: float | None, t_first: float | None) -> tuple[float, float]:
        end = self.paused_at if self.paused_at is not None else t_last
        if end is None:
            end = self.clock()
        span = ZOOMS[self.zoom]
        if span is None:
            start = t_first if t_first is not None and t_first < end else end - 30
            if end - start < 1:
                start = end - 30
        else:
            start = end - span
        return start, end

    def device_spec(self, proc: ProcessModel, idx: int) -> ChartSpec:
        dev = proc.devices[idx]
        t0, t1 = self._window(proc.last_t, proc.first_t)
        lines = [Line(SERIES_LABELS[m], dev.series[m], SERIES_COLORS[m])
                 for m in ("nvml", "reserved", "active", "allocated")]
        total = dev.get("nvml_total") or dev.total
        hl = [HLine(total, "capacity", "red")] if total else []
        marks = [VMark(t, "!", "red") for t in proc.oom_times if t is not None]
        for start, end in proc.recording.spans:
            marks.append(VMark(start, "┃", "red"))
            if end is not None:
                marks.append(VMark(end, "┆", "red"))
        peak = dev.peak_point
        legend: list[tuple[str, str]] = []
        if self.no_color:
            legend.append(("top to bottom: NVML proc ≥ reserved ≥ allocated ≥ active", ""))
        else:
            for m in ("allocated", "active", "reserved", "nvml"):
                legend += [("━ ", SERIES_COLORS[m]), (SERIES_LABELS[m] + "  ", "")]
        legend.append(("◆ peak ", "red"))
        if total:
            legend.append((f"┄ capacity {fmt_bytes(total)}", "red"))
        if proc.state == State.EXITED:
            legend.insert(0, ("[process exited: history kept] ", "bold red"))
        bands = phase_bands(proc.phase_marks, t0, t1)
        if bands:
            from gpumon.tui.widgets.breakdown import phase_colour
            bands = [(a, b, phase_colour(ph)) for a, b, ph in bands]
        return ChartSpec(lines, t0, t1, hl, marks, peak,
                         y_max=total if self.y_capacity and total else None, legend=legend,
                         bands=bands)

    def overview_spec(self) -> ChartSpec:
        rows = self.pane_rows()
        last = [p.last_t for p, _ in rows if p.last_t is not None]
        first = [p.first_t for p, _ in rows if p.first_t is not None]
        t0, t1 = self._window(max(last) if last else None, min(first) if first else None)
        # "━ r0 ━ r1 ...", where the full legend does not fit: four ranks fit 80 columns
        full = len("allocated per rank: ") + sum(len(f"━ {p.label} cuda:{i}  ")
                                                   for p, i in rows)
        narrow = 0 < self.size.width - 12 < full  # (the chart's axis and margins)
        lines, legend = [], [("allocated: " if narrow else "allocated per rank: ", "")]
        for i, (p, idx) in enumerate(rows):
            color = RANK_COLORS[i % len(RANK_COLORS)]
            lines.append(Line(p.label, p.devices[idx].series["allocated"], color))
            if narrow:
                name = f"r{p.rank}" if p.rank is not None else p.label
                dev = f":{idx}" if len(p.devices) > 1 else ""
                legend += [("━ ", color), (f"{name}{dev} ", "")]
            else:
                legend += [("━ ", color), (f"{p.label} cuda:{idx}  ", "")]
        caps = [p.devices[i].get("nvml_total") or p.devices[i].total for p, i in rows]
        caps = [c for c in caps if c]
        return ChartSpec(lines, t0, t1, [], [], None,
                         y_max=max(caps) if self.y_capacity and caps else None, legend=legend)

    # -- actions -------------------------------------------------------------------------
    def action_pause(self) -> None:
        if self.paused_at is None:
            procs = self._current_procs()
            last = [p.last_t for p in procs if p.last_t is not None]
            self.paused_at = max(last) if last else self.clock()
        else:
            self.paused_at = None
        self._view_changed = True
        self._draw(False)

    def action_zoom_in(self) -> None:
        if self.zoom > 0:
            self.zoom -= 1
            self._view_changed = True
            self._draw(False)

    def action_zoom_out(self) -> None:
        if self.zoom < len(ZOOMS) - 1:
            self.zoom += 1
            self._view_changed = True
            self._draw(False)

    def action_breakdown(self) -> None:
        if not self.panes and self._waiting_keys():  # it did nothing, without a word
            self.notify("no breakdown yet: this program has not used CUDA yet (the roles come "
                        "from its first CUDA call on)", severity="warning", timeout=6)
            return
        self.show_breakdown = not self.show_breakdown
        self._view_changed = True
        self._draw(False)

    def _breakdown_goes_on(self, pane: Any = None) -> bool:
        """The breakdown is shown and more of it lies below (a short screen: advice, steps).
        ``pane``: the visible one, where the caller has it."""
        pane = pane if pane is not None else self._visible_pane()
        return (isinstance(pane, DevicePane) and self.show_breakdown
                and pane.extras.scroll_y < pane.extras.max_scroll_y)

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "scroll_breakdown" and parameters == (1,):
            return self._breakdown_goes_on()  # False: out of the footer (PgDn does nothing)
        return True

    def action_scroll_breakdown(self, direction: int) -> None:
        """A page of the breakdown: on a short screen its advice and steps lie below."""
        pane = self._visible_pane()
        if isinstance(pane, DevicePane) and self.show_breakdown:
            (pane.extras.scroll_page_down if direction > 0 else pane.extras.scroll_page_up)(
                animate=False)

    def action_toggle_scale(self) -> None:
        self.y_capacity = not self.y_capacity
        self._view_changed = True
        self._draw(False)

    def _cycle(self, step: int) -> None:
        tabs = self._tabs
        mounted = {p.id for p in tabs.query(TabPane) if p.id}
        # the tab bar's order (the Overview, then rank order), not the panes' arrival order
        ids = [i for i in ["tab-overview", *(_pane_id(k, d) for k, d in self._pane_order)]
               if i in mounted]
        if not ids:
            return
        i = ids.index(tabs.active) if tabs.active in ids else -1
        tabs.active = ids[(i + step) % len(ids)]

    def action_next_tab(self) -> None:
        self._cycle(1)

    def action_prev_tab(self) -> None:
        self._cycle(-1)

    def on_tabbed_content_tab_activated(self, event) -> None:
        self._view_changed = True
        self.call_after_refresh(self._draw, False)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.help_text()))

    def help_text(self) -> str:
        """The help, from the bindings as they are now (GPUMON_KEYS included)."""
        head = HELP_HEAD.format(command="demo" if self.demo else "attach")
        return "\n".join([head, *help_lines(self, self.BINDINGS, KEY_HELP, HELP_EXTRA),
                          HELP_TAIL])

    def action_reset_peaks(self) -> None:
        procs = [p for p in self._current_procs() if p.alive]
        if not procs:
            self.notify("no running process to reset", severity="warning")
            return
        for p in procs:
            self._command(p.key, "reset_peaks", {}, "peaks reset")

    def _waiting_keys(self) -> list[str]:
        """The processes whose agent waits for the program's first CUDA call."""
        return [k for k, (state, _) in self.state_lines.items()
                if state == "waiting" and k not in self.nodes]

    def action_snapshot(self) -> None:
        waiting = self._waiting_keys()
        if waiting and not isinstance(self._visible_pane(), DevicePane):
            # armed: the recording starts as the agent serves, at the program's first CUDA call
            if all(k in self.armed for k in waiting):
                self.armed.difference_update(waiting)
                self.notify("snapshot disarmed", timeout=4)
            else:
                self.armed.update(waiting)
                self.notify("snapshot armed: the recording starts at the program's first CUDA "
                            "call (s again: disarm)", timeout=8)
            self._status_text()
            if not self.panes:
                return
        procs = [p for p in self._current_procs() if p.hello and p.source != "nvml"] \
            if waiting else [p for p in self._current_procs() if p.hello]
        if not procs:
            if waiting:
                return
            self.notify("not connected yet", severity="warning")
            return
        for p in procs:
            label = _named(p)
            if not p.alive:
                self.notify(f"{label}: {p.state.value}, no snapshot possible", severity="warning")
                continue
            if "snapshot_start" not in p.commands:
                self.notify(f"{label}: {NO_SNAPSHOT}", severity="warning", timeout=8)
                continue
            rec = p.recording
            if rec.active and rec.by != self.client_id:
                ago = fmt_duration(self.clock() - rec.since) if rec.since else "?"
                who = (f"{rec.who} ({rec.by})" if rec.who and rec.by else
                       rec.who or rec.by or "another client")
                self.notify(f"{label}: already recording, started by {who}"
                            f" at {fmt_clock(rec.since)} ({ago} ago)", severity="warning",
                            timeout=8)
                continue
            if rec.active:
                self._busy(p.key, f"{label}: writing the snapshot")
                self._command(p.key, "snapshot_stop", {}, None)
            else:  # the agent names the file (per rank, per pid)
                self._command(p.key, "snapshot_start", {"who": self.who}, None)

    def action_modules(self) -> None:
        """Ask each process shown for a per-module measurement of its next step; the result
        comes as a ``modules`` event (the breakdown shows it)."""
        procs = [p for p in self._current_procs() if p.alive]
        if not procs:
            self.notify("no running process to measure", severity="warning")
            return
        waiting = set(self._waiting_keys())
        for p in procs:
            if "modules_measure" not in p.commands:
                why = ("its agent waits for the program's first CUDA call: press m once it "
                       "serves" if p.key in waiting else
                       "no gpumon agent in it (NVML's figures only)" if p.source == "nvml" else
                       "this agent cannot measure per module (older gpumon)")
                self.notify(f"{_named(p)}: {why}", severity="warning", timeout=8)
                continue
            p.breakdown.modules_pending = True
            self._command(p.key, "modules_measure", {"steps": 1, "wait": 0}, None)
        if not self.show_breakdown:
            self.action_breakdown()

    def _busy(self, key: str, text: str | None) -> None:
        """Say (text) or stop saying (None) that key's long command runs: Textual's loading
        indicator and one line above the footer, while any runs."""
        busy = self.__dict__.setdefault("_busy_lines", {})
        if text is None:
            busy.pop(key, None)
        else:
            busy[key] = text
        try:
            box = self.query_one("#busy")
            self.query_one("#busy-text", Static).update("; ".join(busy.values()))
        except Exception:  # not mounted (tests that drive commands without a screen)
            return
        box.set_class(not busy, "hidden")

    @work(thread=True, group="commands")
    def _command(self, key: str, cmd: str, args: dict, ok_text: str | None) -> None:
        proc = self.procs[key]
        try:
            result = self.target.request(key, cmd, args, timeout=STOP_TIMEOUT_S
                                         if cmd == "snapshot_stop" else 10.0)
        except Exception as e:
            if cmd == "snapshot_status":
                return
            if cmd == "snapshot_stop":
                self.call_from_thread(self._busy, key, None)
            what = COMMAND_WORDS.get(cmd, cmd)
            why = str(e).removeprefix(f"{cmd}: ")  # the agent names the command: said once
            self.call_from_thread(self.notify, f"{_named(proc)}: {what} failed: {why}",
                                  severity="error", timeout=8)
            return
        self.call_from_thread(self._command_done, key, cmd, result or {}, ok_text)

    def _command_done(self, key: str, cmd: str, result: dict, ok_text: str | None) -> None:
        proc = self.procs[key]
        rec = proc.recording
        if cmd == "snapshot_status":
            proc.set_recording_status(result)
            return
        if cmd == "reset_peaks":
            proc.reset_peaks()
        elif cmd == "modules_measure":
            if "ok" in result:  # done already (never with wait 0, but an agent may answer so)
                proc.breakdown.set_modules(result)
            ok_text = ("measuring the next step per module (the breakdown shows it; the "
                       "hooks go after it)")
        elif cmd == "snapshot_start":
            if not rec.active:
                since = result.get("since") or proc.last_t or self.clock()
                rec.active, rec.by, rec.since = True, self.client_id, since
                rec.spans.append([since, None])
            ok_text = "recording allocation history: press s again to stop and save"
        elif cmd == "snapshot_stop":
            self._busy(key, None)
            if rec.active:
                rec.active = False
                if rec.spans and rec.spans[-1][1] is None:
                    rec.spans[-1][1] = proc.last_t
            path = result.get("path")
            if path:
                rec.last_path = path
            # the "snapshot" event announces the path; say it here only if no event came
            ok_text = None if path else "recording stopped"
        if ok_text:
            self.notify(f"{_named(proc)}: {ok_text}", timeout=8)
        self._view_changed = True

    def get_system_commands(self, screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        keys = live_keys(self, self.BINDINGS)
        for bid, title in PALETTE_TITLES.items():
            action = getattr(self, "action_" + next(b.action for b in self.BINDINGS
                                                    if b.id == bid))
            yield SystemCommand(title, f"{keys.get(bid)} (id {bid}): {KEY_HELP[bid]}", action)

    async def action_quit(self) -> None:
        self.target.close()
        self.exit(0)

    def action_interrupt(self) -> None:
        """Ctrl-C: a recording this view started is stopped and saved first (its path is
        printed after the screen), then the view quits with 130. A second Ctrl-C quits at once:
        the agent then saves it by itself (a recording ends with its client)."""
        mine = [p for p in self.procs.values()
                if p.alive and p.recording.active and p.recording.by == self.client_id]
        if getattr(self, "_interrupting", False) or not mine:
            if mine:
                self.interrupt_outcome = ("quit while saving: the agent saves the recording "
                                          "itself (gpumon-snapshots/ beside the program)")
            self.target.close()
            self.exit(return_code=INTERRUPTED)
            return
        self._interrupting = True
        for p in mine:
            self._busy(p.key, f"Ctrl-C: saving {_named(p)}'s recording, then quitting "
                       "(Ctrl-C again: quit now)")
        self._save_then_quit([p.key for p in mine])

    @work(thread=True, group="interrupt")
    def _save_then_quit(self, keys: list[str]) -> None:
        saved, failed = [], []
        for key in keys:
            try:
                path = (self.target.request(key, "snapshot_stop", {}, timeout=STOP_TIMEOUT_S)
                        or {}).get("path")
            except Exception as e:
                failed.append(f"{_named(self.procs[key])}: {e}")
                continue
            if path:
                saved.append(path)
                line = f"{_named(self.procs[key])}: snapshot saved: {path}"
                if line not in self.saved:
                    self.saved.append(line)
        outcome = "; ".join((["the recording was stopped and saved: " + ", ".join(saved)]
                             if saved else []) + ([f"saving failed ({'; '.join(failed)})"]
                                                  if failed else []))
        self.call_from_thread(self._quit_interrupted, outcome or None)

    def _quit_interrupted(self, outcome: str | None) -> None:
        self.interrupt_outcome = outcome
        self.target.close()
        self.exit(return_code=INTERRUPTED)


def phase_bands(marks, t0: float, t1: float) -> list[tuple[float, float, str]]:
    """(start, end, phase) spans inside [t0, t1] from (t, phase) change points."""
    out = []
    ms = list(marks)
    for i, (t, ph) in enumerate(ms):
        end = ms[i + 1][0] if i + 1 < len(ms) else t1
        if ph is None or end < t0 or t > t1:
            continue
        out.append((max(t, t0), min(end, t1), ph))
    return out


def _who() -> str:
    """How other clients see us when we record ("gpumon attach (alice@node1)")."""
    import getpass
    import socket
    try:
        user = getpass.getuser()
    except Exception:
        user = "?"
    return f"gpumon attach ({user}@{socket.gethostname()})"


# -- entry points ---------------------------------------------------------------------------
NO_TTY_HINT = ("gpumon: the live view needs a terminal: use `ssh -t`, or `srun --pty` under Slurm; "
               "for scripts use `--json` or `--once`")


def _tty_ok() -> bool:
    return sys.stdout.isatty() and sys.stdin.isatty()


def run_attach(target: Any, fps: float = 4.0, no_color: bool = False,
               estimate: str | None = None, demo: bool = False) -> int:
    """The live view of a gpumon.client target (not started yet: the app starts it).
    estimate: path of a `gpumon estimate ... --json` file shown beside the breakdown."""
    if not _tty_ok():
        print(NO_TTY_HINT, file=sys.stderr)
        return 2
    est = None
    if estimate:
        import json
        try:
            with open(estimate) as f:
                est = json.load(f)
            if not isinstance(est, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            print(f"gpumon: cannot read the estimate {estimate}: {e}", file=sys.stderr)
            return 1
    app = AttachApp(target, fps=fps, no_color=no_color, estimate=est, demo=demo)
    try:
        app.run()
    finally:
        target.close()
        for line in app.saved:
            print(line)
        if app.saved:
            print("open one with: gpumon view FILE")
    raise_if_interrupted(app)
    return int(app.return_code or 0)
