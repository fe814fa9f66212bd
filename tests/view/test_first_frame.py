"""The first screen of `gpumon view` as plain text while Textual imports (issue 18: the first
screen no slower than ptmem's cold start): the same screen as the app's, keys typed meanwhile
reach the app, the terminal is left as it was, and the light paths import no Textual."""
import asyncio
import os
import pickle
import select
import subprocess
import sys
import time

import pytest
from textual.widgets import Static

from gpumon.snapshot import Snapshot, report
from gpumon.snapshot.synth import snapshot_with_events
from gpumon.tui.view import frame
from gpumon.tui.view.app import ViewApp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def snap_file(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("ff") / "run.pickle")
    with open(p, "wb") as f:
        pickle.dump(snapshot_with_events(3000, all_stacks=True), f, protocol=4)
    return p


def _plain(rows):
    return ["".join(t for t, _ in r) for r in rows]


def test_footer_keys_are_the_apps():
    shown = [(b.key_display or b.key, b.description) for b in ViewApp.BINDINGS if b.show]
    assert [d for _, d in frame.FOOTER_KEYS] == [d for _, d in shown]
    keys = {"question_mark": "?", "plus,equals_sign": "+", "minus": "-", "slash": "/"}
    assert [k for k, _ in frame.FOOTER_KEYS] == [keys.get(k, k) for k, _ in shown]


def test_typed_keys_become_textual_key_names():
    assert frame.keys_of("3q<>?/+-,.[]\x1b[C\x1b[Dp\r\x01") == [
        "3", "q", "less_than_sign", "greater_than_sign", "question_mark", "slash", "plus",
        "minus", "comma", "full_stop", "left_square_bracket", "right_square_bracket", "right",
        "left", "p", "enter"]


async def test_the_plain_frame_is_the_apps_first_screen(snap_file):
    from gpumon.snapshot import open_snapshot
    snap = open_snapshot(snap_file)
    tr = snap.trace()
    rows = _plain(frame.frame_rows(snap, tr, report.oom_info(snap, tr.device),
                                   snap.step_boundaries(tr.device), 80, 24))
    assert len(rows) == 24 and all(len(r) <= 80 for r in rows)
    app = ViewApp(snap)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        head = app.query_one("#head", Static)
        chart = app.chart
        event = app.query_one("#event", Static)
        assert head.region.y == 0 and rows[0].strip() == str(head.render()).strip()
        # the chart where the app draws it, and the same cells
        y, h = chart.region.y, chart.region.height
        assert str(chart.render()).split("\n") == rows[y:y + h]
        assert "events/col" in rows[y + h - 1] and "▲" in rows[y + h - 2]
        ey = event.region.y
        lines = [r.strip() for r in rows[ey:ey + event.region.height]]
        assert lines[0].startswith(f"event {tr.peak_index:,}") and "alloc" in lines[0]
        assert str(event.render()).replace("\n", " ").split()[:12] == \
            " ".join(lines).split()[:12]
        assert rows[-1].startswith(" q quit  ? help  1 timeline")


def test_summary_imports_no_textual_and_no_estimator(snap_file):
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "gpumon", "view", snap_file,
                        "--summary"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 0 and "peak allocated" in r.stdout
    mods = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert not {m for m in mods if m.split(".")[0] in ("textual", "rich")}
    assert not {m for m in mods if m.startswith(("gpumon.estimate", "gpumon.cluster",
                                                 "gpumon.agent", "gpumon.tui"))}


