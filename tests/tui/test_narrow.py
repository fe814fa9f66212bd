"""80x24 is a first-class size: the footer keeps help and quit, the top bar keeps its help key,
labels abbreviate instead of being cut; the help is built from the live bindings (a key
remapped with GPUMON_KEYS shows as remapped) and an unknown binding id is one warning line."""
import io
import pickle

from rich.console import Console
from textual.widgets import Footer
from fakes import CLIENT_ID, T0, FakeConnection, FakeTarget, hello, history

from gpumon.snapshot import Snapshot
from gpumon.snapshot.synth import training_snapshot
from gpumon.tui.attach_app import AttachApp, TopBar
from gpumon.tui.keys import HelpScreen, parse_keymap
from gpumon.tui.view.app import ViewApp
from test_app import until, pane


def _attach():
    return AttachApp(FakeTarget(FakeConnection(hello(), history(300))), fps=20,
                     clock=lambda: T0 + 40, client_id=CLIENT_ID)


def _view():
    data, _ = training_snapshot(steps=3, layers=4, max_entries=400, seed=3)
    return ViewApp(Snapshot(pickle.loads(pickle.dumps(data)), "/runs/train.pickle"))


def _screen_text(app) -> str:
    """What the terminal shows, as plain text lines."""
    return app.export_screenshot()  # SVG: search it for the words instead of pixels


def _footer_keys(app) -> list[str]:
    """The footer's keys that are inside the screen's width (what the user sees)."""
    width = app.size.width
    seen = []
    for key in app.query_one(Footer).query("FooterKey"):
        r = key.region
        if r.width and r.x + r.width <= width:
            seen.append(key.description)
    return seen


def _plain(widget) -> str:
    con = Console(width=widget.content_size.width or 40, file=io.StringIO(), color_system=None)
    con.print(widget.render())
    return con.file.getvalue()


async def test_attach_at_80x24_keeps_help_quit_and_whole_labels():
    app = _attach()
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 300)
        # the footer is laid out after the first frames; under load that takes a while
        await until(pilot, lambda: len(_footer_keys(app)) >= 3)
        keys = _footer_keys(app)
        assert "Help" in keys and "Quit" in keys and "Breakdown" in keys, keys
        top = app.query_one(TopBar).render().plain
        assert "? help" in top[:80], top
        # the figures' labels follow the pane's width, which under load settles a frame late
        await until(pilot, lambda: "inact. split" in _plain(pane(app).figures))
        figures = _plain(pane(app).figures)
        assert "…" not in figures, figures
        assert "inact. split" in figures and "alloc retry" in figures


async def test_the_sampling_cost_fits_at_80x24():
    """The figures' third column has 10 cells at 80x24: a real sampling cost (136 µs, seen in
    the demo) was cut to "cost 136 …", and after 17 minutes of the demo "free 19,3…"."""
    for cost, frees, want in ((136.4, 19_312, ("cost 136µs", "free 19.3k")),
                              (2345.0, 20, ("cost 2.3ms", "free 20"))):
        hist = history(300)
        for smp in hist[0]["samples"]:
            smp["cost_us"] = cost
            smp["devices"][0]["device_free"] = frees
        app = AttachApp(FakeTarget(FakeConnection(hello(), hist)), fps=20,
                        clock=lambda: T0 + 40, client_id=CLIENT_ID)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.panes and pane(app).proc.samples == 300)
            await until(pilot, lambda: "sample rate" in _plain(pane(app).figures))
            figures = _plain(pane(app).figures)
            assert all(w in figures for w in want) and "…" not in figures, figures


