"""Keys shared by gpumon's two apps: GPUMON_KEYS remapping (with one warning line for what it
cannot use) and a help screen built from the bindings as they are now, so a remapped key shows
its new key in the help, the footer and the palette alike."""
from __future__ import annotations

import os
from typing import Iterable

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from gpumon.interrupt import INTERRUPTED, Interrupted

ENV = "GPUMON_KEYS"
HELP_KEYS = "question_mark,h,f1"  # ? as in less and vim, h and F1 as in htop and nvitop


def binding_ids(bindings: Iterable) -> list[str]:
    """The ids of a BINDINGS list, in order."""
    return [b.id for b in bindings if isinstance(b, Binding) and b.id]


def parse_keymap(text: str | None, known: Iterable[str]) -> tuple[dict[str, str], str | None]:
    """GPUMON_KEYS ("id=key,id=key") -> (the keymap of known ids, one warning line or None).
    Unknown ids and entries without '=' are left out and named in the warning."""
    known = list(known)
    keymap: dict[str, str] = {}
    unknown: list[str] = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        bid, eq, key = part.partition("=")
        bid, key = bid.strip(), key.strip()
        if not eq or not key or bid not in known:
            unknown.append(part)
            continue
        keymap[bid] = key
    if not unknown:
        return keymap, None
    return keymap, (f"{ENV}: ignored {', '.join(repr(u) for u in unknown)}: the binding ids are "
                    f"{', '.join(known)} (e.g. {ENV}=\"{known[0]}=X\")")


def apply_env_keymap(app: App, bindings: Iterable) -> str | None:
    """Apply GPUMON_KEYS to app; the warning line (for app.notify) or None."""
    keymap, warning = parse_keymap(os.environ.get(ENV), binding_ids(bindings))
    if keymap:
        app.set_keymap(keymap)
    return warning


def live_keys(app: App, bindings: Iterable) -> dict[str, str]:
    """binding id -> the key(s) that run it now (after GPUMON_KEYS), as the footer shows them."""
    ids = binding_ids(bindings)
    keys: dict[str, list[str]] = {i: [] for i in ids}
    keymap = getattr(app, "_keymap", None) or {}
    for b in bindings:
        if not isinstance(b, Binding) or not b.id:
            continue
        for n, k in enumerate((keymap.get(b.id) or b.key).split(",")):
            k = k.strip()
            # key_display names the first key only (help: "?", then h and F1 as they are)
            shown = b.key_display if (b.key_display and b.id not in keymap and n == 0) else \
                app.get_key_display(Binding(k, b.action))
            if shown not in keys[b.id]:
                keys[b.id].append(shown)
    return {i: "/".join(v) for i, v in keys.items()}


def help_lines(app: App, bindings: Iterable, described: dict[str, str],
               extra: Iterable[tuple[str, str]] = ()) -> list[str]:
    """One line per described binding: its live key, what it does, [its id]. `extra`: keys that
    are not bindings of the app (a widget's own arrows), as (key, text)."""
    keys = live_keys(app, bindings)
    rows = [(keys.get(bid) or "?", text, bid) for bid, text in described.items() if bid in keys]
    rows += [(k, t, "") for k, t in extra]
    width = max((len(k) for k, _, _ in rows), default=1)
    return [f"  {_esc(f'{k:<{width}}')}  {_esc(t)}" + (f"  [dim]{_esc(f'[{bid}]')}[/]"
                                                       if bid else "")
            for k, t, bid in rows]


def _esc(text: str) -> str:
    """Every '[' escaped (textual.markup.escape leaves a lone '[' key as it is, and the line's
    own tags then fail to parse)."""
    return text.replace("\\", "\\\\").replace("[", "\\[")


class InterruptibleApp(App):
    """gpumon's interrupt rule on a screen (gpumon/interrupt.py): Ctrl-C quits with 130, as
    htop, nvitop and memray do, instead of Textual's "Press ctrl+q to quit" toast. A priority
    binding, so a focused search field does not take it for "copy". An app whose screen
    started something (a recording) overrides action_interrupt to finish it first and sets
    interrupt_outcome; the runner then calls raise_if_interrupted(app)."""
    BINDINGS = [Binding("ctrl+c", "interrupt", "Quit", show=False, priority=True,
                        system=True)]
    interrupt_outcome: str | None = None

    def action_interrupt(self) -> None:
        self.exit(return_code=INTERRUPTED)


def raise_if_interrupted(app: App) -> None:
    """After app.run(): Ctrl-C in the app ends the command as Ctrl-C anywhere does."""
    if app.return_code == INTERRUPTED:
        raise Interrupted(getattr(app, "interrupt_outcome", None))


class HelpScreen(ModalScreen):
    """A scrollable text over the app; escape, q, ?, h or F1 closes it. Where it does not fit,
    the box's bottom border says how to scroll (a scrollbar alone read as the end of it)."""
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > #help-box { width: 96; max-width: 100%; height: auto; max-height: 100%;
        border: round $accent; background: $surface; padding: 0 1;
        border-subtitle-color: $accent; }
    """
    BINDINGS = [Binding("escape,q," + HELP_KEYS, "app.pop_screen", "Close", id="help_close")]
    MORE = "↓ ↑ pgdn pgup: more · esc: close"

    def __init__(self, text: str) -> None:
        super().__init__()
        self._text = text

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(self._text, id="help-text")

    def on_mount(self) -> None:
        self.query_one("#help-box").focus()  # the arrows and page keys scroll it at once
        self.call_after_refresh(self._hint)

    def on_resize(self) -> None:
        self.call_after_refresh(self._hint)

    def _hint(self) -> None:
        box = self.query_one("#help-box", VerticalScroll)
        box.border_subtitle = self.MORE if box.max_scroll_y > 0 else ""
