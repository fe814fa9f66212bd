"""Issue 33, item 9: the view at 80x24 and its edges: an empty trace, the g levels, the summary's
and leaks' tables reachable with the keys `?` lists, notices clear of the stack pane."""
import pickle

import pytest

from gpumon.snapshot import Snapshot
from gpumon.snapshot import report
from gpumon.snapshot.synth import training_snapshot
from gpumon.tui.view.app import ViewApp


def _empty():
    seg = {"device": 0, "address": 0, "total_size": 2 << 20, "blocks": [
        {"address": 0, "size": 1 << 20, "requested_size": 1 << 20, "state": "active_allocated"}]}
    return Snapshot({"segments": [seg], "device_traces": [[]]}, "empty.pickle")


def test_empty_trace_does_not_say_event_minus_one():
    snap = _empty()
    txt = report.summary_text(report.summary(snap))
    assert "event -1" not in txt and "of 0" not in txt
    assert "no trace events" in txt
    page = report.html_page(snap)
    assert "event -1" not in page


@pytest.mark.asyncio
async def test_g_cycles_through_the_documented_levels_only():
    snap = Snapshot(pickle.loads(pickle.dumps(training_snapshot(steps=2, layers=2)[0])), "t")
    app = ViewApp(snap)
    async with app.run_test(size=(80, 24)) as pilot:
        seen = []
        for _ in range(5):
            await pilot.press("g")
            seen.append(app.group_by)
        assert seen == ["function", "file", "library", "line", "function"]
        assert "category" not in seen
        # the levels a file lacks are named where help explains g (80 columns leave no room
        # on the key's own line)
        assert "category: profiler files" in app.help_text() and "module: " in app.help_text()


@pytest.mark.asyncio
async def test_summary_and_leaks_scroll_with_the_keys_in_help():
    snap = Snapshot(pickle.loads(pickle.dumps(training_snapshot(steps=4, layers=6,
                                                                 leak_per_step=1 << 20)[0])), "t")
    app = ViewApp(snap)
    async with app.run_test(size=(80, 24)) as pilot:
        for tab in ("4", "5"):
            await pilot.press(tab)
            name = {"4": "summary", "5": "leaks"}[tab]
            for _ in range(50):
                await pilot.pause(0.05)
                if not app.query_one(f"#{name}").loading:
                    break
            await pilot.pause()
            scroll = app.query_one(f"#{name}-text").parent
            assert app.focused is scroll, (name, app.focused)
            if scroll.max_scroll_y:
                await pilot.press("pagedown")
                await pilot.pause()
                assert scroll.scroll_y > 0, name
        assert "pgup/pgdn" in app.help_text()


@pytest.mark.asyncio
async def test_notices_stay_clear_of_the_stack_pane():
    snap = Snapshot(pickle.loads(pickle.dumps(training_snapshot(steps=2, layers=3)[0])), "t")
    app = ViewApp(snap)
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await pilot.press("2")
        await pilot.pause()
        app.notify("a notice\nof two lines", timeout=30)
        await pilot.pause(0.3)
        from textual.widgets._toast import Toast
        stack = app.query_one("#stack").region
        toasts = [t.region for t in app.screen.query(Toast)]
        assert toasts
        for t in toasts:
            assert t.y + t.height <= stack.y, (t, stack)


def _slow_view(snap_path, keys: bytes):
    """`gpumon view` in a terminal whose load takes 30 s of busy work; `keys` typed after
    1 s. (rc, seconds from the keys to the exit, terminal modes before and after)."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios
    import time
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys, time\n"
            "from gpumon.snapshot import load\n"
            "orig = load._load_snapshot\n"
            "def slow(*a, **k):\n"
            "    t = time.time() + 30\n"
            "    while time.time() < t:\n"
            "        sum(range(1000))\n"
            "    return orig(*a, **k)\n"
            "load._load_snapshot = slow\n"
            "from gpumon.cli import main\n"
            "sys.exit(main())\n")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    before = termios.tcgetattr(slave)
    p = subprocess.Popen([sys.executable, "-c", code, "view", str(snap_path)], stdin=slave,
                         stdout=slave, stderr=slave, cwd=root,
                         env={**os.environ, "PYTHONPATH": root, "TERM": "xterm-256color"})
    try:
        time.sleep(1.5)
        if keys == b"\x03":   # what the terminal does on Ctrl-C (this pty is not the
            import signal     # child's controlling terminal)
            p.send_signal(signal.SIGINT)
        else:
            os.write(master, keys)
        t0 = time.monotonic()
        deadline = t0 + 20
        while p.poll() is None and time.monotonic() < deadline:
            try:
                import select
                if select.select([master], [], [], 0.05)[0]:
                    os.read(master, 65536)
            except OSError:
                break
        took = time.monotonic() - t0
        rc = p.wait(5)
    finally:
        if p.poll() is None:
            p.kill()
        after = termios.tcgetattr(slave)
        os.close(master)
        os.close(slave)
    return rc, took, before, after


@pytest.mark.parametrize("keys,rc", [(b"q", 0), (b"\x03", 130)])
def test_q_and_ctrl_c_leave_at_once_during_a_load(tmp_path, keys, rc):
    import termios
    f = tmp_path / "s.pickle"
    f.write_bytes(pickle.dumps(training_snapshot(steps=2, layers=2)[0]))
    got, took, before, after = _slow_view(f, keys)
    assert got == rc and took < 5, (got, took)
    mask = termios.ECHO | termios.ICANON
    assert after[3] & mask == before[3] & mask


@pytest.mark.asyncio
async def test_footer_remounts_its_keys_only_when_they_change():
    """Textual recomposes the footer each time the bindings may have changed (5 times while
    the view starts): the keys up stay mounted while they are the same ones, and a wider
    terminal still brings the keys that now fit."""
    from gpumon.tui.footer import FittingFooter
    snap = Snapshot(pickle.loads(pickle.dumps(training_snapshot(steps=2, layers=2)[0])), "t")
    app = ViewApp(snap)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        footer = app.query_one(FittingFooter)
        up = list(footer.children)
        assert [k.key for k in up][:2] == ["q", "question_mark"]
        app.refresh_bindings()   # the screen signals it: Textual recomposes the footer
        await pilot.pause(0.1)
        assert list(footer.children) == up and all(k.is_attached for k in up)
        await pilot.resize_terminal(140, 24)
        await pilot.pause(0.2)
        wider = [k.description for k in footer.children]
        assert len(wider) > len(up) and "zoom in" in wider
