"""A trace longer than --window: read twice, kept as a window of events whose figures are the
whole trace's, in memory that does not grow with the trace (issue 18)."""
import gc
import os
import pickle
import subprocess
import sys
import tracemalloc

import pytest

from gpumon.snapshot import open_snapshot
from gpumon.snapshot.analysis import Snapshot
from gpumon.snapshot.load import load_snapshot
from gpumon.snapshot.synth_long import write_long_trace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def long_file(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("win") / "long.pickle")
    assert write_long_trace(p, 20_000) == 20_000
    return p


@pytest.fixture(scope="module")
def whole(long_file):
    return Snapshot(load_snapshot(long_file, window=None), long_file).trace()


def test_the_writer_writes_torchs_layout(long_file):
    d = pickle.load(open(long_file, "rb"))
    ev = d["device_traces"][0]
    assert len(ev) == 20_000
    assert set(ev[0]) == {"action", "addr", "size", "stream", "time_us", "frames"}
    # a fresh frame list per event (as stacks='all'), sharing its frame dicts
    assert ev[100]["frames"] is not ev[101]["frames"]
    same = [e for e in ev[100:400] if e["frames"] and e["frames"][6] == ev[100]["frames"][6]]
    assert len(same) > 1 and same[0]["frames"][0] is same[1]["frames"][0]


def _same_figures(win, whole, probes):
    lo = win.window_offset
    assert list(win.allocated) == list(whole.allocated[lo:lo + win.n])
    assert list(win.reserved) == list(whole.reserved[lo:lo + win.n])
    for k in probes:
        a = [(g.key, g.bytes, g.count) for g in win.groups_at(k)]
        b = [(g.key, g.bytes, g.count) for g in whole.groups_at(k + lo)]
        assert a == b, k
        a = [(s.address, s.total, s.allocated, s.largest_free) for s in win.segments_at(k)]
        b = [(s.address, s.total, s.allocated, s.largest_free) for s in whole.segments_at(k + lo)]
        assert a == b, k


def test_window_around_the_peak_has_the_whole_traces_figures(long_file, whole):
    s = Snapshot(load_snapshot(long_file, window=3000), long_file)
    tr = s.trace()
    assert tr.window and tr.n_total == 20_000 and tr.n == 3000
    lo = tr.window_offset
    assert 0 < lo and lo + tr.n < 20_000          # a window in the middle
    # the peak inside the window is the true peak, at the same event
    assert tr.peak == whole.peak
    assert tr.peak_index + lo == whole.peak_index == tr.window["peak_index"]
    _same_figures(tr, whole, (0, tr.peak_index, tr.n - 1))
    assert tr.event_time_s(tr.peak_index) == whole.event_time_s(whole.peak_index)


