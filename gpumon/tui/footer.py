"""Textual's footer, less the keys that would be cut: at 80 columns the compact footer showed
"- Zo" (half of "- Zoom out") under the command palette's key. A key is shown whole or not at
all; the keys come in the app's order (help and quit first), the palette's key stays."""
from __future__ import annotations

from rich.cells import cell_len
from textual.widgets import Footer
from textual.widgets._footer import FooterKey


def _width(key: FooterKey) -> int:
    """Cells a key takes in the compact footer's row: "k desc" and its one-cell right margin
    (Textual's CSS for a compact footer); the palette's key: its one-cell border instead."""
    return cell_len(key.key_display) + (1 + cell_len(key.description) if key.description else 0) + 1


class FittingFooter(Footer):
    """A Footer whose keys never end cut at the right edge (see the module's doc)."""

    def compose(self):
        items = list(super().compose())
        width = self.size.width
        if not width or not self.compact:  # wide, the keys fit: Textual's own layout
            yield from items
            return
        palette = [w for w in items if isinstance(w, FooterKey) and w.has_class("-command-palette")]
        room = width - sum(_width(p) for p in palette)
        used = 0
        for w in items:
            if w in palette:
                continue
            if not isinstance(w, FooterKey):  # a group's label or box: left as Textual lays it
                yield w
                continue
            need = _width(w)
            if used + need - 1 > room:  # the last key's margin may fall under the border
                break
            used += need
            yield w
        yield from palette

    def on_resize(self) -> None:
        self.call_after_refresh(self.recompose)
