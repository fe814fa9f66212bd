"""Pilot tests of the attach app over scripted connections: every key, exit, a second
process, resize, several ranks with one dead."""
import asyncio
import io

from rich.console import Console
from fakes import CLIENT_ID, T0, FakeConnection, FakeTarget, hello, history, sample

from gpumon.model.process import State
from gpumon.tui.attach_app import (NO_SNAPSHOT, ZOOMS, AttachApp, DevicePane, HelpScreen,
                                   OverviewPane, TopBar)

SNAP_CMDS = ("ping", "reset_peaks", "set_rate", "status", "snapshot_start", "snapshot_stop",
             "snapshot_status")


def make_app(*conns, target=None, **kw):
    kw.setdefault("clock", lambda: T0 + 40)
    kw.setdefault("client_id", CLIENT_ID)
    kw.setdefault("fps", 20)
    return AttachApp(target or FakeTarget(*conns), **kw)


async def until(pilot, cond, timeout=15.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.02)


def notes(app):
    return [n.message for n in app._notifications]


def pane(app, i=0) -> DevicePane:
    return list(app.panes.values())[i]


def plain(widget):
    con = Console(width=widget.content_size.width or 40, file=io.StringIO(), color_system=None)
    con.print(widget.render())
    return con.file.getvalue()


def braille(text):
    return sum(0x2800 < ord(ch) <= 0x28FF for ch in text)


def chart_text(p):
    return "\n".join(s.text for s in p.chart._strips)


async def test_first_screen_shows_source_figures_and_history():
    c = FakeConnection(hello(), history(300))
    app = make_app(c)
    async with app.run_test(size=(120, 36)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 300)
        await until(pilot, lambda: braille(chart_text(pane(app))) > 50)
        top = app.query_one(TopBar).render().plain
        assert "source: simulated" in top and "not a GPU" in top
        head = pane(app).header.render().plain
        assert "pid 1234" in head and "running" in head and "python train.py" in head
        figs = plain(pane(app).figures)
        for label in ("allocated", "reserved", "active", "res - alloc", "inactive split",
                      "NVML process", "non-PyTorch", "device free", "alloc retries", "OOMs",
                      "allocator", "sample rate", "delay", "expandable_segments:True"):
            assert label in figs, label
        assert "GiB" in chart_text(pane(app)) and "now" in chart_text(pane(app))


async def test_snapshot_key_without_snapshot_commands_says_so():
    c = FakeConnection(hello(), history(50))
    app = make_app(c)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.panes)
        await pilot.press("s")
        await until(pilot, lambda: any(NO_SNAPSHOT in m for m in notes(app)))
        assert c.requests == []


async def test_snapshot_start_stop_and_recording_marker():
    def start(args):
        c.feed({"type": "event", "kind": "recording", "state": "started", "by": CLIENT_ID,
                "since": T0 + 2.0})
        return {"recording": True, "since": T0 + 2.0}

    def stop(args):
        c.feed({"type": "event", "kind": "recording", "state": "stopped", "by": CLIENT_ID,
                "since": T0 + 2.0, "until": T0 + 4.0, "path": "/run/snapshot-1.pickle"},
               {"type": "event", "kind": "snapshot", "ok": True,
                "path": "/run/snapshot-1.pickle"})
        return {"ok": True, "path": "/run/snapshot-1.pickle"}

    c = FakeConnection(hello(commands=SNAP_CMDS), history(50),
                       handlers={"snapshot_start": start, "snapshot_stop": stop,
                                 "snapshot_status": lambda a: {"recording": False}})
    app = make_app(c)
    async with app.run_test(size=(120, 36)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 50)
        await pilot.press("s")
        await until(pilot, lambda: pane(app).proc.recording.active)
        await until(pilot, lambda: "REC" in pane(app).header.render().plain)
        assert "by you" in pane(app).header.render().plain
        await until(pilot, lambda: "┃" in chart_text(pane(app)))
        await pilot.press("s")
        await until(pilot, lambda: any("/run/snapshot-1.pickle" in m for m in notes(app)))
        # kept for after the view: its toast goes with the screen (run_attach prints these)
        assert app.saved == ["pid 1234: snapshot saved: /run/snapshot-1.pickle"], app.saved
        assert [r[0] for r in c.requests] == ["snapshot_status", "snapshot_start",
                                              "snapshot_stop"]
        assert not pane(app).proc.recording.active
        await until(pilot, lambda: "┆" in chart_text(pane(app)))


