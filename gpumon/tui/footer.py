"""Textual's footer, less the keys that would be cut: at 80 columns the compact footer showed
"- Zo" (half of "- Zoom out") under the command palette's key. A key is shown whole or not at
all; the keys come in the app's BINDINGS order (help and quit first), the palette's key stays.
The order is the app's, not Textual's: a key remapped with GPUMON_KEYS moves to the end of
Textual's binding map, and at 80 columns a remapped quit or help fell off the footer."""
from __future__ import annotations

from rich.cells import cell_len
from textual.widgets import Footer
from textual.widgets._footer import FooterKey


def _width(key: FooterKey, compact: bool) -> int:
    """Cells a key takes in the footer's row (Textual's CSS for FooterKey). Compact: "k desc"
    and a one-cell right margin; the palette's key: its one-cell border instead. Otherwise:
    " k desc " (the key padded on both sides, the description's one-cell padding on its right),
    no margin; the palette's key the same (measured: 12 cells for "^p palette")."""
    k, d = cell_len(key.key_display), cell_len(key.description)
    if compact:
        return k + (1 + d if d else 0) + 1
    return k + 2 + d + 1 if d else k


def binding_order(app) -> dict[str, int]:
    """action -> its place in the app's BINDINGS (the first binding of each action)."""
    order: dict[str, int] = {}
    for i, b in enumerate(getattr(app, "BINDINGS", ())):
        action = getattr(b, "action", None)
        if action is not None:
            order.setdefault(action, i)
    return order


def _signature(items) -> tuple:
    """What a footer's items show: equal for two composes that put up the same keys."""
    return tuple((type(w).__name__, getattr(w, "key", None), getattr(w, "key_display", None),
                  getattr(w, "description", None), getattr(w, "action", None),
                  getattr(w, "_disabled", None), str(getattr(w, "tooltip", None)),
                  tuple(sorted(w.classes))) for w in items)


class FittingFooter(Footer):
    """A Footer whose keys never end cut at the right edge (see the module's doc)."""

    _shown = None  # what the last compose put up (_signature), for recompose

    def compose(self):
        items = self._fit()
        self._shown = _signature(items)
        yield from items

    async def recompose(self) -> None:
        # Textual recomposes a footer each time the bindings may have changed (5 times while
        # the view starts) and on each resize, remounting every key and its styles: ~0.1 s of
        # the view's start on 2 cores. Only when the keys it would show differ from those up.
        try:
            same = self._shown is not None and _signature(self._fit()) == self._shown
        except Exception:  # noqa: BLE001 - a group (composed inside Textual's stack): as Textual
            same = False
        if not same:
            await super().recompose()

    def _fit(self) -> list:
        items = list(super().compose())
        width = self.size.width
        if not width:  # not laid out yet: Textual's own layout; on_resize fits it
            return items
        out = []
        palette = [w for w in items if isinstance(w, FooterKey) and w.has_class("-command-palette")]
        keys = [w for w in items if w not in palette]
        if all(isinstance(w, FooterKey) for w in keys):  # no groups: the app's order
            order = binding_order(self.app)
            keys.sort(key=lambda w: order.get(w.action, len(order)))  # stable: others after
        room = width - sum(_width(p, self.compact) for p in palette)
        slack = 1  # the last key's blank last cell (margin or padding) may fall under the border
        used = 0
        for w in keys:
            if not isinstance(w, FooterKey):  # a group's label or box: left as Textual lays it
                out.append(w)
                continue
            need = _width(w, self.compact)
            if used + need - slack > room:
                break
            used += need
            out.append(w)
        return out + palette

    def on_resize(self) -> None:
        self.call_after_refresh(self.recompose)
