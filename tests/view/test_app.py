"""Pilot tests of the `gpumon view` screens, and SVG snapshots at 80x24 and 200x60."""
import pickle

import pytest
from textual.widgets import DataTable, Input, Static, TabbedContent, Tree

from gpumon.snapshot import Snapshot, fmt_bytes
from gpumon.snapshot.synth import training_snapshot
from gpumon.tui.view.app import ViewApp


def _train():
    data, _ = training_snapshot(steps=3, layers=4, max_entries=400, seed=3)
    return Snapshot(pickle.loads(pickle.dumps(data)), "/runs/train.pickle")


def _oom():
    data, _ = training_snapshot(steps=3, layers=6, oom_at_step=1, oom_kind="fragmented",
                                capacity=400 << 20, seed=3)
    return Snapshot(data, "/runs/oom.pickle")


def _text(app, sel):
    return str(app.query_one(sel, Static).render())


async def test_opens_on_the_timeline_at_the_peak():
    app = ViewApp(_train())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert app.query_one("#tabs", TabbedContent).active == "timeline"
        assert app.chart.cursor == app.tr.peak_index
        assert "event" in _text(app, "#event")


async def test_cursor_keys_move_and_allocations_follow():
    app = ViewApp(_train())
    async with app.run_test(size=(100, 30)) as pilot:
        tr = app.tr
        await pilot.press("home")
        assert app.chart.cursor == 0
        await pilot.press("right", "right")
        assert app.chart.cursor == 2 * app.chart.events_per_col()
        await pilot.press("full_stop")
        c = app.chart.cursor
        await pilot.press("comma")
        assert app.chart.cursor == c - 1
        await pilot.press("end")
        assert app.chart.cursor == tr.n - 1
        await pilot.press("p")
        assert app.chart.cursor == tr.peak_index
        await pilot.press("2")
        await pilot.pause()
        assert app.query_one("#tabs", TabbedContent).active == "allocs"
        tree = app.query_one("#alloc-tree", Tree)
        assert len(tree.root.children) == len(tr.groups_at(tr.peak_index))
        head = _text(app, "#alloc-head")
        assert f"live at event {tr.peak_index:,}" in head
        # back to the timeline, move, and the allocations list follows the cursor
        await pilot.press("1", "home", "2")
        await pilot.pause()
        assert "live at event 0:" in _text(app, "#alloc-head")


async def test_step_boundaries_keys():
    app = ViewApp(_train())
    async with app.run_test(size=(80, 24)) as pilot:
        bounds = [e for e, _ in app.snap.step_boundaries()]
        await pilot.press("home", "right_square_bracket")
        assert app.chart.cursor == bounds[0]
        await pilot.press("right_square_bracket")
        assert app.chart.cursor == bounds[1]
        await pilot.press("left_square_bracket")
        assert app.chart.cursor == bounds[0]


async def test_zoom_in_and_out():
    app = ViewApp(_train())
    async with app.run_test(size=(80, 24)) as pilot:
        span = app.chart.hi - app.chart.lo
        await pilot.press("plus")
        assert app.chart.hi - app.chart.lo < span
        assert app.chart.lo <= app.chart.cursor < app.chart.hi
        await pilot.press("minus", "minus")
        assert app.chart.hi - app.chart.lo == span


async def test_select_shows_the_stack():
    app = ViewApp(_train())
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("2")
        await pilot.pause()
        tree = app.query_one("#alloc-tree", Tree)
        # find a group with a user stack, expand it, go to its first allocation
        for _ in range(40):
            node = tree.cursor_node
            if node is not None and node.data and node.data[1].key.startswith("model.py"):
                break
            await pilot.press("down")
        assert "model.py" in _text(app, "#stack-text")
        await pilot.press("enter")
        await pilot.press("down")
        await pilot.pause()
        stack = _text(app, "#stack-text")
        assert "/home/user/proj/model.py" in stack and "functional.py" in stack


async def test_search_filters_allocations():
    app = ViewApp(_train())
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("slash")
        assert isinstance(app.focused, Input)
        await pilot.press(*"Block1", "enter")
        await pilot.pause()
        tree = app.query_one("#alloc-tree", Tree)
        labels = [str(n.label) for n in tree.root.children]
        assert labels and all("Block1" in lab for lab in labels)
        assert "matching 'Block1'" in _text(app, "#alloc-head")
        await pilot.press("escape")
        await pilot.pause()
        assert len(tree.root.children) > len(labels)


