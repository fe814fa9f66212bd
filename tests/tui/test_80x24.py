"""80x24 is first-class (issue 32 item 9): on each screen the facts a user looks for are whole
on an 80x24 terminal: the step table's optimizer and zero_grad times, the snapshot's path after
its toast has gone, the top bar after `y`, the header while recording, and toasts that leave
the figures' panel alone. (The help's scroll hint and diff --tui's where column: below and in
test_interrupt_screens.py.)"""
from textual.app import App, ComposeResult
from textual.widgets import DataTable
from fakes import CLIENT_ID, T0, FakeConnection, FakeTarget, hello, history

from gpumon.model.breakdown import BreakdownModel
from gpumon.tui.attach_app import AttachApp, TopBar
from gpumon.tui.widgets.breakdown import BreakdownView
from gpumon.tui.widgets.panels import FiguresPanel

from .test_interrupt_screens import SNAP_CMDS, until

PATH = "/scratch/alice/runs/gpumon-snapshots/4242-20261206-101500/rank0-snapshot-1-101512.pickle"


def _app(conn):
    return AttachApp(FakeTarget(conn), fps=20, clock=lambda: T0 + 40, client_id=CLIENT_ID)


def _recording_conn():
    def start(args):
        return {"recording": True, "since": T0 + 30}

    def stop(args):
        c.feed({"type": "event", "kind": "snapshot", "ok": True, "path": PATH})
        return {"ok": True, "path": PATH}
    c = FakeConnection(hello(commands=SNAP_CMDS), history(100), handlers={
        "snapshot_start": start, "snapshot_stop": stop,
        "snapshot_status": lambda a: {"recording": False}})
    return c


async def test_top_bar_after_y_and_header_while_recording_fit_80_columns():
    app = _app(_recording_conn())
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.panes)
        await pilot.press("y")
        top = app.query_one(TopBar).render().plain
        assert top.endswith("y: capacity") and len(top) <= 80, top
        await pilot.press("p")  # paused as well: the longest bar
        await pilot.pause()
        top = app.query_one(TopBar).render().plain
        assert "PAUSED" in top and top.endswith("y: capacity") and len(top) <= 80, top
        await pilot.press("s")
        pane = next(iter(app.panes.values()))
        await until(pilot, lambda: "REC" in pane.header.render().plain)
        second = pane.header.render().plain.splitlines()[1]
        assert "REC" in second and "by you" in second and "cuda:0" in second
        assert len(second) <= 80 and second.rstrip().endswith("GiB"), second  # whole


async def test_the_snapshot_path_stays_on_screen_after_its_toast():
    app = _app(_recording_conn())
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.panes)
        await pilot.press("s")
        pane = next(iter(app.panes.values()))
        await until(pilot, lambda: pane.proc.recording.active)
        await pilot.press("s")
        notice = app.query_one("#notice")
        await until(pilot, lambda: "saved:" in str(notice.render()))
        app.clear_notifications()  # the toast is gone...
        await pilot.pause()
        line = str(notice.render())  # ...the path is still there, its file name whole
        assert line.startswith("saved: ") and line.endswith("rank0-snapshot-1-101512.pickle")
        assert len(line) <= 78 and not notice.has_class("hidden")


async def test_toasts_leave_the_figures_panel_visible():
    app = _app(FakeConnection(hello(), history(100)))
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await until(pilot, lambda: app.panes)
        app.notify("a long message that wraps over several lines of the toast at 80 columns",
                   timeout=30)
        await until(pilot, lambda: app.query("Toast"))
        await pilot.pause(0.2)
        toast = app.query("Toast").first()
        figures = app.query_one(FiguresPanel).region
        assert toast.region.x == 0  # bottom left, over the chart's oldest seconds
        assert not toast.region.overlaps(figures), (toast.region, figures)


class One(App):
    def compose(self) -> ComposeResult:
        yield BreakdownView()


async def test_the_step_table_shows_every_phase_time_at_80_columns():
    m = BreakdownModel()
    phases = {p: {"time_s": t, "count": 1} for p, t in (
        ("data", 0.05), ("forward", 0.4), ("backward", 0.35), ("optimizer", 0.15),
        ("zero_grad", 0.05))}
    m.feed({"type": "event", "kind": "step", "step": 147, "time_s": 1.0, "phases": phases,
            "peak": 4 << 30, "peak_phase": "forward", "peak_exact": True, "devices": []})
    app = One()
    async with app.run_test(size=(80, 24)) as pilot:
        v = app.query_one(BreakdownView)
        v.update_model(m)
        await pilot.pause()
        t = app.query_one("#bd-steps", DataTable)
        cells = [str(c) for c in t.get_row_at(0)]
        assert cells[-1] == "d50 f400 b350 o150 z50", cells
        width = sum(c.get_render_width(t) for c in t.columns.values())
        assert width <= 80, width  # the optimizer and zero_grad times are on screen
        assert "o150" in app.export_screenshot() and "z50" in app.export_screenshot()


async def test_the_footer_offers_pgdn_while_the_breakdown_goes_on_below():
    """A new user at 80x24 never found the steps under `b`: PgDn was in no footer. It shows
    while more of the breakdown lies below, and goes when the end is reached or b hides it."""
    from test_app import _breakdown_events
    ev = _breakdown_events()
    c = FakeConnection(hello(), history(20) + ev + [dict(ev[1], step=n) for n in range(3, 12)])
    app = _app(c)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.panes)

        def footer() -> str:  # the keys the footer shows, in order
            return " ".join(f"{w.key_display} {w.description}" for w in app.query("FooterKey"))
        assert "PgDn" not in footer()
        await pilot.press("b")
        await until(pilot, lambda: "PgDn" in footer())
        assert footer().index("Breakdown") < footer().index("PgDn")  # beside b, not cut off
        for _ in range(12):
            await pilot.press("pagedown")
        await until(pilot, lambda: "PgDn" not in footer())  # the end: nothing below
        await pilot.press("pageup")
        await until(pilot, lambda: "PgDn" in footer())
        await pilot.press("b")
        await until(pilot, lambda: "PgDn" not in footer())