async def test_snapshot_while_another_client_records_says_who_and_since():
    c = FakeConnection(hello(commands=SNAP_CMDS), history(50) + [
        {"type": "event", "kind": "recording", "state": "started", "by": "pid:777",
         "who": "bob@node1", "since": T0 + 1.0}],
        handlers={"snapshot_status": lambda a: {"recording": True, "by": "pid:777"}})
    app = make_app(c)
    async with app.run_test(size=(120, 36)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.recording.active)
        await pilot.press("s")
        await until(pilot, lambda: any("already recording" in m for m in notes(app)))
        msg = [m for m in notes(app) if "already recording" in m][0]
        assert "bob@node1" in msg and "39s ago" in msg
        assert "snapshot_start" not in [r[0] for r in c.requests]
        assert "bob@node1" in pane(app).header.render().plain


async def test_reset_peaks_key():
    c = FakeConnection(hello(), history(100), handlers={"reset_peaks": lambda a: {}})
    app = make_app(c)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 100)
        s = pane(app).proc.devices[0].series["allocated"]
        assert s.peak > s.last
        await pilot.press("r")
        await until(pilot, lambda: ("reset_peaks", {}) in c.requests)
        await until(pilot, lambda: s.peak == s.last)
        assert any("peaks reset" in m for m in notes(app))


async def test_command_error_is_one_line_on_screen():
    def boom(args):
        raise RuntimeError("agent says no")
    c = FakeConnection(hello(), history(10), handlers={"reset_peaks": boom})
    app = make_app(c)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.panes)
        await pilot.press("r")
        await until(pilot, lambda: any("agent says no" in m for m in notes(app)))


async def test_pause_keeps_receiving_and_freezes_window():
    c = FakeConnection(hello(), history(100))
    app = make_app(c)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 100)
        await pilot.press("p")
        assert app.paused_at == pane(app).proc.last_t
        assert "PAUSED" in app.query_one(TopBar).render().plain
        frozen = chart_text(pane(app))
        c.feed(*[sample(i) for i in range(100, 200)])
        await until(pilot, lambda: pane(app).proc.samples == 200)
        await pilot.pause(0.2)
        assert chart_text(pane(app)) == frozen  # the window did not move
        await pilot.press("p")
        assert app.paused_at is None
        await until(pilot, lambda: chart_text(pane(app)) != frozen)


async def test_zoom_keys_walk_from_30s_to_whole_run():
    c = FakeConnection(hello(), history(100))
    app = make_app(c)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.panes)
        for _ in range(len(ZOOMS) + 2):
            await pilot.press("minus")
        assert ZOOMS[app.zoom] is None
        assert "whole run" in app.query_one(TopBar).render().plain
        for _ in range(len(ZOOMS) + 2):
            await pilot.press("plus")
        assert ZOOMS[app.zoom] == 30
        assert "-30s" not in chart_text(pane(app)) or True
        await until(pilot, lambda: "window 30 s" in app.query_one(TopBar).render().plain)


async def test_y_scale_key_shows_capacity_line():
    c = FakeConnection(hello(), history(100))
    app = make_app(c)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).chart._strips)
        await pilot.press("y")
        assert app.y_capacity
        await until(pilot, lambda: "80 GiB" in chart_text(pane(app)))


async def test_help_screen_and_quit():
    c = FakeConnection(hello(), history(10))
    app = make_app(c)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.panes)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        # every key that opens it is listed (a new user pressed h, which the help left out)
        text = app.help_text()
        assert text.startswith("[b]gpumon attach: keys[/b]")
        assert any(line.split()[:1] == ["?/h/f1"] and "this help" in line
                   for line in text.splitlines()), text[:600]
        await pilot.press("h")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        app.demo = True  # `gpumon demo` says its own name
        assert app.help_text().startswith("[b]gpumon demo: keys[/b]")
        app.demo = False
        await pilot.press("q")
        await until(pilot, lambda: app._exit_renderables is not None or not app.is_running)
    assert app.return_code == 0
    assert c.closed.is_set()