async def test_segments_and_summary_tabs():
    app = ViewApp(_train())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3")
        table = app.query_one("#seg-table", DataTable)
        assert table.row_count == len(app.tr.segment_infos())
        assert "fragmentation" in _text(app, "#seg-head")
        await pilot.press("4")
        await app.workers.wait_for_complete()  # computed in a thread, under a loading indicator
        await pilot.pause()
        assert "peak allocated" in _text(app, "#summary-text")
        assert not app.query_one("#summary").loading
        await pilot.press("6")  # no OOM here: a notice, no crash
        assert app.query_one("#tabs", TabbedContent).active == "summary"


async def test_oom_snapshot_opens_on_the_diagnosis():
    app = ViewApp(_oom())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert app.query_one("#tabs", TabbedContent).active == "oom"
        txt = _text(app, "#oom-text")
        assert "verdict: fragmented" in txt and "asked for" in txt
        await pilot.press("o", "1")
        assert app.chart.cursor == app.tr.n - 1


async def test_resize_and_quit():
    app = ViewApp(_train())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.resize_terminal(160, 48)
        await pilot.pause()
        assert app.chart.plot_cols > 100
        await pilot.resize_terminal(40, 12)
        await pilot.pause()
        await pilot.press("q")
    assert app.return_code in (0, None)


@pytest.mark.parametrize("size", [(80, 24), (200, 60)])
def test_snapshot_timeline(snap_compare, size):
    assert snap_compare(ViewApp(_train()), terminal_size=size)


@pytest.mark.parametrize("size", [(80, 24), (200, 60)])
def test_snapshot_allocations(snap_compare, size):
    assert snap_compare(ViewApp(_train()), press=["2"], terminal_size=size)


def test_snapshot_oom(snap_compare):
    assert snap_compare(ViewApp(_oom()), terminal_size=(80, 24))


async def test_no_color_from_env(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    app = ViewApp(_train())
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2", "3", "4", "1")
        assert app.query_one("#tabs", TabbedContent).active == "timeline"
        assert app.no_color


async def test_no_color_flag_does_not_leak():
    import os
    app = ViewApp(_train(), no_color=True)
    assert app.no_color and "NO_COLOR" not in os.environ
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2", "1")
        assert app.query_one("#tabs", TabbedContent).active == "timeline"
    assert not ViewApp(_train()).no_color


def test_snapshot_no_color(snap_compare):
    assert snap_compare(ViewApp(_train(), no_color=True), terminal_size=(80, 24))


async def test_simulated_snapshot_is_labelled_in_the_header():
    s = _train()
    s.sidecar = {"simulated": True}
    app = ViewApp(s)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert "SIMULATED" in _text(app, "#head")
        await pilot.press("4")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "SIMULATED" in _text(app, "#summary-text")


async def test_segments_follow_the_cursor():
    app = ViewApp(_train())
    tr = app.tr
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("home", "3")
        await pilot.pause()
        table = app.query_one("#seg-table", DataTable)
        assert table.row_count == len(tr.segments_at(0))
        assert "at event 0:" in _text(app, "#seg-head")
        await pilot.press("1", "end", "3")
        await pilot.pause()
        assert table.row_count == len(tr.segment_infos())
        assert "at the dump" in _text(app, "#seg-head")
        assert f"reserved {fmt_bytes(tr.reserved[-1])}" in _text(app, "#event")


async def test_oom_segments_say_whether_the_request_would_fit():
    app = ViewApp(_oom())
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("3")
        await pilot.pause()
        assert "would need a new segment" in _text(app, "#seg-head")


async def test_group_by_export_and_leaks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = ViewApp(_train())
    tr = app.tr
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("2")
        await pilot.pause()
        tree = app.query_one("#alloc-tree", Tree)
        await pilot.press("g", "g")   # line -> function -> file
        await pilot.pause()
        assert app.group_by == "file"
        assert len(tree.root.children) == len(tr.groups_at(tr.peak_index, by="file"))
        await pilot.press("e")
        await pilot.pause()
        out = list(tmp_path.glob("train-live-event*-by-file.csv"))
        assert len(out) == 1
        rows = out[0].read_text().splitlines()
        assert rows[0].startswith("where,bytes") and len(rows) == len(tree.root.children) + 1
        await pilot.press("5")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert "step" in _text(app, "#leaks-text")


async def test_full_frames_toggle():
    from tests.view.test_fixes import _all_stacks_snapshot
    app = ViewApp(_all_stacks_snapshot())
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.press("end", "2")
        await pilot.pause()
        txt = _text(app, "#stack-text")
        assert txt.startswith("<autograd MmBackward0>") and "torch::unwind" not in txt
        assert "frames hidden; f shows every frame" in txt
        await pilot.press("f")
        await pilot.pause()
        assert app.full_frames and "torch::unwind::unwind()" in _text(app, "#stack-text")