def _read_until(fd, out, marks, timeout=30.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(out.count(m) >= n for m, n in marks):
            return out
        if select.select([fd], [], [], 0.05)[0]:
            try:
                out += os.read(fd, 1 << 16)
            except OSError:
                break
    return out


def _wait_reading(p, fd, timeout=30.0):
    """p's exit status, its terminal read meanwhile as a terminal does: the app's last frames
    and its exit write there, and on a pty nobody reads (about 17 KiB) those writes block, and
    with them Textual's exit, which waits for its writer thread."""
    t0 = time.monotonic()
    while p.poll() is None and time.monotonic() - t0 < timeout:
        if select.select([fd], [], [], 0.05)[0]:
            try:
                os.read(fd, 1 << 16)
            except OSError:
                break
    return p.wait(1)


async def test_keys_read_while_the_app_mounts_wait_for_its_first_screen(snap_file):
    """A key Textual reads itself while the app mounts (typed after the plain frame's keys were
    taken) is pressed after those and once the tabs' first activation is handled: pressed
    before it, "3" raced that activation, the two tabs took focus from each other (on a
    terminal, redrawing without end) and the key was lost."""
    from textual import events
    from textual.widgets import TabbedContent

    from gpumon.snapshot import open_snapshot

    class Early(ViewApp):
        activations = 0

        def on_mount(self):
            self.post_message(events.Key("3", None))
            super().on_mount()

        async def on_tabbed_content_tab_activated(self, event):
            self.activations += 1
            await super().on_tabbed_content_tab_activated(event)

    app = Early(open_snapshot(snap_file))
    app.pending_keys = ["2"]  # typed on the plain frame, before the "3"
    async with app.run_test(size=(80, 24)) as pilot:
        await asyncio.wait_for(app.keys_released.wait(), 10)
        await pilot.pause()
        assert app.query_one("#tabs", TabbedContent).active == "segments"
        assert app.activations == 3  # timeline (the first), allocs, segments
        assert "fragmentation" in str(app.query_one("#seg-head", Static).render())


async def test_tab_keys_typed_quickly_end_on_the_last(snap_file):
    """Each tab key's activation and focus come late: an earlier tab's focus took its tab back
    ("2" then "3" ended on the allocations) or stayed on a hidden widget."""
    from textual.widgets import TabbedContent

    from gpumon.snapshot import open_snapshot
    app = ViewApp(open_snapshot(snap_file))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.2)
        for keys, tab, focused in (("23", "segments", "seg-table"), ("24", "summary", None),
                                   ("3461", "timeline", "chart")):
            for k in keys:
                app.simulate_key(k)
            for _ in range(4):
                await pilot.pause(0.1)
            assert app.query_one("#tabs", TabbedContent).active == tab, keys
            assert (app.focused.id if app.focused else None) == focused, keys


def test_in_a_terminal_plain_frame_then_the_app(snap_file):
    """As a user: the plain frame first, a key typed before Textual is up still works, q
    quits, and the terminal's modes are as they were."""
    import fcntl
    import pty
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    before = termios.tcgetattr(slave)
    env = {**os.environ, "PYTHONPATH": ROOT, "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    p = subprocess.Popen([sys.executable, "-m", "gpumon", "view", snap_file], stdin=slave,
                         stdout=slave, stderr=slave, env=env, cwd=ROOT)
    try:
        out = _read_until(master, b"", [(b"events/col", 1)])
        assert b"events/col" in out and b"\x1b[?1049h" in out     # on the alternate screen
        os.write(master, b"3")  # the segments tab, typed while Textual still loads
        out = _read_until(master, out, [(b"fragmentation", 1)])
        assert b"fragmentation" in out, out[-2000:]
        os.write(master, b"q")
        assert _wait_reading(p, master) == 0
    finally:
        if p.poll() is None:
            p.kill()
        after = termios.tcgetattr(slave)
        os.close(master)
        os.close(slave)
    assert after[3] & (termios.ECHO | termios.ICANON) == before[3] & (termios.ECHO | termios.ICANON)


