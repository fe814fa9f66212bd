"""Issue 33, item 3: long runs. Event numbers are the whole trace's everywhere (the HTML said
"peak at event 500,000" where the summary said 6,665,694), optimizer steps are a band thinned
to what the width shows (1,650 dashed lines painted the chart green), and the chart is a step
function (it ramped between events)."""
import pickle
import re

import pytest

from gpumon.snapshot import open_snapshot
from gpumon.snapshot import report
from gpumon.snapshot.synth import training_snapshot


@pytest.fixture(scope="module")
def many_steps(tmp_path_factory):
    data, _ = training_snapshot(steps=400, layers=2, acts_per_layer=1, small_per_layer=0,
                                hidden=1 << 16, leak_per_step=4096)
    p = tmp_path_factory.mktemp("long") / "steps.pickle"
    p.write_bytes(pickle.dumps(data))
    return p


def test_html_event_numbers_are_the_whole_traces(many_steps):
    snap = open_snapshot(many_steps, window=3000, window_at=10_000)
    tr = snap.trace()
    assert tr.window and tr.window_offset > 0
    s = report.summary(snap)
    page = report.html_page(snap)
    m = re.search(r"peak allocated [^<]*? at event ([\d,]+)", page)
    assert m and int(m.group(1).replace(",", "")) == s["peak"]["event"]
    m = re.search(r'<line id="peak"[^>]*data-event="(\d+)"', page)
    assert int(m.group(1)) == s["peak"]["event"]
    first = re.search(r">event ([\d,]+)</text>", page).group(1)
    assert int(first.replace(",", "")) == tr.window_offset
    assert f'"off": {tr.window_offset}' in page   # the hover readout counts from there too


def test_steps_are_a_thinned_band(many_steps):
    snap = open_snapshot(many_steps, window=0)
    steps = snap.step_boundaries()
    assert len(steps) == 400
    page = report.html_page(snap)
    assert "stroke-dasharray" not in page        # no line per step across the chart
    rects = re.findall(r'<rect class="step" data-step="(\d+)"[^>]*width="([\d.]+)"', page)
    assert 1 < len(rects) <= 1010 // 3 + 1
    assert all(float(w) >= 0.5 for _, w in rects)
    labels = [int(x) for x in re.findall(r'class="step-label"[^>]*>(\d+)<', page)]
    assert 2 <= len(labels) <= 12
    gap = labels[1] - labels[0]
    assert gap in (1, 2, 5, 10, 20, 50, 100) and labels == list(range(gap, 401, gap))


def test_tui_step_marks_thinned_to_the_width(many_steps):
    from gpumon.tui.view.frame import chart_rows
    snap = open_snapshot(many_steps, window=0)
    tr = snap.trace()
    rows = chart_rows(tr, 0, tr.n, 0, snap.step_boundaries(), -1, True, 80, 14)
    marks = "".join(t for t, _ in rows[-2])[13:]
    assert 0 < marks.count("|") <= (80 - 13) // 3, marks
    axis = "".join(t for t, _ in rows[-1])
    assert "every" in axis and "steps" in axis   # the thinning is said
    assert "events/col" in axis   # what the first-screen benchmark and test wait for


def test_oom_page_labels_do_not_overlap():
    """The OOM fixture's peak, peak-reserved and OOM labels sit at the chart's top right; on the
    old page the two peak labels were drawn over each other (y 22 and 24). Checked by their
    text boxes here, and by eye in headless Chromium."""
    import html as htmlmod
    import os
    snap = open_snapshot(os.path.join(os.path.dirname(__file__), "..", "fixtures", "snapshots",
                                      "oom.pickle"))
    page = report.html_page(snap)
    boxes = []
    for ident in ("peak-label", "peak-reserved-label", "oom-label"):
        m = re.search(rf'<text id="{ident}" x="([\d.]+)" y="([\d.]+)" text-anchor="(\w+)"'
                      rf'[^>]*font-size="(\d+)"[^>]*>([^<]+)</text>', page)
        assert m, ident
        x, y, anchor, size, text = float(m[1]), float(m[2]), m[3], int(m[4]), m[5]
        w = 0.55 * size * len(htmlmod.unescape(text))   # narrower than the layout assumes
        x0, x1 = (x - w, x) if anchor == "end" else (x, x + w)
        boxes.append((x0, x1, y - size, y, ident))
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            apart = a[1] < b[0] or b[1] < a[0] or a[3] <= b[2] or b[3] <= a[2]
            assert apart, (a, b)