async def test_keys_can_be_remapped_by_binding_id(monkeypatch):
    monkeypatch.setenv("GPUMON_KEYS", "pause=P")
    c = FakeConnection(hello(), history(10))
    app = make_app(c)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.panes)
        await pilot.press("P")
        assert app.paused_at is not None


async def test_process_exit_keeps_history_and_says_exited():
    c = FakeConnection(hello(), history(200))
    app = make_app(c)
    async with app.run_test(size=(120, 36)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 200)
        await until(pilot, lambda: braille(chart_text(pane(app))) > 50)
        before = chart_text(pane(app))
        c.end()
        await until(pilot, lambda: pane(app).proc.state == State.EXITED)
        await until(pilot, lambda: "exited" in pane(app).header.render().plain)
        await pilot.pause(0.1)
        text = chart_text(pane(app))
        assert "process exited" in text
        assert braille(text) > 50  # the history is still drawn
        assert before.splitlines()[-1] == text.splitlines()[-1]
        assert "1 not running" in app.query_one(TopBar).render().plain
        tab = app.query_one("#tabs").get_tab(list(app.panes)[0])
        assert "✗" in str(tab.label)


async def test_agent_gone_but_process_alive_is_unreachable_then_reconnects():
    c = FakeConnection(hello(), history(20))
    c2 = FakeConnection(hello(), history(30))  # the agent back (re-sends its history)
    target = FakeTarget(c, gone=False)
    app = make_app(target=target)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.panes)
        p = pane(app).proc
        c.end()
        await until(pilot, lambda: p.state == State.UNREACHABLE)
        target.add(c2)  # the client reconnected
        await until(pilot, lambda: p.state == State.RUNNING and p.samples == 30)


async def test_second_process_attaching_adds_a_tab_and_the_overview():
    c1 = FakeConnection(hello(pid=11, rank=0, world=2), history(100))
    app = make_app(c1)
    async with app.run_test(size=(120, 36)) as pilot:
        await until(pilot, lambda: len(app.panes) == 1)
        assert not app.query(OverviewPane)
        c2 = FakeConnection(hello(pid=12, rank=1, world=2), history(100, scale=1.3))
        app.target.add(c2)
        await until(pilot, lambda: len(app.panes) == 2 and app.query(OverviewPane))
        tabs = app.query_one("#tabs")
        await until(pilot, lambda: tabs.active == "tab-overview")
        ov = app.query_one(OverviewPane)
        await until(pilot, lambda: ov.table.render().caption is not None)
        assert "imbalance" in ov.table.render().caption.plain
        assert "rank 1" in ov.table.render().caption.plain
        # tab walks overview -> rank 0 -> rank 1 -> overview
        seen = []
        for _ in range(3):
            await pilot.press("tab")
            seen.append(tabs.active)
        assert seen == ["p-11-d0", "p-12-d0", "tab-overview"]
        await pilot.press("shift+tab")
        assert tabs.active == "p-12-d0"


async def test_dead_rank_shown_dead_while_others_stay_live():
    conns = [FakeConnection(hello(pid=20 + r, rank=r, world=3), history(60)) for r in range(3)]
    app = make_app(*conns)
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: len(app.panes) == 3)
        conns[1].end()
        await until(pilot, lambda: app.procs["21"].state == State.EXITED)
        conns[0].feed(*[sample(i) for i in range(60, 80)])
        await until(pilot, lambda: app.procs["20"].samples == 80)
        assert app.procs["20"].state == State.RUNNING
        assert app.procs["22"].state == State.RUNNING
        ov = app.query_one(OverviewPane)
        rows, _caption = ov.table._content()
        states = [r[3].plain for r in rows]
        assert states == ["● running", "✗ exited", "● running"]


async def test_several_devices_of_one_process_get_a_tab_each():
    c = FakeConnection(hello(devices=2), history(30, devices=2))
    app = make_app(c)
    async with app.run_test(size=(120, 36)) as pilot:
        await until(pilot, lambda: len(app.panes) == 2)
        assert sorted(p.dev_index for p in app.panes.values()) == [0, 1]
        # and the overview of the two, added after them (not torn down half-added)
        await until(pilot, lambda: app.query_one("#tabs").active == "tab-overview")


