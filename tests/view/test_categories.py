"""Category colours, as memory_viz draws a snapshot made from the profiler's memory timeline
(issue 18). The file is a real one: scripts/make_profiler_snapshot.py ran torch's
_profile_to_snapshot on three AdamW steps (its alloc events carry "category")."""
import os
import pickle

import pytest

from gpumon.snapshot import open_snapshot, report
from gpumon.snapshot.analysis import NO_CATEGORY
from gpumon.tui.view import frame

FILE = os.path.join(os.path.dirname(__file__), "data", "profiler_categories.pickle")


@pytest.fixture(scope="module")
def snap():
    return open_snapshot(FILE)


def _independent_bytes_by_category(i):
    """Live bytes per category after event i, replayed here from the raw events."""
    ev = pickle.load(open(FILE, "rb"))["device_traces"][0]
    live = {}
    for k, e in enumerate(ev[:i + 1]):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("category"))
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    # MemoryViz counts a free_requested + free_completed pair as freed at the first
    if i + 1 < len(ev) and ev[i]["action"] == "free_requested" and \
            ev[i + 1]["action"] == "free_completed" and ev[i + 1]["addr"] == ev[i]["addr"]:
        live.pop(ev[i]["addr"], None)
    out = {}
    for size, cat in live.values():
        if cat:
            out[cat] = out.get(cat, 0) + size
    return out


def test_categories_are_read(snap):
    tr = snap.trace()
    assert {"parameter", "optimizer_state", "gradient", "activation"} <= set(tr.categories)
    assert tr.categories.index("parameter") < tr.categories.index("activation")
    at = tr.peak_index
    groups = {g.key: g.bytes for g in tr.groups_at(at, by="category")}
    expect = _independent_bytes_by_category(at)
    assert {k: v for k, v in groups.items() if k != NO_CATEGORY} == expect
    assert sum(groups.values()) == tr.allocated[at]
    for name in tr.categories:  # the chart's series agree with the groups
        assert tr.category_series(name)[at] == groups.get(name, 0)


def test_the_chart_is_coloured_by_category(snap):
    tr = snap.trace()
    rows = frame.chart_rows(tr, 0, tr.n, tr.peak_index, [], -1, False, 80, 18)
    legend = "".join(t for t, _ in rows[0])
    assert "param" in legend and "optim" in legend and "grad" in legend
    # the column of each cell, with its style
    grid = []
    for line in rows[1:-2]:
        cells = []
        for text, st in line[1:]:
            cells += [(ch, st) for ch in text]
        grid.append(cells)
    styles = {st for row in grid for _, st in row if st.startswith("cat:")}
    assert {"cat:parameter", "cat:optimizer_state", "cat:gradient"} <= styles
    # stacked bottom-up in memory_viz's order: parameters below optimizer state
    for c in range(len(grid[0])):
        col_styles = [grid[r][c][1] for r in range(len(grid) - 1, -1, -1)
                      if grid[r][c][1].startswith("cat:")]
        if "cat:parameter" in col_styles and "cat:optimizer_state" in col_styles:
            assert col_styles.index("cat:parameter") < col_styles.index("cat:optimizer_state")
    ansi = frame.render_ansi(rows, 80, mono=False)
    assert frame.CATEGORY_SGR["parameter"] in ansi  # torch's darkgreen, in true colour


def test_summary_and_grouping_by_category(snap):
    s = report.summary(snap, by="category")
    cats = s["categories_at_peak"]
    assert cats and list(cats.values()) == sorted(cats.values(), reverse=True)
    text = report.summary_text(s)
    assert "by category     " in text and "live at the peak, by category:" in text


async def test_the_view_colours_by_category_and_hides_the_fake_reserved(snap):
    from gpumon.tui.view.app import ViewApp
    app = ViewApp(snap)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert app.chart.show_reserved is False   # memory_viz's profile segments are not a cache
        text = app.chart.render()
        colours = {str(sp.style.color.triplet.hex) for sp in text.spans
                   if sp.style and getattr(sp.style, "color", None) and sp.style.color.triplet}
        assert "#2e8b57" in colours and "#daa520" in colours   # parameter, optimizer state
        cat = app.tr.packed.category.get(app.chart.cursor)
        line = str(app.query_one("#event").render())
        assert (f"[{cat}]" in line) if cat else ("[" not in line)