async def test_attach_footer_at_80x24_ends_with_the_palette_key_not_a_stray_letter():
    """The compact footer's palette key is docked at the right edge: the last cell is its own,
    not a letter of the key scrolled behind it (it showed "palettes": the "s" of "Reset")."""
    from textual.widgets._footer import FooterKey
    app = _attach()
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 300)
        await until(pilot, lambda: len(_footer_keys(app)) >= 3)
        palette = app.query_one("FooterKey.-command-palette", FooterKey)
        assert palette.region.right == 80, palette.region
        widget, _ = app.screen.get_widget_at(79, 23)
        assert widget is palette, widget
        # what the terminal shows on the last line ends with the key, nothing after it
        line = "".join(seg.text for seg in app.screen._compositor.render_strips()[23])
        assert line.rstrip().endswith("^p palette"), repr(line)
        # and no key is cut under it ("- Zo" of "- Zoom out"): each is whole or not shown
        shown = [k for k in app.query_one(Footer).query(FooterKey)
                 if not k.has_class("-command-palette")]
        assert 3 <= len(shown) < len(app.BINDINGS)
        for k in shown:
            assert k.region.right <= palette.region.x, (k.description, k.region, palette.region)
            assert f"{k.key_display} {k.description}" in line.replace("\xa0", " "), k.description
        await pilot.resize_terminal(200, 30)  # wide again: every key that is shown
        # (waited for as such: under load the footer's last keys were laid out a frame later)
        await until(pilot, lambda: {"Reset peaks", "Zoom out"} <= set(_footer_keys(app)))
        assert len(_footer_keys(app)) >= 8


async def test_attach_header_at_80x24_keeps_the_source_before_a_long_device_name():
    """The process header's second line ended "... 24.0 GiB  source:" at 80 columns (the
    value cut off): narrow, the source (and a recording) come before the device's name."""
    app = _attach()
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 300)
        p = pane(app)
        p.proc.devices[0].name = "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
        p.header.update_if_changed()
        await pilot.pause(0.1)
        lines = _plain(p.header).splitlines()
        second = lines[1][:p.header.content_size.width]
        assert "simulated" in second and "running" in second, second
        assert "cuda:0 NVIDIA" in second, second


async def test_attach_help_follows_remapped_keys_and_warns_of_unknown_ids(monkeypatch):
    monkeypatch.setenv("GPUMON_KEYS", "pause=P,nosuch=x,broken")
    app = _attach()
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.panes)
        warnings = [n.message for n in app._notifications if n.severity == "warning"]
        assert len(warnings) == 1 and "'nosuch=x'" in warnings[0] and "'broken'" in warnings[0]
        assert "pause" in warnings[0]  # names the ids that exist
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = app.help_text()
        line = next(ln for ln in text.splitlines() if "pause / resume" in ln)
        assert line.split()[0] == "P" and "[pause]" in line, line
        assert not any(ln.split()[:1] == ["p"] for ln in text.splitlines())
        # every key's text starts in one column, the palette's key (not a binding) included
        cols = {ln.index(t) for ln in text.splitlines()
                for t in ("pause / resume", "this help", "command palette") if t in ln}
        assert len(cols) == 1, text
        await pilot.press("escape")
        await pilot.press("P")
        assert app.paused_at is not None


async def test_view_has_a_help_screen_from_its_bindings(monkeypatch):
    monkeypatch.setenv("GPUMON_KEYS", "view.peak=P")
    app = _view()
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: len(_footer_keys(app)) >= 3)
        keys = _footer_keys(app)
        assert "help" in keys and "quit" in keys, keys
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = app.help_text()
        peak = next(ln for ln in text.splitlines() if "to the peak" in ln)
        assert peak.split()[0] == "P" and "[view.peak]" in peak
        assert "[view.quit]" in text and "enter" in text
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_key_lines_of_both_helps_fit_80_columns():
    from textual.markup import to_content
    from gpumon.tui import attach_app
    from gpumon.tui.keys import help_lines
    from gpumon.tui.view import app as view_app
    for app, table in ((_attach(), attach_app.KEY_HELP), (_view(), view_app.KEY_HELP)):
        async with app.run_test(size=(80, 24)):
            lines = help_lines(app, app.BINDINGS, table)
            assert len(lines) == len(table)
            for ln in lines:
                assert len(to_content(ln).plain) <= 76, ln  # inside the box's border


