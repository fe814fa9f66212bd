"""`gpumon diff A B`: peaks side by side and the change blamed on lines, files and libraries."""
import json
import pickle
import subprocess
import sys

import pytest

from gpumon.snapshot import Snapshot
from gpumon.snapshot.diff import LEVELS, diff, diff_text
from gpumon.snapshot.synth import _stack, training_snapshot

MB = 1 << 20


def _snap(allocs, path="x.pickle"):
    """A trace of allocations [(file, line, fn, bytes)], all live at the end."""
    ev, blocks, addr = [], [], 0
    for k, (f, line, fn, size) in enumerate(allocs):
        fr = _stack(f, line, fn, "linear")
        ev.append({"action": "alloc", "addr": addr, "size": size, "frames": fr, "time_us": k})
        blocks.append({"address": addr, "size": size, "requested_size": size,
                       "state": "active_allocated", "frames": fr})
        addr += size
    seg = {"device": 0, "address": 0, "total_size": addr, "blocks": blocks}
    return Snapshot({"segments": [seg], "device_traces": [ev]}, path)


A = [("/p/model.py", 10, "forward", 100 * MB), ("/p/model.py", 11, "forward", 10 * MB),
     ("/p/train.py", 5, "step", 50 * MB)]
B = [("/p/model.py", 10, "forward", 300 * MB), ("/p/model.py", 11, "forward", 10 * MB),
     ("/p/train.py", 5, "step", 50 * MB), ("/p/extra.py", 3, "hook", 20 * MB)]


def test_change_is_blamed_on_the_line_and_file_largest_first():
    d = diff(_snap(A, "a"), _snap(B, "b"))
    assert d["change"]["peak"] == 220 * MB
    assert d["a"]["peak"] == 160 * MB and d["b"]["peak"] == 380 * MB
    rows = d["by"]["line"]["rows"]
    assert [(r["where"], r["change"], r["status"]) for r in rows[:2]] == [
        ("model.py:10 forward", 200 * MB, "grew"), ("extra.py:3 hook", 20 * MB, "new")]
    assert {r["where"]: r["change"] for r in rows}["train.py:5 step"] == 0
    files = {r["where"]: r["change"] for r in d["by"]["file"]["rows"]}
    assert files == {"p/model.py": 200 * MB, "p/extra.py": 20 * MB, "p/train.py": 0}
    # the synthetic stacks' innermost Python frame is torch's functional.py
    assert d["by"]["library"]["rows"][0]["where"] == "torch"
    txt = diff_text(d)
    assert "+200.00 MiB  model.py:10 forward" in txt
    assert "extra.py:3 hook [new]" in txt
    assert "train.py:5 step" not in txt  # unchanged rows are left out
    line = [ln for ln in txt.splitlines() if ln.startswith("peak allocated")][0]
    assert line.split()[2:] == ["160.00", "MiB", "380.00", "MiB", "+220.00", "MiB", "(+138%)"]


@pytest.mark.parametrize("top", [1, 3, 50])
def test_every_level_adds_up_to_the_change_and_is_sorted(top):
    a, _ = training_snapshot(steps=3, layers=4)
    b, _ = training_snapshot(steps=3, layers=6, acts_per_layer=4, seed=3)
    d = diff(Snapshot(a, "a"), Snapshot(b, "b"), top=top)
    for by in LEVELS:
        lvl = d["by"][by]
        total = sum(r["change"] for r in lvl["rows"]) + lvl["rest"]["change"]
        assert total == d["change"]["live"] == d["b"]["live"] - d["a"]["live"]
        ch = [abs(r["change"]) for r in lvl["rows"]]
        assert ch == sorted(ch, reverse=True) and len(ch) <= top


def test_same_file_has_no_change():
    a, _ = training_snapshot(steps=2, layers=3)
    d = diff(Snapshot(a, "a"), Snapshot(pickle.loads(pickle.dumps(a)), "b"))
    assert d["change"] == {"peak": 0, "peak_reserved": 0, "live": 0}
    assert all(r["change"] == 0 for by in LEVELS for r in d["by"][by]["rows"])


def test_at_end_and_grep():
    a, _ = training_snapshot(steps=2, layers=3)
    b, _ = training_snapshot(steps=2, layers=5)
    d = diff(Snapshot(a, "a"), Snapshot(b, "b"), at="end", query="train.py")
    assert d["a"]["at_event"] == d["a"]["events"] - 1
    assert all("model.py" not in r["where"] for r in d["by"]["line"]["rows"])


