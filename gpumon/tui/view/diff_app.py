"""`gpumon diff A B --tui`: the comparison of two snapshots in the terminal. It only renders
the dict gpumon.snapshot.diff.diff() makes: the peaks side by side, and one table of the change
by source line, file or library (`g` cycles), largest change first; `e` writes it as CSV."""
from __future__ import annotations

import os

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Static

from gpumon.snapshot import fmt_bytes
from gpumon.snapshot.diff import LEVELS, diff_text
from gpumon.tui.footer import FittingFooter
from gpumon.tui.keys import HELP_KEYS, HelpScreen, InterruptibleApp, raise_if_interrupted

CSS = """
#diff-head { height: auto; padding: 0 1; background: $boost; }
#diff-level { height: 1; padding: 0 1; }
#diff-table { height: 1fr; }
"""


DIFF_HELP = """[b]gpumon diff: keys[/b]
  g       by line, file, library (each byte of B's growth is in one row of each;
          library: the one whose code made the allocation, so a line of yours
          calling torch is under torch there)
  u       show / hide the rows that did not change
  e       write the table as CSV (diff-A-vs-B-by-LEVEL.csv)
  ↑ ↓     move in the table; pgup pgdn a page
  ?  h  F1  this help
  q, F10  quit; ctrl+c quits with status 130

Press escape to close."""


def _signed(n: int) -> str:
    return ("+" if n > 0 else "") + fmt_bytes(n) if n else "0"


class DiffApp(InterruptibleApp):
    TITLE = "gpumon diff"
    CSS = CSS
    BINDINGS = [
        Binding("q,f10", "quit", "quit", key_display="q", id="diff.quit"),
        Binding(HELP_KEYS, "help", "help", key_display="?", id="diff.help"),
        Binding("g", "level", "line/file/library", id="diff.level"),
        Binding("u", "unchanged", "show unchanged", id="diff.unchanged"),
        Binding("e", "export", "export CSV", id="diff.export"),
    ]

    def __init__(self, d: dict, **kw):
        super().__init__(**kw)
        self.d = d
        self.level = "line"
        self.show_unchanged = False

    def compose(self) -> ComposeResult:
        head = diff_text(self.d).split("\n\nwhat changed", 1)[0]
        yield Static(head, id="diff-head", markup=False)
        yield Static("", id="diff-level", markup=False)
        yield DataTable(id="diff-table", cursor_type="row", zebra_stripes=True)
        yield FittingFooter()

    def on_mount(self) -> None:
        t = self.query_one("#diff-table", DataTable)
        t.add_columns("A", "B", "change", "", "where")
        self._fill()
        t.focus()

    def rows(self) -> list[dict]:
        rows = self.d["by"][self.level]["rows"]
        return rows if self.show_unchanged else [r for r in rows if r["change"]]

    def _fill(self) -> None:
        t = self.query_one("#diff-table", DataTable)
        t.clear()
        rows = self.rows()
        cells = [(fmt_bytes(r["a_bytes"]), fmt_bytes(r["b_bytes"]), _signed(r["change"]),
                  {"new": "new", "gone": "gone", "grew": "▲", "shrank": "▼"}.get(r["status"], ""))
                 for r in rows]
        # the where column gets what the others leave, its start cut rather than its end (at
        # 80 columns "make_snapshot_fixtures.py:71 transfor" lost the function's name)
        fixed = sum(max([len(h)] + [len(c[i]) for c in cells]) + 2
                    for i, h in enumerate(("A", "B", "change", "")))
        room = max(20, (self.size.width or 100) - fixed - 4)  # its padding, the scrollbar
        for r, c in zip(rows, cells):
            where = r["where"]
            t.add_row(*c, where if len(where) <= room else "…" + where[-(room - 1):])
        rest = self.d["by"][self.level]["rest"]
        more = f"; {rest['rows']} more rows ({_signed(rest['change'])}) past --top" \
            if rest["rows"] else ""
        # the keys (g, u, e) are in the footer: this line says only what the table holds, so
        # it fits 80 columns
        who = " that allocated" if self.level == "library" else ""  # see diff.LIBRARY_NOTE
        self.query_one("#diff-level", Static).update(
            f"what changed by {self.level}{who}, largest first: {len(rows)} rows{more}")

    def on_resize(self) -> None:
        if self.query_one("#diff-table", DataTable).columns:  # (before on_mount: no columns)
            self._fill()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(DIFF_HELP))

    def action_level(self) -> None:
        self.level = LEVELS[(LEVELS.index(self.level) + 1) % len(LEVELS)]
        self._fill()

    def action_unchanged(self) -> None:
        self.show_unchanged = not self.show_unchanged
        self._fill()

    def action_export(self) -> None:
        import csv
        name = "diff-" + "-vs-".join(
            os.path.splitext(os.path.basename(self.d[k]["file"]) or k)[0] for k in ("a", "b")) \
            + f"-by-{self.level}.csv"
        cols = ["where", "a_bytes", "b_bytes", "change", "a_count", "b_count", "status"]
        try:
            with open(name, "w", encoding="utf-8", newline="") as f:
                w = csv.writer(f, lineterminator="\n")
                w.writerow(cols)
                w.writerows([r[c] for c in cols] for r in self.d["by"][self.level]["rows"])
        except OSError as e:
            self.notify(f"cannot write {name}: {e.strerror or e}", severity="error")
            return
        self.notify(f"wrote {name}")


def run_diff_app(d: dict) -> int:
    app = DiffApp(d)
    app.run()
    raise_if_interrupted(app)
    return 0