async def test_resize_redraws_at_new_size():
    c = FakeConnection(hello(), history(100))
    app = make_app(c)
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).chart._strips)
        wide = pane(app).chart.size.width
        assert not app.screen.has_class("narrow")
        await pilot.resize_terminal(80, 24)
        await until(pilot, lambda: pane(app).chart._strips
                    and len(pane(app).chart._strips[1].text) == pane(app).chart.size.width
                    and pane(app).chart.size.width < wide)
        assert app.screen.has_class("narrow")
        assert len(pane(app).chart._strips) == pane(app).chart.size.height


async def test_only_the_visible_tab_is_drawn():
    c1 = FakeConnection(hello(pid=11, rank=0), history(50))
    c2 = FakeConnection(hello(pid=12, rank=1), history(50))
    app = make_app(c1, c2)
    async with app.run_test(size=(120, 36)) as pilot:
        # the overview comes with the second pane and is shown: tab from it to the first pane
        # (pressed before it came, tab went to the second pane and the overview took over)
        await until(pilot, lambda: len(app.panes) == 2 and app._tabs.active == "tab-overview")
        await pilot.press("tab")
        p0, p1 = list(app.panes.values())
        await until(pilot, lambda: p0.chart.frames > 0)
        n1 = p1.chart.frames
        c2.feed(*[sample(i) for i in range(50, 80)])
        await until(pilot, lambda: app.procs["12"].samples == 80)
        await pilot.pause(0.2)
        assert p1.chart.frames == n1


async def test_no_color_mode():
    c = FakeConnection(hello(), history(50))
    app = make_app(c, no_color=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).chart._strips)
        assert app.no_color
        assert "top to bottom" in chart_text(pane(app))


def test_no_tty_prints_a_hint(capsys, monkeypatch):
    from gpumon.tui import attach_app
    monkeypatch.setattr(attach_app, "_tty_ok", lambda: False)
    assert attach_app.run_attach([]) == 2
    err = capsys.readouterr().err
    assert "ssh -t" in err and "--json" in err


async def test_waiting_for_cuda_then_the_agents_stream():
    """What the client says of a process whose agent waits for the first CUDA call: its line
    and NVML's GPUs (no pane: it holds no GPU memory yet); then, once it serves, the agent's
    history in a pane and the line gone."""
    target = FakeTarget()
    app = make_app(target=target)
    waiting = "pid 77: gpumon's agent is loaded, waiting for the program's first CUDA call"
    async with app.run_test(size=(120, 36)) as pilot:
        target.state("77", "waiting", waiting)
        target.publish({"type": "hello", "key": "77", "pid": 77, "source": "nvml",
                        "devices": [], "commands": [], "rank": None,
                        "gpus": [{"index": 0, "name": "NVIDIA H200", "total": 140 * 2**30}]})
        target.publish({"type": "sample", "key": "77", "seq": 0, "t": T0, "devices": [],
                        "source": "nvml", "gpus": [[0, 3 * 2**30, 140 * 2**30]]})
        box = app.query_one("#waiting")
        await until(pilot, lambda: "3.00 GiB used of 140 GiB" in str(box.render()))
        assert str(box.render()).count(waiting) == 1 and not app.panes
        assert app.query_one("#notice").has_class("hidden")  # said once, in the box
        c = FakeConnection(hello(pid=77), history(40))
        target.add(c)  # the socket appeared: the agent's stream, history first
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 40)
        assert pane(app).proc.source == "simulated" and pane(app).proc.state == State.RUNNING
        assert app.query_one("#notice").has_class("hidden")
        # another process without an agent, holding GPU memory: its pane is NVML's, and the
        # line above the panes says why
        no_agent = "pid 78: no gpumon agent in this Python process (NVML figures only)"
        target.state("78", "no_agent", no_agent)
        target.publish({"type": "hello", "key": "78", "pid": 78, "source": "nvml",
                        "devices": [{"index": 0, "name": "NVIDIA H200", "total": 140 * 2**30}],
                        "commands": [], "rank": None, "gpus": []})
        await until(pilot, lambda: len(app.panes) == 2
                    and no_agent in str(app.query_one("#notice").render()))
        assert not app.query_one("#notice").has_class("hidden")