@pytest.mark.parametrize("at", [10, 19_990, 15_000])
def test_any_window_has_the_whole_traces_figures(long_file, whole, at):
    tr = Snapshot(load_snapshot(long_file, window=2000, window_at=at), long_file).trace()
    lo = tr.window_offset
    assert lo <= at < lo + tr.n
    _same_figures(tr, whole, (0, tr.n // 2, tr.n - 1))


def test_a_known_length_skips_the_first_pass(long_file, whole):
    tr = open_snapshot(long_file, window=2000, window_at=5000, window_total=20_000).trace()
    assert tr.window_offset == 4000 and tr.window["peak_index"] == -1
    _same_figures(tr, whole, (0, tr.n - 1))


def test_a_short_trace_is_read_once_and_whole(long_file, whole):
    tr = Snapshot(load_snapshot(long_file, window=50_000), long_file).trace()
    assert tr.window is None and tr.n == 20_000 and tr.peak == whole.peak


def _open_traced(path, window):
    tracemalloc.start()
    try:
        tr = Snapshot(load_snapshot(path, window=window), path).trace()
        tr.reserved
        gc.collect()  # what is kept, not garbage not yet collected
        cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return tr, cur, peak


def test_memory_stays_bounded_as_the_trace_grows(tmp_path):
    """The same window of a 4x longer trace: what stays in memory does not grow, and the
    transient peak grows only by the C Unpickler's memo table (8-16 bytes per memoized
    object, two per event in torch's layout), against ~60-90 bytes per event kept whole."""
    small, big = str(tmp_path / "s.pickle"), str(tmp_path / "b.pickle")
    write_long_trace(small, 10_000)
    write_long_trace(big, 40_000)
    ts, cur_s, peak_s = _open_traced(small, 4000)
    tb, cur_b, peak_b = _open_traced(big, 4000)
    assert ts.n_total == 10_000 and tb.n_total == 40_000
    assert 4000 <= ts.n <= 4001 and 4000 <= tb.n <= 4001  # +1: a free pair kept whole
    assert ts.peak == tb.peak  # the same loop: the same peak step
    more = 30_000
    assert cur_b - cur_s < 2 * more, (cur_s, cur_b)        # < 2 bytes per extra event kept
    assert peak_b - peak_s < 40 * more, (peak_s, peak_b)   # the memo table only


def test_summary_says_which_window(long_file, whole):
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "gpumon", "view", long_file, "--summary",
                        "--window", "3000"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "around the peak of the whole trace" in r.stdout
    assert f"(event {whole.peak_index:,} of 20,000" in r.stdout
    r = subprocess.run([sys.executable, "-m", "gpumon", "view", long_file, "--window", "-1"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("gpumon: --window")


async def test_the_view_moves_the_window(long_file, whole):
    from textual.widgets import Static

    from gpumon.tui.view.app import ViewApp
    app = ViewApp(open_snapshot(long_file, window=3000))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        lo = app.tr.window_offset
        head = str(app.query_one("#head", Static).render())
        assert f"window {lo:,}-{lo + app.tr.n - 1:,} of 20,000" in head
        await pilot.press("greater_than_sign")
        await app.workers.wait_for_complete()
        await pilot.pause()
        tr = app.tr
        assert tr.window_offset > lo and tr.window["peak_index"] == whole.peak_index
        assert app.chart.trace is tr and not app.chart.loading
        assert f"window {tr.window_offset:,}-" in str(app.query_one("#head", Static).render())
        # the cursor's event line counts events of the whole trace
        i = app.chart.cursor
        assert f"event {i + tr.window_offset:,} (window {i:,})" in \
            str(app.query_one("#event", Static).render())
        await pilot.press("3")
        await pilot.pause()
        _same_figures(tr, whole, (i,))


def test_window_keeps_exactly_n_events(long_file, whole):
    """--window N kept N + 1 events when the window ended on a free_requested (its completion
    was taken in): the first pass now moves such a window one event later (issue 33)."""
    cut = 0
    for w in range(2990, 3010):
        lo0 = max(0, min(20_000 - w, whole.peak_index - w // 2))
        if whole.action[lo0 + w - 1] == 1 and whole.action[lo0 + w] == 2:
            cut += 1   # a free_requested and its completion at the window's end
        tr = Snapshot(load_snapshot(long_file, window=w), long_file).trace()
        assert tr.n == w, (w, tr.n)
        lo = tr.window_offset
        assert list(tr.allocated) == list(whole.allocated[lo:lo + w])
    assert cut   # the case was met


def test_a_moved_window_keeps_exactly_n_events_too(long_file, whole):
    """A window moved with < > skips the first pass (its length is known): the pairs that
    pass noted are remembered for the file, so the moved window keeps N events as well."""
    for w in range(2990, 3000):
        Snapshot(load_snapshot(long_file, window=w), long_file).trace()   # the first read
        for at in (4000, 9000, 15000):
            tr = Snapshot(load_snapshot(long_file, window=w, window_at=at,
                                        window_total=20_000), long_file).trace()
            assert tr.n == w, (w, at, tr.n)
            lo = tr.window_offset
            assert list(tr.allocated) == list(whole.allocated[lo:lo + w])