async def test_every_line_of_both_helps_fits_the_box_at_80x24():
    """The help's prose (the chart, the figures) wrapped at 80 columns without its indent:
    "optimizer, ...) when the" began a line of its own. Each line fits the box as shown."""
    from textual.markup import to_content
    for app in (_attach(), _view()):
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("question_mark")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen))
            await pilot.pause(0.1)
            box = app.screen.query_one("#help-text")
            width = box.content_size.width
            assert 70 <= width <= 76, width
            long = [ln for ln in app.help_text().splitlines()
                    if len(to_content(ln).plain) > width]
            assert not long, (width, long)


def test_parse_keymap_keeps_known_ids_and_names_the_rest():
    keymap, warning = parse_keymap(" pause=P , quit=x", ["pause", "quit"])
    assert keymap == {"pause": "P", "quit": "x"} and warning is None
    keymap, warning = parse_keymap("pause=P,zoom=z,=q,quit=", ["pause", "quit"])
    assert keymap == {"pause": "P"}
    assert warning.count("\n") == 0 and "'zoom=z'" in warning and "'quit='" in warning
    assert parse_keymap(None, ["pause"]) == ({}, None)


async def test_a_slow_snapshot_stop_shows_progress_until_it_is_written():
    import threading
    from test_app import SNAP_CMDS
    release = threading.Event()

    def start(args):
        return {"recording": True, "since": T0 + 2.0}

    def stop(args):
        release.wait(20)  # the agent symbolising stacks
        return {"ok": True, "path": "/run/snapshot-1.pickle"}

    c = FakeConnection(hello(commands=SNAP_CMDS), history(50),
                       handlers={"snapshot_start": start, "snapshot_stop": stop,
                                 "snapshot_status": lambda a: {"recording": False}})
    app = AttachApp(FakeTarget(c), fps=20, clock=lambda: T0 + 40, client_id=CLIENT_ID)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 50)
        busy = app.query_one("#busy")
        assert busy.has_class("hidden")
        await pilot.press("s")
        await until(pilot, lambda: pane(app).proc.recording.active)
        await pilot.press("s")
        await until(pilot, lambda: not busy.has_class("hidden"))
        assert "writing the snapshot" in str(app.query_one("#busy-text").render())
        release.set()
        await until(pilot, lambda: busy.has_class("hidden"))
        assert pane(app).proc.recording.last_path == "/run/snapshot-1.pickle"


def _footer_line(app) -> str:
    """The terminal's last line as text."""
    row = app.size.height - 1
    return "".join(seg.text for seg in app.screen._compositor.render_strips()[row]).replace(
        "\xa0", " ")


def _no_key_cut(app) -> None:
    """Each footer key is whole, left of the palette's key, or not shown: only its blank last
    cell (margin or padding) may lie under the palette's border."""
    from textual.widgets._footer import FooterKey
    palette = app.query_one("FooterKey.-command-palette", FooterKey)
    line = _footer_line(app)
    for k in app.query_one(Footer).query(FooterKey):
        if k is not palette:
            assert k.region.right - 1 <= palette.region.x, (k.description, k.region,
                                                            palette.region)
            assert f"{k.key_display} {k.description}" in line[:palette.region.x], (k, line)


async def test_remapped_help_and_quit_stay_in_the_attach_footer_at_80x24(monkeypatch):
    """A key remapped with GPUMON_KEYS moved to the end of Textual's binding map, and the
    80-column footer, which keeps what fits from the left, lost help and quit."""
    monkeypatch.setenv("GPUMON_KEYS", "quit=x,help=h")
    app = _attach()
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 300)
        await until(pilot, lambda: len(_footer_keys(app)) >= 3)
        await pilot.pause(0.1)
        keys = _footer_keys(app)
        assert keys[:2] == ["Help", "Quit"], keys
        line = _footer_line(app)
        assert line.startswith("h Help x Quit "), line
        _no_key_cut(app)


