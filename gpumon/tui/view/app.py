"""The Textual app of `gpumon view FILE`: timeline, allocations live at the cursor (grouped by
first user frame, stack on select), segments, summary, and the OOM diagnosis when there is one.
Keyboard only; works at 80x24 and in monochrome."""
from __future__ import annotations

import asyncio
import os

from rich.text import Text
from textual import events
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static, TabbedContent, TabPane

from gpumon.snapshot import Snapshot, fmt_bytes
from gpumon.snapshot import report

from gpumon.tui.footer import FittingFooter
from gpumon.tui.keys import (HELP_KEYS, HelpScreen, InterruptibleApp, apply_env_keymap,
                              help_lines, live_keys, raise_if_interrupted)

from .chart import TimelineChart
from .frame import event_text, hang_wrap, head_text, oom_bar, oom_text, stack_lines

# what each binding does, by id: the help screen is built from these and the live bindings
KEY_HELP = {
    "view.tab_timeline": "timeline: bytes over the events",
    "view.tab_allocs": "allocations live at the cursor",
    "view.tab_segments": "segments of the cache",
    "view.tab_summary": "summary of the peak",
    "view.tab_leaks": "leaks across steps",
    "view.tab_oom": "out-of-memory diagnosis",
    "view.left": "cursor one column left",
    "view.right": "cursor one column right",
    "view.prev_event": "cursor one event back",
    "view.next_event": "cursor one event forward",
    "view.start": "to the first event",
    "view.end": "to the last event",
    "view.peak": "to the peak",
    "view.oom": "to the out-of-memory event",
    "view.prev_step": "to the previous optimizer step",
    "view.next_step": "to the next optimizer step",
    "view.zoom_in": "zoom in around the cursor",
    "view.zoom_out": "zoom out",
    "view.search": "search by file or function",
    "view.group_by": "group: line, function, file, library, ...",
    "view.full_frames": "stack: every frame / the shown ones",
    "view.reserved": "timeline: show or hide reserved",
    "view.export": "write the table as CSV",
    "view.close_search": "close and clear the search",
    "view.help": "this help",
    "view.quit": "quit",
    "view.prev_window": "long trace: the window of events before",
    "view.next_window": "long trace: the window of events after",
}
HELP_EXTRA = (("up/down", "move in lists; scroll the summary, leaks and OOM text"),
              ("pgup/pgdn", "scroll a page (summary, leaks, OOM, segments)"),
              ("enter", "expand a group, show its stack"),
              ("ctrl+p", "command palette"), ("ctrl+c", "quit (status 130)"))
HELP_HEAD = "[b]gpumon view: keys[/b] (binding ids in brackets)"
HELP_TAIL = """Remap keys with GPUMON_KEYS, e.g. GPUMON_KEYS="view.peak=P,view.quit=x".

[b]g[/b] also groups by category: profiler files,
  and by module: gpumon's snapshots (module enter/leave)

[b]The timeline[/b]
  ^ the peak   | an optimizer step   X the out-of-memory   ▲ the cursor
  f b o ·  gpumon's phases: forward, backward, optimizer, other
Press escape to close."""

CSS = """
#head { height: 1; background: $boost; padding: 0 1; }
#oombar { height: auto; max-height: 3; background: $error 30%; padding: 0 1; }
#event { height: 3; padding: 0 1; }
#tl-box { height: 1fr; overflow: hidden; }
#search { dock: top; display: none; }
#search.shown { display: block; }
#alloc-tree { height: 1fr; }
#stack { height: 40%; min-height: 4; padding: 0 1; border-top: solid $primary-darken-2; }
#alloc-head, #seg-head { height: auto; padding: 0 1; }
#alloc-body { height: 1fr; }
TabPane { padding: 0; }
Screen { overflow: hidden; }
/* notices at the top right, over the tabs: never over the stack pane at the bottom */
ToastRack { dock: top; align: right top; margin-top: 1; margin-bottom: 0; }
#tabs { height: 1fr; }
#tabs > ContentSwitcher { height: 1fr; }
"""


class _Tabs(TabbedContent):
    """Tabs that change by their keys and clicks only. TabbedContent also makes a tab active
    when a widget in it gets focus, a message that comes late: "2" then "3" typed quickly
    focused the allocations tree after "3" had chosen the segments, "2" won and "3" was lost."""

    def _on_tab_pane_focused(self, event: TabPane.Focused) -> None:
        event.stop()
        event.prevent_default()


