"""Ctrl-C on every screen (issue 32 item 5): the live view, the snapshot viewer and diff --tui
quit with 130 instead of Textual's "Press ctrl+q to quit" toast; the live view saves a
recording it started before it goes. `h` and F1 open the help, as in htop and nvitop; the
help says how to scroll where it does not fit. `gpumon demo` is driven on a real terminal."""
import os
import pickle
import pty
import select
import signal
import subprocess
import sys
import time

import pytest
from fakes import CLIENT_ID, T0, FakeConnection, FakeTarget, hello, history

from gpumon.interrupt import INTERRUPTED, Interrupted
from gpumon.tui.attach_app import AttachApp, HelpScreen
from gpumon.tui.keys import raise_if_interrupted

SNAP_CMDS = ("ping", "reset_peaks", "set_rate", "status", "snapshot_start", "snapshot_stop",
             "snapshot_status")


async def until(pilot, cond, timeout=15.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        await pilot.pause(0.02)


def attach_app(conn):
    return AttachApp(FakeTarget(conn), clock=lambda: T0 + 40, client_id=CLIENT_ID, fps=20)


async def test_attach_ctrl_c_quits_130_with_nothing_to_undo():
    c = FakeConnection(hello(), history(20))
    app = attach_app(c)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.panes)
        await pilot.press("ctrl+c")
        await until(pilot, lambda: not app.is_running)
    assert app.return_code == INTERRUPTED and app.interrupt_outcome is None
    assert c.closed.is_set()
    with pytest.raises(Interrupted) as e:
        raise_if_interrupted(app)
    assert e.value.outcome is None


async def test_attach_ctrl_c_saves_the_recording_it_started_first():
    def start(args):
        return {"recording": True, "since": T0 + 2.0}

    def stop(args):
        return {"ok": True, "path": "/run/snapshot-1.pickle"}

    c = FakeConnection(hello(commands=SNAP_CMDS), history(50),
                       handlers={"snapshot_start": start, "snapshot_stop": stop,
                                 "snapshot_status": lambda a: {"recording": False}})
    app = attach_app(c)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.panes and next(iter(app.panes.values())).proc.samples)
        await pilot.press("s")
        await until(pilot, lambda: next(iter(app.panes.values())).proc.recording.active)
        await pilot.press("ctrl+c")
        await until(pilot, lambda: not app.is_running)
    assert [r[0] for r in c.requests][-1] == "snapshot_stop"
    assert app.return_code == INTERRUPTED
    assert app.interrupt_outcome == ("the recording was stopped and saved: "
                                     "/run/snapshot-1.pickle")
    assert "pid 1234: snapshot saved: /run/snapshot-1.pickle" in app.saved


async def test_h_and_f1_open_the_help_and_a_long_help_says_it_scrolls():
    c = FakeConnection(hello(), history(10))
    app = attach_app(c)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.panes)
        for key in ("h", "f1"):
            await pilot.press(key)
            assert isinstance(app.screen, HelpScreen), key
            await pilot.pause()
            box = app.screen.query_one("#help-box")
            await until(pilot, lambda: box.border_subtitle)
            assert "more" in box.border_subtitle and box.max_scroll_y > 0
            await pilot.press("pagedown")  # the help has the focus: it scrolls at once
            await until(pilot, lambda: box.scroll_y > 0)
            await pilot.press(key)  # the same key closes it
            assert not isinstance(app.screen, HelpScreen)
        assert "ctrl+c" in app.help_text() and "130" in app.help_text()
        await pilot.press("f10")  # htop's quit
        await until(pilot, lambda: not app.is_running)
    assert app.return_code == 0
    async with attach_app(FakeConnection(hello(), history(10))).run_test(size=(120, 60)) as p2:
        await p2.press("h")
        await p2.pause(0.2)
        assert p2.app.screen.query_one("#help-box").border_subtitle == ""  # it all fits


def _snapshot():
    from gpumon.snapshot import Snapshot
    from gpumon.snapshot.synth import training_snapshot
    data, _ = training_snapshot(steps=3, layers=4, max_entries=400, seed=3)
    return Snapshot(pickle.loads(pickle.dumps(data)), "/runs/train.pickle")


async def test_view_ctrl_c_quits_130_even_from_the_search_field():
    from gpumon.tui.view.app import ViewApp
    app = ViewApp(_snapshot())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2")
        await pilot.press("slash")  # the search field has the focus: ctrl+c is not "copy"
        await pilot.pause()
        await pilot.press("ctrl+c")
        await until(pilot, lambda: not app.is_running)
    assert app.return_code == INTERRUPTED


async def test_view_tabs_read_in_order_and_h_opens_help():
    from textual.widgets import TabbedContent, Tabs

    from gpumon.tui.view.app import ViewApp
    app = ViewApp(_snapshot())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        labels = [str(t.label) for t in app.query_one(Tabs).query("Tab")]
        assert [x.split()[0] for x in labels] == ["1", "2", "3", "4", "5"], labels
        await pilot.press("5")
        await pilot.pause()
        assert app.query_one("#tabs", TabbedContent).active == "leaks"
        await pilot.press("h")
        assert type(app.screen).__name__ == "HelpScreen"


async def test_diff_tui_ctrl_c_quits_130_and_f1_opens_help():
    from gpumon.snapshot.diff import diff
    from gpumon.tui.view.diff_app import DiffApp
    s = _snapshot()
    app = DiffApp(diff(s, s))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("f1")
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape")
        await pilot.press("ctrl+c")
        await until(pilot, lambda: not app.is_running)
    assert app.return_code == INTERRUPTED


def test_demo_on_a_terminal_ctrl_c_stops_its_workload_and_exits_130(tmp_path):
    """`gpumon demo` on a real pseudo-terminal: Ctrl-C (the byte a terminal sends) ends the
    view and the demo's training child, and says so."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: gpumon demo on the terminal
        os.environ.update(TERM="xterm-256color", COLUMNS="80", LINES="24")
        os.execv(sys.executable, [sys.executable, "-m", "gpumon", "demo", "--cpu"])
    seen = b""
    try:
        end = time.monotonic() + 60
        children: list = []
        # the demo's figures are on screen and its workload runs (not the word "running": the
        # terminal may get only the cells that changed, "runn" over "wait", under load)
        while b"allocated" not in seen or not children:
            assert time.monotonic() < end, seen[-500:]
            if select.select([fd], [], [], 0.5)[0]:
                seen += os.read(fd, 65536)
            children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                      text=True).stdout.split()
        assert children, "the demo's workload"
        os.write(fd, b"\x03")
        end = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < end, "the demo did not end on Ctrl-C"
            try:
                if select.select([fd], [], [], 0.2)[0]:
                    seen += os.read(fd, 65536)
            except OSError:
                pass
        try:
            while select.select([fd], [], [], 0.2)[0]:
                seen += os.read(fd, 65536)
        except OSError:
            pass
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 130
    assert b"gpumon: interrupted (Ctrl-C); the demo's workload was stopped" in seen
    for c in children:
        assert not os.path.exists(f"/proc/{c}") or \
            open(f"/proc/{c}/stat").read().split(")")[-1].split()[0] == "Z"