def test_the_plain_frame_is_left_when_the_app_cannot_start(snap_file, monkeypatch):
    """abandon(): back to the normal screen, modes restored."""
    import pty
    import termios
    master, slave = pty.openpty()
    try:
        before = termios.tcgetattr(slave)
        pf = frame.PlainFrame(slave, slave)
        snap = Snapshot(pickle.load(open(snap_file, "rb")), snap_file)
        pf.show(snap, snap.trace(), None, [], no_color=True)
        assert not termios.tcgetattr(slave)[3] & termios.ECHO
        pf.abandon()
        assert termios.tcgetattr(slave)[3] == before[3]
        out = _read_until(master, b"", [(b"\x1b[?1049l", 1)], timeout=5)
        assert b"events/col" in out and out.rstrip().endswith(b"\x1b[?1049l")
    finally:
        os.close(master)
        os.close(slave)


# -- the plain frame acts on the timeline's keys while Textual is imported ---------------------

def test_plain_keys_are_the_apps():
    """The keys the plain frame does itself are the app's default keys for the same binding."""
    by_id = {b.id: b.key.split(",") for b in ViewApp.BINDINGS}
    for key, bid in frame.PLAIN_KEYS.items():
        assert key in by_id[bid], (key, bid)
    assert set(frame.QUIT_KEYS) == set(by_id["view.quit"])


def test_split_keys_keeps_a_cut_escape_and_drops_unknown_sequences():
    assert frame.split_keys(".\x1b[") == (["full_stop"], "\x1b[")
    assert frame.split_keys("\x1b[C\x1bOD\x1b[21~\x1b[15~p") == (["right", "left", "f10", "p"], "")
    assert frame.keys_of("\x1b") == ["escape"]