G = 1024 ** 3
AT_PEAK = {"parameters": 6 * G, "gradients": 6 * G, "optimizer_state": 12 * G,
           "activations": 6 * G, "allocator_cache": G // 4, "non_pytorch": None}


def _breakdown_events():
    return [{"type": "event", "kind": "breakdown", "step": 3, "phase": "optimizer", "devices": [{
        "index": 0, "now": dict(AT_PEAK), "at_peak": AT_PEAK, "peak": 30 * G,
        "peak_phase": "optimizer", "peak_step": 2, "peak_exact": True, "run_peak": 30 * G,
        "run_peak_phase": "optimizer", "run_peak_step": 2, "allocated": 30 * G,
        "reserved": 31 * G, "retries": 0}]},
        {"type": "event", "kind": "step", "step": 2, "time_s": 0.25, "peak": 30 * G,
         "peak_phase": "optimizer", "peak_exact": True, "peak_device": 0,
         "phases": {"forward": {"time_s": 0.1, "count": 1}}, "boundaries": [],
         "optimizers": ["AdamW"], "optimizer_impl": ["foreach"], "output_bytes": None,
         "phases_note": None}]


async def test_breakdown_key_mounts_the_breakdown_and_phases_colour_the_axis():
    hist = history(60)
    for i, s in enumerate(hist[0]["samples"] if hist and hist[0].get("type") == "history"
                          else []):
        s["phase"] = ("forward", "backward", "optimizer")[(i // 5) % 3]
    c = FakeConnection(hello(), hist + _breakdown_events())
    app = make_app(c)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.breakdown.main_device())
        assert pane(app).breakdown is None
        await pilot.press("b")
        await until(pilot, lambda: pane(app).breakdown is not None
                    and pane(app).breakdown.is_mounted)
        from textual.widgets import Static
        await until(pilot, lambda: "optimizer" in str(
            pane(app).breakdown.query_one("#bd-bars", Static).render()))
        steps = pane(app).breakdown.query_one("#bd-steps")
        await until(pilot, lambda: steps.row_count == 1)
        assert any(ph for _, ph in pane(app).proc.phase_marks)
        assert "▔" in chart_text(pane(app))
        await pilot.press("b")
        await until(pilot, lambda: not pane(app).breakdown.display)



async def _breakdown_steps(pilot, app):
    """`b` once the breakdown has a device: its step table, mounted."""
    await until(pilot, lambda: app.panes and pane(app).proc.breakdown.main_device())
    await pilot.press("b")
    await until(pilot, lambda: pane(app).breakdown is not None
                and pane(app).breakdown.is_mounted)
    return pane(app).breakdown.query_one("#bd-steps")


async def test_breakdown_lists_newest_step_first_below_the_advice():
    """A short pane clips the breakdown's bottom: that must cost the oldest steps, not the
    advice or the newest step."""
    ev = _breakdown_events()
    step = ev[1]
    c = FakeConnection(hello(), history(20) + ev + [dict(step, step=n) for n in (3, 4, 5)])
    app = make_app(c)
    async with app.run_test(size=(120, 40)) as pilot:
        steps = await _breakdown_steps(pilot, app)
        await until(pilot, lambda: steps.row_count == 4)
        assert [steps.get_row_at(i)[0] for i in range(4)] == ["5", "4", "3", "2"]
        ids = [w.id for w in pane(app).breakdown.children]
        assert ids.index("bd-advice") < ids.index("bd-steps")


async def test_a_step_with_no_allocator_figures_reads_dash_and_phases_match_the_legend():
    """A CPU run's step: its peak is "-" (it read ">= -"), and "other" is "oth", which the
    help's legend now names."""
    ev = _breakdown_events()
    cpu = dict(ev[1], step=3, peak=None, peak_phase=None, peak_exact=False,
               phases={"other": {"time_s": 0.021, "count": 1},
                       "forward": {"time_s": 0.076, "count": 1}})
    c = FakeConnection(hello(), history(20) + ev + [cpu])
    app = make_app(c)
    async with app.run_test(size=(120, 40)) as pilot:
        steps = await _breakdown_steps(pilot, app)
        await until(pilot, lambda: steps.row_count == 2)
        row = [str(x) for x in steps.get_row_at(0)]
        assert row[0] == "3" and row[2] == "-" and row[4] == "oth21 f76", row
        assert "oth other" in app.help_text() and '"-": no allocator figures' in app.help_text()


async def test_estimate_shown_beside_the_breakdown():
    from gpumon.estimate import Setup, estimate  # the estimator is pure Python
    est = estimate(Setup(n_params=1_500_000_000, batch=2, seq=256)).to_dict()
    c = FakeConnection(hello(), history(20) + _breakdown_events())
    app = make_app(c, estimate=est)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.breakdown.main_device())
        await pilot.press("b")
        from textual.widgets import Static
        await until(pilot, lambda: pane(app).breakdown is not None
                    and pane(app).breakdown.is_mounted)
        await until(pilot, lambda: "predicted" in str(
            pane(app).breakdown.query_one("#bd-advice", Static).render()))
        roles = pane(app).breakdown.query_one("#bd-roles")
        assert "error" in [str(c.label) for c in roles.columns.values()]


def _cpu_breakdown_events():
    """What the demo sends on a machine without CUDA: roles for device "cpu" only."""
    ev = _breakdown_events()
    ev[0]["devices"][0] = dict(ev[0]["devices"][0], index="cpu", now={"parameters": 5 * 2**20},
                               at_peak={"parameters": 5 * 2**20}, run_peak=7 * 2**20,
                               allocated=6 * 2**20)
    ev[1]["peak_device"] = "cpu"
    return ev


async def test_breakdown_shows_the_panes_own_device():
    # two devices with roles each: the old view showed cuda:0 (the larger peak) in both panes
    ev = _breakdown_events()
    d0 = dict(ev[0]["devices"][0], index=0, run_peak=40 * G)
    d1 = dict(ev[0]["devices"][0], index=1, run_peak=10 * G, allocated=9 * G)
    ev[0]["devices"] = [d0, d1]
    c = FakeConnection(hello(devices=2), history(20, devices=2) + ev)
    app = make_app(c)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: len(app.panes) == 2
                    and app.procs[next(iter(app.procs))].breakdown.device(1) is not None)
        await pilot.press("b")
        from textual.widgets import Static
        for tab_id, p in app.panes.items():
            app._tabs.active = tab_id
            await until(pilot, lambda: p.breakdown is not None and p.breakdown.is_mounted
                        and "device" in str(p.breakdown.query_one("#bd-bars", Static).render()))
            text = str(p.breakdown.query_one("#bd-bars", Static).render())
            assert f"device {p.dev_index}" in text and "shown for device" not in text


