"""The overview table drawn by hand (_FastTable) is segment for segment Rich's table."""
import pytest
from rich.console import Console
from rich.segment import Segment
from rich.text import Text

from gpumon.tui.widgets.panels import OverviewTable, _FastTable


def _rows(n, big=False):
    return tuple((Text("■", "red"), Text(f"rank {i}", "bold"), f"cuda:{i}",
                  Text("✗ exited" if i == 1 else "● running", "bold green"),
                  f"{i * 1.37:.2f} GiB" if not big else f"{i * 1000:.1f} GiB", "2.00 GiB",
                  "3.10 GiB", "300 MiB", Text("3" if i == 2 else "0", "bold red" if i == 2 else ""),
                  Text.assemble(("██", "green"), ("▒", "yellow"), ("····", "dim"), " 5%"))
                 for i in range(n))


def _lines(console, renderable):
    out = list(console.render(renderable, console.options))
    return [[(s.text, str(s.style or None)) for s in Segment.simplify(line)]
            for line in Segment.split_lines(out)]


@pytest.mark.parametrize("width", [200, 160, 120, 100, 80, 60])
@pytest.mark.parametrize("n,big,caption", [(2, False, None), (8, False, "balanced: within 3%"),
                                           (3, True, "imbalance +40%: peak allocated ...")])
def test_fast_table_matches_rich(width, n, big, caption):
    table = OverviewTable(lambda: [], lambda: 0.0, ["red"])
    rows = _rows(n, big)
    cap = Text(caption, "green") if caption else None
    c = Console(width=width, color_system="truecolor", legacy_windows=False)
    assert _lines(c, _FastTable(table, rows, cap)) == _lines(c, table._rich_table(rows, cap))
    # cached widths: a second frame with other figures still matches
    rows2 = _rows(n, not big)
    assert _lines(c, _FastTable(table, rows2, cap)) == _lines(c, table._rich_table(rows2, cap))


@pytest.mark.parametrize("avail", [40, 36, 24])
@pytest.mark.parametrize("extra", [(), (Text.assemble(("conf ", "dim"), "expandable_segments:True,"
                                                        "garbage_collection_threshold:0.8"),)])
def test_fast_grid_matches_rich(avail, extra):
    from textual.geometry import Size
    from gpumon.tui.widgets.panels import FiguresPanel, _FastGrid

    class P(FiguresPanel):
        @property
        def content_size(self):
            return Size(avail, 20)

    panel = P(None, 0, lambda: 0.0)
    rows = ((Text(""), Text("now", "bold"), Text("peak", "bold")),
            (Text("allocated", "green"), Text("1.25 GiB", "green"), Text("3.00 GiB", "green")),
            (Text("alloc retries", "dim"), Text("3", "bold white on red"), Text("OOMs 0", "")),
            (Text("a label far too long for it", "dim"), Text("x"), Text("y")))
    for content in ((rows[:3], extra), (rows, extra)):  # the last row falls back to Rich
        c = Console(width=avail, color_system="truecolor", legacy_windows=False)
        assert _lines(c, _FastGrid(panel, content)) == _lines(c, panel._rich_grid(content, avail))