def _last_frame(out: bytes) -> str:
    """The text of the last plain frame written (escape sequences taken out, one line a row)."""
    import re
    last = out.rsplit(b"\x1b[2J", 1)[-1].decode()
    rows = re.split(r"\x1b\[\d+;1H", last)
    return "\n".join(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", r) for r in rows)


def _event_at_cursor(text: str) -> int:
    import re
    m = re.search(r"^ ?(?:event|ev) ([\d,]+)\s.*\ball", text, re.M)
    return int(m.group(1).replace(",", ""))


def test_the_plain_frame_moves_on_keys(snap_file):
    import pty
    master, slave = pty.openpty()
    try:
        from gpumon.snapshot import open_snapshot
        snap = open_snapshot(snap_file)
        tr = snap.trace()
        steps = snap.step_boundaries(tr.device)
        pf = frame.PlainFrame(slave, slave)
        pf.show(snap, tr, None, steps, no_color=True)
        out = _read_until(master, b"", [(b"events/col", 1)], timeout=5)
        text = _last_frame(out)
        assert _event_at_cursor(text) == tr.peak_index
        per_col = max(1, tr.n // (80 - frame.AXIS_W))
        assert f"({per_col:,} events/col)" in text

        def press(key, expect_draw=True):
            nonlocal out
            n = out.count(b"\x1b[2J")
            assert pf.act(key) is expect_draw
            if expect_draw:
                out = _read_until(master, out, [(b"\x1b[2J", n + 1)], timeout=5)
                out = _read_until(master, out, [(b"events/col", n + 1)], timeout=5)
            return _last_frame(out)

        assert _event_at_cursor(press("full_stop")) == tr.peak_index + 1
        assert _event_at_cursor(press("right")) == tr.peak_index + 1 + per_col
        assert _event_at_cursor(press("left")) == tr.peak_index + 1
        text = press("plus")                                   # zoomed in around the cursor
        assert f"({per_col // 2:,} events/col)" in text or f"({max(1, (tr.n // 2) // 67):,} ev" \
            in text
        assert pf.view[2] - pf.view[1] == tr.n // 2
        assert _event_at_cursor(press("home")) == 0
        assert _event_at_cursor(press("p")) == tr.peak_index
        assert steps, "the fixture has optimizer steps"
        after = [e for e, _ in steps if e > tr.peak_index]
        if after:
            assert _event_at_cursor(press("right_square_bracket")) == after[0]
        res_before = text.count("─")
        assert pf.act("r") and pf.show_reserved is False
        out = _read_until(master, out, [(b"events/col", out.count(b"events/col") + 1)], 5)
        assert _last_frame(out).count("─") < res_before       # the reserved line is gone
        for key in ("2", "question_mark", "slash", "g"):       # the app's: not done here
            assert pf.act(key) is False
        pf.abandon()
    finally:
        os.close(master)
        os.close(slave)


def test_keys_after_one_for_the_app_wait_for_it(snap_file):
    """Once a key only the app can do is typed, the keys after it wait too: typed ". 2 .", the
    plain frame moves one event and the app gets "2" then "." (the order typed)."""
    import pty

    from gpumon.commands.view import _QuitDuringLoad
    from gpumon.snapshot import open_snapshot
    master, slave = pty.openpty()
    try:
        snap = open_snapshot(snap_file)
        tr = snap.trace()
        pf = frame.PlainFrame(slave, slave)
        pf.show(snap, tr, None, snap.step_boundaries(tr.device), no_color=True)
        w = _QuitDuringLoad(pf)
        w.feed(["full_stop", "2", "full_stop", "p"])
        assert pf.view[0] == tr.peak_index + 1
        assert w.keys == ["2", "full_stop", "p"]
        pf.abandon()
    finally:
        os.close(master)
        os.close(slave)


async def test_the_app_starts_where_the_plain_frame_left(snap_file):
    from gpumon.snapshot import open_snapshot
    snap = open_snapshot(snap_file)
    tr = snap.trace()
    app = ViewApp(snap)
    lo, hi = frame.nav_zoom(tr.n, 0, tr.n, 100, 0.5)
    app.start_view, app.start_show_reserved = (100, lo, hi), False
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        chart = app.chart
        assert (chart.cursor, chart.lo, chart.hi, chart.show_reserved) == (100, lo, hi, False)
        assert str(app.query_one("#event", Static).render()).startswith("event 100 ")
        await pilot.press("full_stop")
        assert chart.cursor == 101


def test_in_a_terminal_a_key_on_the_plain_frame_acts_once(snap_file):
    """As a user: "." typed the moment the plain frame is up moves the cursor on it, and the
    app, once up, shows the cursor there (the move neither lost nor done twice)."""
    import fcntl
    import pty
    import re
    import struct
    import termios
    from gpumon.snapshot import open_snapshot
    peak = open_snapshot(snap_file).trace().peak_index
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {**os.environ, "PYTHONPATH": ROOT, "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    env.pop("GPUMON_KEYS", None)
    p = subprocess.Popen([sys.executable, "-m", "gpumon", "view", snap_file], stdin=slave,
                         stdout=slave, stderr=slave, env=env, cwd=ROOT)
    try:
        out = _read_until(master, b"", [(b"events/col", 1)])
        os.write(master, b".")
        out = _read_until(master, out, [(f"event {peak + 1:,} ".encode(), 1)])
        assert f"event {peak + 1:,} ".encode() in out, out[-3000:]
        # drawn by the plain frame itself (its second frame), not only once the app is up
        plain_head = b"\x1b[?1049h\x1b[?25l\x1b[H\x1b[2J"
        assert out[:out.index(f"event {peak + 1:,} ".encode())].count(plain_head) == 2
        os.write(master, b"3")   # the app: the segments tab once it is up
        out = _read_until(master, out, [(b"fragmentation", 1)])
        k = out.index(b"fragmentation")
        os.write(master, b"1")   # back to the timeline: the app's event line
        mark = f"event {peak + 1:,} ".encode()
        out = _read_until(master, out, [(mark, out.count(mark) + 1)])
        tail = out[k:].decode("utf-8", "replace")
        assert re.search(rf"event {peak + 1:,} ", tail), tail[-3000:]
        assert not re.search(rf"event ({peak:,}|{peak + 2:,}) ", tail)
        os.write(master, b"q")
        assert _wait_reading(p, master) == 0
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
        os.close(slave)