async def test_breakdown_of_a_model_on_cpu_beside_a_simulated_gpu_says_whose_roles_it_shows():
    c = FakeConnection(hello(), history(20) + _cpu_breakdown_events())
    app = make_app(c)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.breakdown.device("cpu"))
        await pilot.press("b")
        from textual.widgets import Static
        bars = lambda: str(pane(app).breakdown.query_one("#bd-bars", Static).render())  # noqa: E731
        await until(pilot, lambda: pane(app).breakdown is not None
                    and pane(app).breakdown.is_mounted and "device cpu" in bars())
        text = bars()
        assert ("the model trains on the CPU, not on this simulated cuda:0; "
                "its roles are shown for device cpu") in text
        assert "demo" not in text  # the program may be the user's own
        assert pane(app).breakdown_device() == ("cpu", pane(app).breakdown_device()[1])


async def test_a_rank_that_starts_later_joins_the_view():
    # The client's target follows a launcher's descendants: a rank whose agent appears late
    # becomes a new member, and the view adds it.
    c1 = FakeConnection(hello(pid=21, rank=0, world=2), history(50))
    c2 = FakeConnection(hello(pid=22, rank=1, world=2), history(50))
    app = make_app(c1)
    async with app.run_test(size=(120, 36)) as pilot:
        await until(pilot, lambda: len(app.panes) == 1)
        app.target.add(c2)  # rank 1's agent starts serving
        await until(pilot, lambda: len(app.panes) == 2 and app.query(OverviewPane))
        assert len(app.procs) == 2