def _gpumon(*args):
    return subprocess.run([sys.executable, "-m", "gpumon", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_cli_text_json_and_errors(tmp_path):
    a, _ = training_snapshot(steps=2, layers=3)
    b, _ = training_snapshot(steps=2, layers=5)
    (tmp_path / "a.pickle").write_bytes(pickle.dumps(a))
    (tmp_path / "b.pickle").write_bytes(pickle.dumps(b))
    r = _gpumon("diff", str(tmp_path / "a.pickle"), str(tmp_path / "b.pickle"), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["change"]["peak"] == d["b"]["peak"] - d["a"]["peak"] > 0
    r = _gpumon("diff", str(tmp_path / "a.pickle"), str(tmp_path / "b.pickle"))
    assert r.returncode == 0 and "peak allocated" in r.stdout and "by source line" in r.stdout
    r = _gpumon("diff", str(tmp_path / "a.pickle"), str(tmp_path / "nope.pickle"))
    assert r.returncode == 1 and r.stderr.startswith("gpumon: ")
    assert len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "bad.pickle").write_bytes(b"not a pickle at all")
    r = _gpumon("diff", str(tmp_path / "bad.pickle"), str(tmp_path / "a.pickle"))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    r = _gpumon("diff", str(tmp_path / "a.pickle"), str(tmp_path / "b.pickle"), "--top", "0")
    assert r.returncode == 2
    r = _gpumon("diff", str(tmp_path / "a.pickle"), str(tmp_path / "b.pickle"), "--device", "3")
    assert r.returncode == 1 and "no device 3" in r.stderr


async def test_diff_tui_levels_and_export(tmp_path, monkeypatch):
    from textual.widgets import DataTable, Static

    from gpumon.tui.view.diff_app import DiffApp
    monkeypatch.chdir(tmp_path)
    d = diff(_snap(A, "/r/a.pickle"), _snap(B, "/r/b.pickle"))
    app = DiffApp(d)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        t = app.query_one("#diff-table", DataTable)
        assert t.row_count == 2   # model.py:10 grew, extra.py:3 is new; the rest unchanged
        assert t.get_row_at(0)[2] == "+200.00 MiB" and t.get_row_at(0)[4] == "model.py:10 forward"
        assert "peak allocated" in str(app.query_one("#diff-head", Static).render())
        await pilot.press("u")
        assert t.row_count == 4
        await pilot.press("g")
        assert app.level == "file" and t.get_row_at(0)[4] == "p/model.py"
        await pilot.press("e")
        await pilot.pause()
        out = (tmp_path / "diff-a-vs-b-by-file.csv").read_text().splitlines()
        assert out[0].startswith("where,a_bytes") and out[1].startswith("p/model.py,")
        await pilot.press("q")


async def test_diff_tui_at_80x24_cuts_no_line_of_its_head(tmp_path):
    """The level line ran past 80 columns ("... (g: line/file/library, u:"): the keys it
    repeated are in the footer."""
    from textual.widgets import Footer, Static

    from gpumon.tui.view.diff_app import DiffApp
    d = diff(_snap(A, "/r/a.pickle"), _snap(B, "/r/b.pickle"))
    app = DiffApp(d)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        level = app.query_one("#diff-level", Static)
        text = str(level.render())
        assert text.startswith("what changed by line") and "2 rows" in text
        assert len(text) <= level.content_size.width, (len(text), level.content_size.width)
        keys = [k.description for k in app.query_one(Footer).query("FooterKey")
                if k.region.right <= 80]
        assert {"line/file/library", "show unchanged", "export CSV"} <= set(keys), keys


async def test_diff_tui_where_column_is_whole_or_cut_at_its_start_at_80x24():
    """At 80 columns the where column lost its end: "make_snapshot_fixtures.py:71 transfor"."""
    from textual.widgets import DataTable

    from gpumon.tui.view.diff_app import DiffApp
    long = "/home/u/project/src/very_long_package_name/make_snapshot_fixtures.py"
    d = diff(_snap([(long, 71, "transformer_block_forward", 10 * MB)], "/r/a.pickle"),
             _snap([(long, 71, "transformer_block_forward", 60 * MB)], "/r/b.pickle"))
    app = DiffApp(d)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        t = app.query_one("#diff-table", DataTable)
        where = str(t.get_row_at(0)[4])
        assert where.endswith("make_snapshot_fixtures.py:71 transformer_block_forward") or \
            where.endswith(":71 transformer_block_forward"), where
        width = sum(c.get_render_width(t) for c in t.columns.values())
        assert width <= 78, width
        await pilot.press("g", "g")  # library: says what it groups by
        assert "library that allocated" in str(app.query_one("#diff-level").render())


def test_the_library_level_says_it_is_who_allocated_and_levels_add_up():
    """Issue 32 item 7: "your code 512 KiB -> 4 KiB" by library beside a line of yours that
    grew 52 MiB. The library level is who made the allocation: said under its table; and
    every level adds up to the same change."""
    from gpumon.snapshot.diff import LIBRARY_NOTE
    d = diff(_snap(A, "a"), _snap(B, "b"))
    txt = diff_text(d)
    assert "by library that made it" in txt and LIBRARY_NOTE[0] in txt
    totals = {by: sum(r["change"] for r in d["by"][by]["rows"]) + d["by"][by]["rest"]["change"]
              for by in LEVELS}
    assert len(set(totals.values())) == 1


def test_a_simulated_snapshot_is_marked_as_view_marks_it():
    """A new user diffed two snapshots of `gpumon demo`: view said SIMULATED, diff did not."""
    a, b = _snap(A, "simulated-123-1.pickle"), _snap(B, "/runs/real.pickle")
    d = diff(a, b)
    assert (d["a"]["simulated"], d["b"]["simulated"]) == (True, False)
    head = diff_text(d).splitlines()[:2]
    assert head[0].endswith("[SIMULATED, not a GPU run]") and "SIMULATED" not in head[1], head