class ViewApp(InterruptibleApp):
    TITLE = "gpumon view"
    CSS = CSS
    BINDINGS = [
        Binding("q,f10", "quit", "quit", key_display="q", id="view.quit"),
        Binding(HELP_KEYS, "help", "help", key_display="?", id="view.help"),
        Binding("1", "tab('timeline')", "timeline", id="view.tab_timeline"),
        Binding("2", "tab('allocs')", "allocs", id="view.tab_allocs"),
        Binding("3", "tab('segments')", "segments", id="view.tab_segments"),
        Binding("4", "tab('summary')", "summary", id="view.tab_summary"),
        Binding("5", "tab('leaks')", "leaks", id="view.tab_leaks", show=False),
        Binding("6", "tab('oom')", "OOM", id="view.tab_oom", show=False),
        Binding("left", "move(-1)", "◀", id="view.left", show=False),
        Binding("right", "move(1)", "▶", id="view.right", show=False),
        Binding("comma", "step_event(-1)", "-1 event", id="view.prev_event", show=False),
        Binding("full_stop", "step_event(1)", "+1 event", id="view.next_event", show=False),
        Binding("home", "jump('start')", "start", id="view.start", show=False),
        Binding("end", "jump('end')", "end", id="view.end", show=False),
        Binding("p", "jump('peak')", "peak", id="view.peak"),
        Binding("o", "jump('oom')", "OOM", id="view.oom", show=False),
        Binding("left_square_bracket", "step(-1)", "prev step", id="view.prev_step", show=False),
        Binding("right_square_bracket", "step(1)", "next step", id="view.next_step", show=False),
        Binding("plus,equals_sign", "zoom(0.5)", "zoom in", id="view.zoom_in"),
        Binding("minus", "zoom(2)", "zoom out", id="view.zoom_out"),
        Binding("slash", "search", "search", id="view.search"),
        Binding("g", "group_by", "group by", id="view.group_by"),
        Binding("f", "full_frames", "all frames", id="view.full_frames", show=False),
        Binding("r", "toggle_reserved", "reserved", id="view.reserved", show=False),
        Binding("e", "export", "export CSV", id="view.export", show=False),
        Binding("escape", "close_search", "close search", id="view.close_search", show=False),
        Binding("less_than_sign", "window(-1)", "earlier window", id="view.prev_window",
                show=False),
        Binding("greater_than_sign", "window(1)", "later window", id="view.next_window",
                show=False),
    ]

    def __init__(self, snap: Snapshot, device: int | None = None, no_color: bool = False, **kw):
        # Textual decides monochrome from NO_COLOR in App.__init__; set it only for that call so
        # it never leaks into the rest of the process (tests, other apps).
        saved = os.environ.get("NO_COLOR")
        if no_color:
            os.environ["NO_COLOR"] = "1"
        try:
            super().__init__(**kw)
        finally:
            if saved is None:
                os.environ.pop("NO_COLOR", None)
            else:
                os.environ["NO_COLOR"] = saved
        self.snap = snap
        self.tr = snap.trace(device)
        self.query_text = ""
        self.oom = report.oom_info(snap, self.tr.device)
        self._allocs_for: tuple | None = None
        self._segs_for: int | None = None
        self.group_by = "line"
        self.full_frames = False
        self._stack_data = None
        self._built: dict[str, bool] = {}   # tab -> its widgets are mounted (False: mounting)
        self.keys_warning = apply_env_keymap(self, self.BINDINGS)  # said once, on mount
        self._reloading = False
        # Keys are held until the first screen is settled (the tabs' first activation handled),
        # then pressed in the order typed: those typed on the plain frame (run_view_app), then
        # those Textual read itself meanwhile. A key handled earlier raced the tabs' own first
        # activation: the two tabs took focus from each other, redrawing without end, and the
        # key was lost.
        self.pending_keys: list[str] = []
        self._keys_held = True
        self._release_asked = False
        self.keys_released = asyncio.Event()   # set once the held keys have all been handled
        # the timeline as the plain first frame's keys left it: (cursor, lo, hi), reserved shown
        self.start_view: tuple[int, int, int] | None = None
        self.start_show_reserved: bool | None = None

    # -- layout ----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        tr = self.tr
        yield Static(head_text(self.snap, tr, width=max(20, self.size.width - 2)), id="head",
                     markup=False)
        if self.oom:
            yield Static(oom_bar(self.oom), id="oombar", markup=False)
        initial = "oom" if self.oom else "timeline"
        with _Tabs(initial=initial, id="tabs"):
            with TabPane("1 Timeline", id="timeline"):
                with Vertical(id="tl-box"):
                    yield TimelineChart(tr, self.snap.step_boundaries(tr.device),
                                        self.oom["event"] if self.oom else -1,
                                        self.snap.phase_spans(tr.device), id="chart")
                    yield Static("", id="event", markup=False)
            # the other tabs get their widgets the first time they are shown (_build), so the
            # first screen waits only for the timeline
            yield TabPane("2 Allocations", id="allocs")
            yield TabPane("3 Segments", id="segments")
            yield TabPane("4 Summary", id="summary")
            yield TabPane("5 Leaks", id="leaks")
            if self.oom:
                with TabPane("6 OOM", id="oom"):
                    with VerticalScroll(id="oom-scroll"):
                        yield Static(self._oom_text(), id="oom-text", markup=False)
        yield FittingFooter()

    def on_mount(self) -> None:
        if self.keys_warning:
            self.notify(self.keys_warning, severity="warning", timeout=15)
        if self.oom and self.oom["event"] >= 0:
            self.chart.set_cursor(self.oom["event"])
        chart = self.chart
        if self.start_view is not None:   # where the plain first frame's keys left it
            chart.cursor, chart.lo, chart.hi = self.start_view
        if self.start_show_reserved is not None:
            chart.show_reserved = self.start_show_reserved
        chart.refresh()
        self._update_event_line()
        if self.oom:
            self.query_one("#oom-scroll").focus()
        else:
            self.chart.focus()

    # -- actions ---------------------------------------------------------------------------
    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.help_text()))

    def help_text(self) -> str:
        """The help, from the bindings as they are now (GPUMON_KEYS included)."""
        return "\n".join([HELP_HEAD, *help_lines(self, self.BINDINGS, KEY_HELP, HELP_EXTRA),
                          HELP_TAIL])

    def get_system_commands(self, screen):
        """Textual's commands, then every key of KEY_HELP: its live key and binding id (the id
        is what GPUMON_KEYS remaps), run from the palette as the key would."""
        yield from super().get_system_commands(screen)
        keys = live_keys(self, self.BINDINGS)
        actions = {b.id: b.action for b in self.BINDINGS if b.id}
        for bid, text in KEY_HELP.items():
            if bid == "view.quit" or bid not in actions:
                continue  # Textual's own Quit is there already
            action = actions[bid]
            title = "Help: the keys" if bid == "view.help" else text[0].upper() + text[1:]
            yield SystemCommand(title, f"{keys.get(bid)} (id {bid})",
                                lambda a=action: self.call_later(self.run_action, a))

    @property
    def chart(self) -> TimelineChart:
        return self.query_one("#chart", TimelineChart)

    async def action_tab(self, tab: str) -> None:
        if tab == "oom" and not self.oom:
            self.notify("this snapshot has no OOM")
            return
        self.query_one("#tabs", TabbedContent).active = tab
        await self._on_tab(tab)

    async def on_event(self, event: events.Event) -> None:
        if self._keys_held and isinstance(event, events.Key) and not event.is_forwarded:
            self.pending_keys.append(event.key)
            return
        await super().on_event(event)

    async def _release_keys(self) -> None:
        """Press the held keys in order, one after another as Textual presses keys; from the
        app's queue, so a key typed meanwhile waits there and comes after them."""
        self._keys_held = False
        keys, self.pending_keys = self.pending_keys, []
        try:
            for k in keys:
                await super().on_event(events.Key(k, None))
        finally:
            self.keys_released.set()

    def _ask_release(self) -> None:
        if not self._release_asked:
            self._release_asked = True
            self.call_after_refresh(self._release_keys)

    def on_ready(self) -> None:
        self.set_timer(2.0, self._ask_release)  # never held for good, should no activation come

    async def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self._ask_release()  # the tabs' first activation: the screen is settled after a refresh
        from textual.css.query import NoMatches
        try:
            await self._on_tab(event.pane.id or "")
        except NoMatches:
            pass  # a late activation while the app is closing and its widgets are gone

    async def _build(self, tab: str) -> bool:
        """Mount a tab's widgets and fill them, once; False while another call is doing it."""
        if tab in self._built:
            return self._built[tab]
        self._built[tab] = False
        from textual.widgets import DataTable, Input, Tree
        pane = self.query_one(f"#{tab}", TabPane)
        if tab == "allocs":
            await pane.mount_all([
                Input(placeholder="search file or function (enter to apply, esc to clear)",
                      id="search"),
                Static("", id="alloc-head", markup=False),
                Vertical(Tree("live", id="alloc-tree"),
                         VerticalScroll(Static("", id="stack-text", markup=False), id="stack"),
                         id="alloc-body")])
        elif tab == "segments":
            await pane.mount_all([
                Static("", id="seg-head", markup=False),
                DataTable(id="seg-table", cursor_type="row", zebra_stripes=True)])
            self.query_one("#seg-table", DataTable).add_columns(
                "address", "reserved", "allocated", "free", "largest free", "use", "blocks",
                "pool")
            self._fill_segments()
        elif tab in ("leaks", "summary"):
            # computed off the event loop, with Textual's loading indicator over the pane
            # meanwhile (the leaks of a long trace take seconds)
            await pane.mount(VerticalScroll(Static("", id=f"{tab}-text", markup=False)))
            self._fill_text_tab(tab)
        self._built[tab] = True
        return True

    def _tab_text(self, tab: str, snap, device: int) -> str:
        if tab == "leaks":
            from gpumon.snapshot.leaks import leaks, leaks_text
            return (leaks_text(leaks(snap, device)) +
                    "\n(gpumon view FILE --leaks --after N for more steps; --json for the data)")
        return hang_wrap(report.summary_text(report.summary(snap, device)),
                         max(40, self.size.width - 3))

    def _fill_text_tab(self, tab: str) -> None:
        pane = self.query_one(f"#{tab}", TabPane)
        pane.loading = True
        snap, device = self.snap, self.tr.device

        def work() -> None:
            try:
                text = self._tab_text(tab, snap, device)
            except Exception as e:  # noqa: BLE001 - shown in the pane, never a crash
                text = f"could not compute this: {e}"

            def show() -> None:
                if snap is not self.snap:
                    return  # a window moved meanwhile: its own fill is on the way
                self.query_one(f"#{tab}-text", Static).update(text)
                pane.loading = False
            self._from_thread(show)
        self._background(work, f"fill-{tab}")

    async def _on_tab(self, tab: str) -> None:
        if tab in ("allocs", "segments", "summary", "leaks") and not await self._build(tab):
            return
        if self.query_one("#tabs", TabbedContent).active != tab:
            return  # a late activation: another tab was chosen since (keys typed quickly)
        if tab == "allocs":
            self._fill_allocs()
            box = self.query_one("#search")
            self._focus(tab, box if box.has_class("shown") else self.query_one("#alloc-tree"))
        elif tab == "timeline":
            self._focus(tab, self.chart)
        elif tab == "oom":
            self._focus(tab, self.query_one("#oom-scroll"))
        elif tab == "segments":
            self._fill_segments()
            self._focus(tab, self.query_one("#seg-table"))
        elif tab in ("leaks", "summary"):
            # the scroll has the focus: up/down/pgdn reach the tables below the fold at 80x24
            self._focus(tab, self.query_one(f"#{tab}-text").parent)

    def _focus(self, tab: str, widget) -> None:
        """Focus `widget` as widget.focus() does (after the messages now queued), unless another
        tab was chosen meanwhile: then it would keep the focus from a hidden tab."""
        from textual.css.query import NoMatches
        from textual.dom import NoScreen

        def focus() -> None:
            try:
                if self.query_one("#tabs", TabbedContent).active == tab:
                    widget.screen.set_focus(widget)
            except (NoMatches, NoScreen):
                pass  # the app is closing, or the widget is gone
        self.call_later(focus)

    def _cursor_moved(self) -> None:
        self._update_event_line()
        active = self.query_one("#tabs", TabbedContent).active
        if self._built.get("allocs") and active == "allocs":
            self._fill_allocs()
        if self._built.get("segments") and active == "segments":
            self._fill_segments()

    def group_levels(self) -> tuple[str, ...]:
        """What g cycles through: line, function, file, library, and category only for a file
        whose allocations carry the profiler's categories (elsewhere that level was one
        group, 100% <no category>), module only for one with gpumon's module annotations."""
        return ("line", "function", "file", "library") + \
            (("category",) if self.tr.categories else ()) + \
            (("module",) if self.tr.module_index is not None else ())

    def action_group_by(self) -> None:
        levels = self.group_levels()
        k = levels.index(self.group_by) if self.group_by in levels else -1
        self.group_by = levels[(k + 1) % len(levels)]
        self._allocs_for = None
        if self._built.get("allocs"):
            self._fill_allocs()   # the allocations' header says the level
        else:
            self.notify(f"allocations grouped by {self.group_by}")

    def action_full_frames(self) -> None:
        self.full_frames = not self.full_frames
        if self._stack_data is not None:
            self._show_stack(self._stack_data)   # the pane's last line says which
        else:
            self.notify("every frame of the stack" if self.full_frames else
                        "unwinder, allocator and dispatcher frames hidden (as memory_viz)")

    def action_toggle_reserved(self) -> None:
        self.chart.show_reserved = not self.chart.show_reserved
        self.chart.refresh()

    def action_export(self) -> None:
        """The table on screen (allocations at the cursor, or the segments) as CSV in the
        current folder."""
        active = self.query_one("#tabs", TabbedContent).active
        i = self.chart.cursor if self.tr.n else -1
        if active == "segments":
            cols = ["address", "reserved", "allocated", "requested", "pending_free", "free",
                    "largest_free", "blocks", "stream", "pool", "expandable"]
            rows = [[x.address, x.total, x.allocated, x.requested, x.pending_free, x.free,
                     x.largest_free, x.blocks, x.stream, x.pool, x.expandable]
                    for x in self.tr.segments_at(i)]
            name = f"segments-event{i + self.tr.window_offset}"
        else:
            cols, rows = report.table(self.snap, "live", self.tr.device, by=self.group_by,
                                      event=i)
            name = f"live-event{i + self.tr.window_offset}-by-{self.group_by}"
        base = os.path.splitext(os.path.basename(self.snap.path) or "snapshot")[0]
        path = f"{base}-{name}.csv"
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(report.table_text(cols, rows))
        except OSError as e:
            self.notify(f"cannot write {path}: {e.strerror or e}", severity="error")
            return
        # the file's name on a line of its own: a toast is ~40 columns wide at 80x24
        self.notify(f"wrote {len(rows)} rows to\n{path}")

    # -- the window of a long trace ----------------------------------------------------------
    def action_window(self, k: int) -> None:
        tr = self.tr
        w = tr.window
        if not w:
            self.notify("the whole trace is shown (no window)")
            return
        if self._reloading:
            return
        lo, n = tr.window_offset, tr.n
        if (k < 0 and lo == 0) or (k > 0 and lo + n >= tr.n_total):
            self.notify("no events " + ("before" if k < 0 else "after") + " this window")
            return
        at = max(0, min(tr.n_total - 1, lo + n // 2 + k * n))
        self._reloading = True
        self.chart.loading = True
        self.notify(f"reading events around {at:,} (the file is read again)")
        snap, dev = self.snap, tr.device
        args = getattr(snap, "open_args", {})

        def work() -> None:
            from gpumon.snapshot import SnapshotError, open_snapshot
            try:
                new = open_snapshot(snap.path, max_bytes=args.get("max_bytes"),
                                    window=w["length"], window_at=at,
                                    window_total=tr.n_total)
                new.trace(dev)
            except (SnapshotError, OSError, MemoryError) as e:
                self._from_thread(self._window_failed, str(e))
                return
            self._from_thread(self._swap_snapshot, new, at)
        self._background(work, "window")

    @staticmethod
    def _background(work, name: str) -> None:
        """Run `work` on a daemon thread of its own. Textual's thread workers run in an
        executor whose threads the interpreter joins at exit: q while a window of a long file
        was being read waited 12 s for the read to end."""
        import threading
        threading.Thread(target=work, name=f"gpumon-view-{name}", daemon=True).start()

    def _from_thread(self, fn, *args) -> None:
        """call_from_thread, unless the app has already gone (q while the work ran)."""
        try:
            self.call_from_thread(fn, *args)
        except RuntimeError:
            pass

    def _window_failed(self, msg: str) -> None:
        self._reloading = False
        self.chart.loading = False
        self.notify(f"cannot read the window: {msg}", severity="error")

    def _swap_snapshot(self, snap, at: int) -> None:
        """Show another window of the same file: every pane follows."""
        old = self.tr.window
        self.snap = snap
        tr = self.tr = snap.trace(self.tr.device)
        if tr.window and old and tr.window.get("peak_index", -1) < 0:
            tr.window["peak_index"] = old["peak_index"]  # the first pass was not run again
        self.oom = report.oom_info(snap, tr.device)
        chart = self.chart
        chart.trace = tr
        chart.steps = snap.step_boundaries(tr.device)
        chart.phases = snap.phase_spans(tr.device)
        chart.oom_event = self.oom["event"] if self.oom else -1
        chart.lo, chart.hi = 0, max(1, tr.n)
        chart.set_cursor(at - tr.window_offset)
        self.query_one("#head", Static).update(head_text(snap, tr,
                                                         width=max(20, self.size.width - 2)))
        self._allocs_for = self._segs_for = None
        for tab in ("summary", "leaks"):
            if self._built.get(tab):
                self._fill_text_tab(tab)
        self._reloading = False
        chart.loading = False
        self._cursor_moved()

    def action_move(self, k: int) -> None:
        if self.focused is not None and self.focused.id in ("search", "seg-table", "alloc-tree"):
            return  # their own left/right
        self.chart.move_cols(k)
        self._cursor_moved()

    def action_step_event(self, k: int) -> None:
        self.chart.set_cursor(self.chart.cursor + k)
        self._cursor_moved()

    def action_jump(self, where: str) -> None:
        tr = self.tr
        target = {"start": 0, "end": tr.n - 1, "peak": tr.peak_index,
                  "oom": self.oom["event"] if self.oom else -1}[where]
        if target < 0:
            self.notify(f"no {where} event in this trace")
            return
        self.chart.set_cursor(target)
        self._cursor_moved()

    def action_step(self, k: int) -> None:
        bounds = [e for e, _ in self.snap.step_boundaries(self.tr.device)]
        cur = self.chart.cursor
        nxt = [e for e in bounds if e > cur] if k > 0 else [e for e in bounds if e < cur]
        if not nxt:
            self.notify("no further optimizer step" if bounds else
                        "no optimizer-step annotations in this snapshot")
            return
        self.chart.set_cursor(nxt[0] if k > 0 else nxt[-1])
        self._cursor_moved()

    def action_zoom(self, factor: float) -> None:
        self.chart.zoom(factor)
        self._update_event_line()

    async def action_search(self) -> None:
        self.query_one("#tabs", TabbedContent).active = "allocs"
        if not await self._build("allocs"):
            return
        box = self.query_one("#search")
        box.add_class("shown")
        box.focus()

    def action_close_search(self) -> None:
        if not self._built.get("allocs"):
            return
        box = self.query_one("#search")
        if box.has_class("shown"):
            box.remove_class("shown")
            box.value = ""
            self.query_text = ""
            self._fill_allocs()
            self.query_one("#alloc-tree").focus()

    def on_input_submitted(self, event) -> None:  # Input.Submitted (Input is imported lazily)
        self.query_text = event.value.strip()
        self._fill_allocs()
        self.query_one("#alloc-tree").focus()

    # -- content ---------------------------------------------------------------------------
    def _update_event_line(self) -> None:
        w = max(20, self.size.width - 2)  # the event box spans the screen, padding 1 a side
        self.query_one("#event", Static).update(
            event_text(self.snap, self.tr, self.chart.cursor, w))

    def on_resize(self, event) -> None:
        self.query_one("#head", Static).update(head_text(self.snap, self.tr,
                                                         width=max(20, event.size.width - 2)))
        self._update_event_line()

    def _fill_allocs(self) -> None:
        i = self.chart.cursor if self.tr.n else -1
        key = (i, self.query_text, self.group_by)
        if self._allocs_for == key:
            return
        self._allocs_for = key
        tr = self.tr
        groups = tr.groups_at(i, self.query_text, self.group_by)
        total = tr.allocated_at(i)
        shown = sum(g.bytes for g in groups)
        q = f", matching '{self.query_text}': {fmt_bytes(shown)}" if self.query_text else ""
        self.query_one("#alloc-head", Static).update(
            f"live at event {i + tr.window_offset:,}: {fmt_bytes(total)} in {sum(g.count for g in groups):,} "
            f"allocations{q}, by {self.group_by}  (enter expands, / search, g group, "
            "e export)")
        tree = self.query_one("#alloc-tree")
        tree.clear()
        tree.root.expand()
        tree.show_root = False
        sz = tr.el_size
        for g in groups[:500]:
            share = 100 * g.bytes / total if total else 0
            node = tree.root.add(Text(f"{fmt_bytes(g.bytes):>11} {share:3.0f}% {g.count:>5}x  "
                                      f"{g.key}"), data=("group", g))
            for j in g.elements[:200]:
                node.add_leaf(Text(f"{fmt_bytes(sz[j]):>11}  0x{tr.el_addr[j]:x}"), data=("el", j))
            if len(g.elements) > 200:
                node.add_leaf(Text(f"... {len(g.elements) - 200} more"), data=None)
        if groups:
            self._show_stack(("group", groups[0]))
        else:
            self.query_one("#stack-text", Static).update("nothing live here" if not q else
                                                         "no live allocation matches")

    def on_tree_node_highlighted(self, event) -> None:  # Tree.NodeHighlighted
        if event.node.data:
            self._show_stack(event.node.data)

    def _show_stack(self, data) -> None:
        self._stack_data = data
        kind, v = data
        lines = stack_lines(self.tr, kind, v, self.full_frames)
        tr = self.tr
        j = v.elements[0] if kind == "group" else v
        start = tr.el_start[j]
        if tr.module_index is not None and start >= 0:  # the sidecar's module enter/leave
            lines = [*lines[:2], "module stack:",
                     *("  " + x for x in tr.module_index.stack_lines(start)), *lines[2:]]
        self.query_one("#stack-text", Static).update("\n".join(lines))

    def _fill_segments(self) -> None:
        """The allocator's segments at the cursor (rebuilt back from the dump)."""
        tr = self.tr
        i = self.chart.cursor if tr.n else -1
        if self._segs_for == i:
            return
        self._segs_for = i
        infos = tr.segments_at(i)
        t = tr.segment_totals(infos)
        at = "at the dump" if not tr.n or i >= tr.n - 1 and not tr.window \
            else f"at event {i + tr.window_offset:,}"
        fits = ""
        if self.oom:
            req = self.oom["requested"]
            fits = (f"\na request of the OOM's {fmt_bytes(req)} "
                    + ("would fit in a cached block here" if t["largest_free_block"] >= req
                       else "would need a new segment (no cached block is large enough)"))
        empty = (f", {t['empty_segments']} empty ({fmt_bytes(t['empty_segments_bytes'])}, "
                 "empty_cache() returns them)" if t["empty_segments"] else "")
        self.query_one("#seg-head", Static).update(
            f"{at}: {t['segments']} segments{empty}, reserved {fmt_bytes(t['reserved'])}, "
            f"allocated {fmt_bytes(t['allocated'])}, cached free {fmt_bytes(t['free'])}, "
            f"largest free block {fmt_bytes(t['largest_free_block'])}, fragmentation "
            f"{100 * t['fragmentation']:.0f}% (holes in used segments){fits}")
        table = self.query_one("#seg-table")
        table.clear()
        for s in infos[:5000]:
            use = 100 * s.allocated / s.total if s.total else 0
            table.add_row(f"0x{s.address:x}", fmt_bytes(s.total), fmt_bytes(s.allocated),
                          fmt_bytes(s.free), fmt_bytes(s.largest_free), f"{use:.0f}%",
                          str(s.blocks), s.pool + (" exp" if s.expandable else ""))

    def _oom_text(self) -> str:
        return oom_text(self.oom)


def run_view_app(snap: Snapshot, device: int | None = None, no_color: bool = False,
                 keys: list[str] | None = None, view: tuple[int, int, int] | None = None,
                 show_reserved: bool | None = None) -> int:
    """Run the app; `keys` (typed while the plain first frame was up, not acted on there) are
    pressed once it is on screen; `view` and `show_reserved`: where the plain frame's keys
    left the timeline (the app starts there)."""
    app = ViewApp(snap, device, no_color=no_color)
    app.start_view, app.start_show_reserved = view, show_reserved
    if keys:
        app.pending_keys = list(keys)
    app.run()
    raise_if_interrupted(app)
    return 0