async def test_a_member_shown_then_hidden_in_one_batch_does_not_stop_the_view():
    # A node of attach --hosts is "connecting", then a launcher (its ranks are members), and
    # under load both states came in one drain: the view raised KeyError and stopped drawing.
    c1 = FakeConnection(hello(pid=21, rank=0, world=1), history(50))
    app = make_app(c1)
    async with app.run_test(size=(120, 36)) as pilot:
        await until(pilot, lambda: len(app.panes) == 1)
        app.target.state("n1:", "no_agent", "host n1: connecting")
        app.target.state("n1:", "launcher", "host n1: connected, 1 process with gpumon's agent")
        app.target.state("n2:", "no_agent", "host n2: connecting")
        await pilot.pause(0.3)
        assert "n1:" not in app.procs and "n2:" in app.procs
        app.target.state("n2:", "launcher", "host n2: connected")
        await until(pilot, lambda: "n2:" not in app.procs)
        assert app.is_running and len(app.panes) == 1


async def test_the_top_bar_counts_a_batch_before_its_panes_are_mounted():
    """Node b's rank came first (node a still connecting: "1 proc  1/2 nodes down"), then in one
    batch node a with its two ranks. The frame mounts their panes (each mount awaits, the
    screen may be drawn meanwhile) and only then redrew the top bar: beside the overview of 3
    ranks it still said "1 proc  1/2 nodes down" (seen as a flaky tests/cluster test)."""
    target = FakeTarget()
    app = make_app(target=target)

    def member(host, pid, rank):
        key = f"{host}:{pid}"
        target.publish({"type": "state", "key": key, "pid": pid, "state": "serving",
                        "line": f"pid {pid}: connected", "since": T0, "rank": rank,
                        "host": host})
        target.publish({**hello(pid=pid, rank=rank, world=3), "key": key, "host": host})
        for m in history(20):
            target.publish({**m, "key": key, "host": host})

    def node(host, state, line):
        target.publish({"type": "state", "key": f"{host}:", "pid": 0, "state": state,
                        "line": line, "since": T0, "rank": None, "host": host})
    async with app.run_test(size=(80, 24)) as pilot:
        def top():
            return app._topbar.render().plain
        node("a", "unreachable", "host a: connecting (ssh)")
        node("b", "launcher", "host b: connected (ssh), 1 process with gpumon's agent")
        member("b", 7, 2)
        await until(pilot, lambda: len(app.panes) == 1 and " 1 proc " in top())
        assert "1/2 nodes down" in top(), top()
        seen = []
        ensure = app._ensure_panes

        async def watched(proc):
            seen.append(top())  # what the screen shows while this pane is mounted
            await ensure(proc)
        app._ensure_panes = watched
        # in one batch (nothing runs on the app's loop between these calls)
        node("a", "launcher", "host a: connected (ssh), 2 processes with gpumon's agent")
        member("a", 5, 0)
        member("a", 6, 1)
        await until(pilot, lambda: len(app.panes) == 3 and app.query(OverviewPane))
        assert len(seen) == 2, seen
        assert all(" 3 proc " in t and "down" not in t for t in seen), seen
        assert " 3 proc " in top() and "down" not in top(), top()


async def test_chart_draws_an_exact_peak_above_the_samples():
    """A peak between samples is above every sampled point: the y range takes it in and the
    ◆ sits above the line's top, not clipped away."""
    from textual.app import App

    from gpumon.model.series import Series
    from gpumon.tui.widgets.chart import BrailleChart, ChartSpec, Line

    s = Series()
    for i in range(50):
        s.append(i * 0.1, 10.0 if i % 10 == 5 else 4.0)

    class One(App):
        def compose(self):
            yield BrailleChart(id="c")

    app = One()
    async with app.run_test(size=(60, 14)) as pilot:
        chart = app.query_one(BrailleChart)
        chart.plot(ChartSpec([Line("allocated", s, "green")], 0.0, 5.0, peak=(2.55, 20.0)))
        await pilot.pause()
        rows = ["".join(seg.text for seg in strip) for strip in chart._strips]
        peak_row = next(i for i, r in enumerate(rows) if "◆" in r)
        line_rows = [i for i, r in enumerate(rows[1:-1], 1)
                     if any("\u2801" <= ch <= "\u28ff" for ch in r)]
        assert peak_row < min(line_rows) - 2, (peak_row, line_rows)