async def test_view_footer_at_80x24_keeps_remapped_help_and_quit_and_cuts_no_key(monkeypatch):
    """The view used Textual's plain footer: at 80 columns it ended "- z" (of "- zoom out"), and
    with GPUMON_KEYS remapping quit and help, neither was on it."""
    monkeypatch.setenv("GPUMON_KEYS", "view.quit=x,view.help=h")
    app = _view()
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: len(_footer_keys(app)) >= 3)
        await pilot.pause(0.1)
        keys = _footer_keys(app)
        assert keys[:2] == ["quit", "help"], keys
        line = _footer_line(app)
        assert line.lstrip().startswith("x quit  h help "), line
        assert line.rstrip().endswith("^p palette"), line
        _no_key_cut(app)
        await pilot.resize_terminal(200, 30)  # wide: every key the app shows
        await until(pilot, lambda: "zoom out" in _footer_keys(app))
        assert "search" in _footer_keys(app)


async def test_the_view_palette_lists_its_keys_with_their_binding_ids(monkeypatch):
    """The view's command palette had only Textual's own commands ("peak": no matches)."""
    monkeypatch.setenv("GPUMON_KEYS", "view.peak=P")
    app = _view()
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.tr is not None)
        cmds = {c.title: c for c in app.get_system_commands(app.screen)}
        peak = cmds["To the peak"]
        assert peak.help.startswith("P (id view.peak)"), peak.help
        assert "Quit" in cmds  # Textual's own stay
        app.chart.set_cursor(0)
        before = app.chart.cursor
        peak.callback()
        await pilot.pause(0.2)
        assert app.chart.cursor != before and app.chart.cursor == app.tr.peak_index, (
            before, app.chart.cursor)


async def test_the_breakdown_at_80x24_shows_advice_and_steps_in_the_charts_place():
    """At 80x24 `b` put the breakdown under the chart in half the pane: the roles showed, the
    advice and the step table never did. Below 40 rows it takes the chart's place, and
    pagedown brings the step table on screen; at 200x60 it stays beside the chart."""
    from test_app import _breakdown_events, make_app
    ev = _breakdown_events()
    c = FakeConnection(hello(), history(20) + ev + [dict(ev[1], step=n) for n in range(3, 12)])
    app = make_app(c)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.breakdown.main_device())
        p = pane(app)
        await pilot.press("b")
        await until(pilot, lambda: p.breakdown is not None and p.breakdown.is_mounted)
        steps = p.breakdown.query_one("#bd-steps")
        await until(pilot, lambda: steps.row_count == 10)
        await pilot.pause(0.2)
        assert not p.query_one(".body").display or p.query_one(".body").region.height == 0
        assert p.extras.region.height >= 15, p.extras.region  # the pane, less its header
        await pilot.press("pagedown", "pagedown", "pagedown")
        await pilot.pause(0.2)
        visible = steps.region.intersection(p.extras.region)
        assert visible.height >= 3, (steps.region, p.extras.region)  # its head and steps
        await pilot.press("b")  # off: the chart is back
        await pilot.pause(0.2)
        assert p.query_one(".body").region.height > 10
        await pilot.resize_terminal(200, 60)
        await pilot.press("b")
        await pilot.pause(0.3)
        assert p.query_one(".body").region.height > 10  # tall: chart and breakdown together
        assert steps.region.intersection(app.screen.region).height >= 3


async def test_quitting_as_the_first_pane_arrives_is_quiet():
    """Closing the view while its first tab was being added (q pressed as the program's first
    sample came) raised Textual's "No Tab with id" out of the app: the tab was gone before it
    was activated. 10 tries, each closed right after start (the old code failed ~half)."""
    for _ in range(10):
        app = _attach()
        async with app.run_test(size=(80, 24)):
            pass  # closed at once, while the first pane mounts
        assert app.return_code in (0, None), app.return_code
