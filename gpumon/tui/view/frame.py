"""The text of `gpumon view`'s first screen, without Textual or Rich: the header, the timeline
chart (as runs of text and a style name), the event line and the OOM diagnosis. The Textual app
renders these (chart.py, app.py); `plain_first_frame` writes them straight to the terminal as
ANSI while Textual is still being imported, so a file's first screen is up as soon as it is
read (importing Textual and building its first frame takes longer than reading an everyday
snapshot). Imports only the standard library and gpumon.snapshot.
"""
from __future__ import annotations

import bisect
import os

from gpumon.snapshot import fmt_bytes
from gpumon.snapshot import report
from gpumon.snapshot.analysis import (A_ALLOC, ACTIONS, NO_PY_STACK, NO_PY_STACK_HELP,
                                      NO_STACK, fmt_frame, is_user_frame)

_EIGHTHS = " ▁▂▃▄▅▆▇█"
AXIS_W = 13
EVENT_HINT = "←→ move  ,. 1 event  p peak  [] steps  +- zoom  2 live  3 segments here"
EVENT_HINT_SHORT = "←→ ,. move  p peak  [] steps  +- zoom  2 live  3 segs"
# The keys Textual's footer shows (the bindings with show=True, in order); a test checks that
# this list is the app's.
FOOTER_KEYS = (("q", "quit"), ("?", "help"), ("1", "timeline"), ("2", "allocs"),
               ("3", "segments"), ("4", "summary"), ("p", "peak"), ("+", "zoom in"),
               ("-", "zoom out"), ("/", "search"), ("g", "group by"))


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 10_000_000 else f"{n:,}"


def window_note(tr) -> str:
    """Which window of a long trace is shown ("" for a whole trace)."""
    w = getattr(tr, "window", None)
    if not w:
        return ""
    lo = tr.window_offset
    return f"window {_count(lo)}-{_count(lo + tr.n - 1)} of {_count(tr.n_total)} <>"


def _fit(cands, width: int) -> str:
    """The first of the candidate lines (longest form first) that fits `width` columns; the
    last, abbreviated in the middle, when none does."""
    for c in cands:
        if len(c) <= width:
            return c
    c = cands[-1]
    return c if len(c) <= width else c[:max(1, width - 1) // 2] + "…" + \
        c[len(c) - (width - 1 - max(1, width - 1) // 2):]


def _short_name(name: str, room: int) -> str:
    """A file name abbreviated in the middle to `room` columns (its end, the extension and
    the last characters, stays readable)."""
    if len(name) <= room or room < 8:
        return name
    k = (room - 1) // 2
    return name[:k] + "…" + name[len(name) - (room - 1 - k):]


def head_text(snap, tr, window: str = "", width: int = 78) -> str:
    name = os.path.basename(snap.path) or "snapshot"
    sim = "  [SIMULATED, not a GPU run]" if report.is_simulated(snap) else ""
    sims = "  [SIMULATED]" if sim else ""
    note = window or window_note(tr)
    peak = f"peak {fmt_bytes(tr.peak)}"
    if note:
        rest = [f"  {peak}  {note}{sim}", f"  {peak}  {note}{sims}"]
    else:
        rest = [f"  dev {tr.device}  {tr.n:,} events  {peak}{sim}",
                f"  dev {tr.device}  {tr.n:,} events  {peak}{sims}",
                f"  {_count(tr.n)} ev  {peak}{sims}"]
    cands = [name + r for r in rest]
    cands.append(_short_name(name, max(8, width - len(rest[-1]))) + rest[-1])
    return _fit(cands, width)


_PHASE_SHORT = {"forward": "fwd", "backward": "bwd", "optimizer": "optim"}


def step_text(snap, tr, i: int, short: bool = False) -> str:
    """Where event i fell in the loop: "step 3 backward" (gpumon's phases), "in optimizer
    step 2/3" or "after 1/3 steps" (torch's annotations), "" when the file says nothing."""
    at = snap.step_at(i, tr.device) if tr.n else None
    if not at:
        return ""
    if at["source"] == "gpumon":
        ph = at["phase"]
        return f"step {at['step']} {_PHASE_SHORT.get(ph, ph) if short else ph}"
    if at["phase"] == "optimizer":
        return (f"optim step {at['step']}/{at['of']}" if short else
                f"in optimizer step {at['step']}/{at['of']}")
    return f"after {at['step']}/{at['of']} steps"


def event_text(snap, tr, i: int, width: int = 78) -> str:
    """The three lines under the chart, each within `width` columns (abbreviated, never cut
    or wrapped, so the keys stay on the third line at 80x24): the event at the cursor, what
    it did, the keys."""
    if not tr.n:
        return _fit([f"no trace events; {fmt_bytes(tr.base)} live in the segments at the dump",
                     f"no trace events; {fmt_bytes(tr.base)} live at the dump"], width)
    t = tr.event_time_s(i)
    act = ACTIONS[tr.action[i]]
    where = tr.where(tr.fid[i])[0] if tr.fid[i] else (
        NO_PY_STACK if tr.action[i] == A_ALLOC else "-")
    off = getattr(tr, "window_offset", 0)
    ev = f"{i + off:,}" + (f" (window {i:,})" if off else "")
    cat = tr.packed.category.get(i) if tr.packed.category else None
    cat = f" [{str(cat).lower()}]" if cat is not None else ""
    a, r = fmt_bytes(tr.allocated[i]), fmt_bytes(tr.reserved[i])
    st, sts = step_text(snap, tr, i), step_text(snap, tr, i, short=True)
    peak = f"  (peak {fmt_bytes(tr.peak)} @ {tr.peak_index + off:,})"
    when, whens = (f"  t={t:.3f}s", f" {t:.2f}s") if t is not None else ("", "")
    line1 = _fit([
        f"event {ev}{when}  allocated {a}  reserved {r}  {st}{peak}",
        f"event {ev}{when}  allocated {a}  reserved {r}  {st}",
        f"event {ev}{when}  alloc {a}  reserved {r}  {sts}",
        f"ev {ev}{whens}  alloc {a}  resv {r}  {sts}",
        f"ev {ev}  alloc {a}  resv {r}  {sts}"], width).rstrip()
    idx = getattr(tr, "module_index", None)  # the sidecar's module enter/leave
    mod = f"  in {idx.key_at(i)}" if idx is not None and tr.action[i] == A_ALLOC else ""
    line2 = _fit([f"{act} {fmt_bytes(tr.size[i])}{cat}  {where}{mod}",
                  f"{act} {fmt_bytes(tr.size[i])}{cat}{mod}  {where}"], width)
    return f"{line1}\n{line2}\n{_fit([EVENT_HINT, EVENT_HINT_SHORT], width)}"


def _lib_frame(f) -> str:
    """A library frame with its path from the package on (torch/nn/modules/linear.py:125
    forward): the site-packages prefix takes half a line at 80 columns."""
    fn = f[0].replace("\\", "/")
    for m in ("/site-packages/", "/dist-packages/"):
        k = fn.rfind(m)
        if k >= 0:
            fn = fn[k + len(m):]
            break
    else:
        k = fn.find("/lib/python3")
        if k >= 0:
            fn = fn[fn.find("/", k + 5) + 1:]
    return f"{fn}:{f[1]} {f[2]}"


def _module_plumbing(f) -> bool:
    return f[2] in ("_call_impl", "_wrapped_call_impl") and \
        f[0].replace("\\", "/").endswith("torch/nn/modules/module.py")


def stack_lines(tr, kind: str, v, full: bool = False) -> list[str]:
    """The stack pane of the allocations tab for a group (kind "group", v a Group: its
    largest allocation) or one allocation (kind "el", v its element id). Python first: the
    user's frame, the library frames it called on the way to the allocation, its callers;
    the C++ frames of a stacks='all' trace folded into one line (`full`: every frame, as
    recorded, innermost first)."""
    j = v.elements[0] if kind == "group" else v
    lines = []
    if kind == "group":
        lines.append(f"{v.key}: {fmt_bytes(v.bytes)} in {v.count} allocations")
    start = tr.el_start[j]
    lines.append(("largest: " if kind == "group" else "")
                 + f"{fmt_bytes(tr.el_size[j])} at 0x{tr.el_addr[j]:x}, allocated "
                 + (f"at event {start + tr.window_offset:,}" if start >= 0
                    else "before the trace window")
                 + (f", freed at event {tr.el_end[j] + tr.window_offset:,}"
                    if tr.el_end[j] < tr.n else ""))
    fid = tr.el_fid[j]
    nm = tr.namer
    param = nm.param(j) if nm is not None else None
    if param:
        lines.append(f"the .grad of {param} (gpumon saw it at the optimizer step)")
    if full:
        frames = tr.frames(fid)
        if start < 0 and tr.freed_only(j) and frames:
            lines.append("(its alloc is not in the trace; this is the stack of its free)")
        lines += [("  " if not f[0].endswith(".py") else "") + fmt_frame(f, full=True)
                  for f in frames]
        if frames:
            lines.append("(every frame as recorded, innermost first; f folds the C++ ones)")
    else:
        head, callers, cpp = tr.python_first(fid)
        if start < 0 and tr.freed_only(j) and (head or cpp):
            lines.append("(its alloc is not in the trace; this is the stack of its free)")
        if head:
            lines.append(fmt_frame(head[0], full=True))
            # nn.Module's call plumbing between two forwards says nothing: left out
            led = [f for f in head[1:] if not _module_plumbing(f)]
            lines += ["  -> " + _lib_frame(f) for f in led]
        if callers:
            lines.append("called from:")
            lines += ["  " + (fmt_frame(f, full=True) if is_user_frame(f[0]) else _lib_frame(f))
                      for f in callers if not _module_plumbing(f)]
        if cpp:
            if head:
                lines.append(f"+ {len(cpp)} C++ frames, innermost {cpp[0][2][:60]} "
                             "(f shows them)")
            else:
                name = tr.stackless_name(j)
                if name:
                    lines.append(f"no Python frame: named <{name}> from its C++ frames")
                lines += ["  " + fmt_frame(f, full=True) for f in cpp]
    hidden = len(tr.frames(fid)) - len(tr.shown_frames(fid))
    if not fid:
        name = tr.stackless_name(j)
        if start < 0 and not name:
            lines.append(NO_STACK)
        elif not name:
            lines.append(NO_PY_STACK + ": " + NO_PY_STACK_HELP)
        else:
            if name.startswith("made in "):
                why = f"it was made while the loop was in {name[8:]} (gpumon's phase timeline)"
            elif name.startswith(("gradients of ", "parameters of ")):
                why = "gpumon saw its address at the optimizer step"
            else:
                why = "C++ code with no Python caller made it (autograd's backward thread, " \
                      "for one)"
            lines.append(f"no Python frame: {why}; `gpumon snapshot --stacks all` records "
                         "its C++ caller")
    elif hidden and not full:
        lines.append(f"({hidden} unwinder, interpreter, allocator and dispatcher frames "
                     "hidden; f shows every frame)")
    if kind == "group" and v.count > 1:
        lines.append(f"(enter on the group lists its {v.count} allocations)")
    return lines


_CAT_SHORT = {"parameter": "param", "optimizer_state": "optim", "gradient": "grad",
              "activation": "act", "autograd_detail": "autograd", "temporary": "temp"}


def _col_of(event: int, lo: int, hi: int, cols: int) -> int:
    return (event - lo) * cols // max(1, hi - lo)


_PHASE_MARK = {"forward": "f", "backward": "b", "optimizer": "o"}


def phase_marks(phases, lo: int, hi: int, cols: int) -> list[str]:
    """Per column, the initial of the phase of gpumon's tracker its middle event fell in (f
    forward, b backward, o optimizer, · other), " " where none is known."""
    out = [" "] * cols
    if not phases:
        return out
    starts = [p[0] for p in phases]
    span = max(1, hi - lo)
    for c in range(cols):
        e = lo + (span * c + span * (c + 1)) // (2 * cols)
        k = bisect.bisect_right(starts, e) - 1
        if k >= 0 and phases[k][0] <= e <= phases[k][1]:
            out[c] = _PHASE_MARK.get(phases[k][3], "·")
    return out


def step_stride(n_steps: int, cols: int) -> int:
    """Every how many optimizer steps a marker is drawn so that markers stand at least three
    columns apart: 1, 2, 5, 10, 20, 50, ... (a long run's 1,650 steps filled every column)."""
    every = 1
    while n_steps / every > max(1, cols // 3):
        every = every * 5 // 2 if str(every)[0] == "2" else every * 2
    return every


# -- moving along the timeline: the app's chart (chart.py) and the plain frame share this ------

def nav_cursor(n: int, lo: int, hi: int, event: int) -> tuple[int, int, int]:
    """(cursor, lo, hi) with the cursor on `event` (clamped to the trace); the visible window
    [lo, hi) moves, its width kept, when the cursor leaves it."""
    n = max(1, n)
    cursor = max(0, min(n - 1, event))
    if not lo <= cursor < hi:
        span = hi - lo
        lo = max(0, min(n - span, cursor - span // 2))
        hi = lo + span
    return cursor, lo, hi


def nav_zoom(n: int, lo: int, hi: int, cursor: int, factor: float) -> tuple[int, int]:
    """The window [lo, hi) zoomed by `factor` (0.5 in, 2 out) around the cursor."""
    n = max(1, n)
    span = max(8, min(n, int((hi - lo) * factor)))
    lo = max(0, min(n - span, cursor - span // 2))
    return lo, min(n, lo + span)


def nav_events_per_col(lo: int, hi: int, cols: int) -> int:
    return max(1, (hi - lo) // max(1, cols))


def chart_rows(tr, lo: int, hi: int, cursor: int, steps, oom_event: int, show_reserved: bool,
               w: int, h: int, phases=None) -> list[list[tuple[str, str]]]:
    """The timeline chart in `w` x `h` cells: one list of (text, style) runs per row. Styles:
    axis, bar, res (reserved line), peak, cur (cursor), mark (step), curmark, label, phase.
    `phases`: the spans of gpumon's phases (Snapshot.phase_spans), marked by their initials
    on the markers' row where no other mark stands."""
    cols = max(1, w - AXIS_W)
    cats = tr.categories if tr.n else []
    rows = max(1, h - 2 - (1 if cats else 0))  # last two rows: markers and the axis
    dec = tr.decimate(lo, hi, cols, with_min=False) if tr.n else []
    rdec = tr.decimate_series(tr.reserved, lo, hi, cols, with_min=False) \
        if tr.n and show_reserved else []
    top = max([mx for _, mx in dec] + [mx for _, mx in rdec] + [tr.peak, 1])
    cur_col = _col_of(cursor, lo, hi, cols) if tr.n else -1
    peak_col = _col_of(tr.peak_index, lo, hi, cols) if lo <= tr.peak_index < hi else -1
    oom_col = _col_of(oom_event, lo, hi, cols) if lo <= oom_event < hi else -1
    out: list[list[tuple[str, str]]] = []
    heights = [mx * rows * 8 / top for _, mx in dec]
    bands = []  # per column: [(upper edge in eighths, style)], bottom first
    if cats:
        # the profiler's categories, stacked as memory_viz colours them: each column as it
        # stands at its highest event
        legend = [(" " * (AXIS_W - 1) + " ", "axis")]
        room = w - AXIS_W
        for c in cats:
            name = _CAT_SHORT.get(c, c)
            if room < len(name) + 2:
                break
            legend += [("■", "cat:" + c), (f"{name} ", "axis")]
            room -= len(name) + 2
        out.append(legend)
        series = [(c, tr.category_series(c)) for c in cats]
        span = max(1, min(hi, tr.n) - lo)
        for c in range(len(dec)):
            s0 = lo + span * c // cols
            e0 = max(s0 + 1, lo + span * (c + 1) // cols)
            chunk = tr.allocated[s0:e0]
            at = s0 + chunk.index(max(chunk))
            edge, band = 0, []
            other = tr.allocated[at] - sum(sr[at] for _, sr in series)
            for name, b in [("", other)] + [(n, sr[at]) for n, sr in series]:
                if b > 0:
                    edge += b * rows * 8 / top
                    band.append((edge, "cat:" + name if name else "bar"))
            bands.append(band)
    # the reserved line: the row whose band holds each column's reserved maximum
    res_row = [rows - 1 - min(rows - 1, int(mx * rows / top)) for _, mx in rdec]
    for r in range(rows):
        level_lo = (rows - 1 - r) * 8
        if r == 0:
            label = fmt_bytes(top)
        elif r == rows - 1:
            label = "0"
        elif r == rows // 2:
            label = fmt_bytes(top / 2)
        else:
            label = ""
        label = label[:AXIS_W - 2]
        line = [(f"{label:>{AXIS_W - 2}} ┤" if label else " " * (AXIS_W - 1) + "│", "axis")]
        cells = []
        for c in range(cols):
            if c < len(heights):
                v = heights[c] - level_lo
                ch = _EIGHTHS[8] if v >= 8 else _EIGHTHS[max(0, int(v))]
            else:
                ch = " "
            st = "bar"
            if bands and c < len(bands) and ch != " ":
                mid = level_lo + min(8.0, heights[c] - level_lo) / 2
                st = next((b for e, b in bands[c] if e > mid), bands[c][-1][1] if bands[c]
                          else "bar")
            if c < len(res_row) and res_row[c] == r and ch != _EIGHTHS[8]:
                ch, st = "─", "res"
            if c == cur_col:
                ch, st = (ch if ch != " " else "│"), "cur"
            elif c == peak_col:
                ch, st = (ch if ch != " " else "┊"), "peak"
            cells.append((ch, st))
        k = 0
        while k < len(cells):  # one run per style
            st = cells[k][1]
            e = k
            while e < len(cells) and cells[e][1] == st:
                e += 1
            line.append(("".join(ch for ch, _ in cells[k:e]), st))
            k = e
        out.append(line)
    # markers: phases (f b o ·), steps (|), peak (^), OOM (X), cursor (▲)
    marks = phase_marks(phases, lo, hi, cols) if tr.n else [" "] * cols
    shown = [(k, e) for k, (e, _) in enumerate(steps) if lo <= e < hi]
    every = step_stride(len(shown), cols)
    for k, e in shown:
        if (k + 1) % every == 0:
            c = _col_of(e, lo, hi, cols)
            if 0 <= c < cols:
                marks[c] = "|"
    if 0 <= peak_col < cols:
        marks[peak_col] = "^"
    if 0 <= oom_col < cols:
        marks[oom_col] = "X"
    if 0 <= cur_col < cols:
        marks[cur_col] = "▲"
    line = [(" " * (AXIS_W - 1) + "└", "axis")]
    for ch in marks:
        line.append((ch, "peak" if ch in "^X" else ("curmark" if ch == "▲" else
                                                     ("mark" if ch in " |" else "phase"))))
    out.append(line)
    per_col = max(1, (hi - lo) // cols)
    off = getattr(tr, "window_offset", 0)
    left = f"event {lo + off:,}"
    right = f"{max(lo, hi - 1) + off:,}  ({per_col:,} events/col)"
    if every > 1:   # said where it fits: the markers are every Nth step
        for cand in (f"  (| every {every} steps, {per_col:,} events/col)",
                     f"  (| every {every} steps, {per_col:,} ev/col)",
                     f"  (| every {every} steps)"):
            if len(left) + len(f"{max(lo, hi - 1) + off:,}") + len(cand) + 1 <= w - AXIS_W:
                right = f"{max(lo, hi - 1) + off:,}{cand}"
                break
    gap = max(1, w - AXIS_W - len(left) - len(right))
    out.append([(" " * AXIS_W + left + " " * gap + right, "axis")])
    return out


def default_show_reserved(tr) -> bool:
    """The reserved line, unless the file came from the profiler's memory timeline (it has
    categories): the segments torch.cuda._memory_viz makes for it span the addresses used,
    not memory the allocator held."""
    return not tr.categories


def oom_text(o: dict) -> str:
    lines = [
        f"OUT OF MEMORY at event {o.get('event_abs', o['event']):,}",
        "",
        f"asked for         {fmt_bytes(o['requested'])}",
        f"free on device    {fmt_bytes(o['device_free'])}"
        + (f" of {fmt_bytes(o['device_total'])}" if o["device_total"] else ""),
        f"live (allocated)  {fmt_bytes(o['live_allocated'])}",
        f"reserved          {fmt_bytes(o['reserved'])}",
        f"cached free       {fmt_bytes(o['cached_free'])} (largest block "
        f"{fmt_bytes(o['largest_free_block'])})",
        f"reserved but unusable for this request  {fmt_bytes(o['unusable_reserved'])}",
    ]
    if o.get("torch_allocated") is not None:
        lines.append(f"torch.cuda.memory_allocated() in the OOM observer: "
                     f"{fmt_bytes(o['torch_allocated'])} (sidecar)")
    lines += ["", "verdict: " + o["verdict"], "", "the failing call:"]
    lines += ["  " + f for f in (o.get("call") or o["stack"])] or ["  (no stack recorded)"]
    lines += ["", "what held the memory (first user frame):"]
    for g in o["top"]:
        lines.append(f"  {fmt_bytes(g['bytes']):>11} {g['count']:>5}x  {g['where']}")
        for f in g.get("largest_stack", [])[:6]:
            lines.append(f"        {f}")
    lines += ["", "o: cursor to the OOM on the timeline; 2: everything live there"]
    return "\n".join(lines)


def oom_bar(o: dict) -> str:
    return f"OOM: asked {fmt_bytes(o['requested'])}, {o['kind']} — press 6 for the diagnosis"


def tab_labels(oom: bool) -> list[str]:
    return ["1 Timeline", "2 Allocations", "3 Segments", "4 Summary", "5 Leaks"] + \
        (["6 OOM"] if oom else [])


# -- the plain frame ---------------------------------------------------------------------------

# torch's own colours for the categories (torch.profiler._memory_profiler._CATEGORY_TO_COLORS:
# darkgreen, goldenrod, black (shown light here, on a dark terminal), mediumblue, red,
# royalblue, mediumpurple, grey)
CATEGORY_RGB = {"parameter": (0x2E, 0x8B, 0x57), "optimizer_state": (0xDA, 0xA5, 0x20),
                "input": (0xC0, 0xC0, 0xC0), "gradient": (0x3B, 0x5B, 0xDB),
                "activation": (0xE0, 0x31, 0x31), "autograd_detail": (0x41, 0x69, 0xE1),
                "temporary": (0x93, 0x70, 0xDB), "unknown": (0x80, 0x80, 0x80)}
CATEGORY_SGR = {k: "38;2;%d;%d;%d" % v for k, v in CATEGORY_RGB.items()}
_SGR = {**{"cat:" + k: v for k, v in CATEGORY_SGR.items()}, "axis": "", "bar": "36",
        "res": "33", "peak": "1;31", "cur": "7", "mark": "32", "curmark": "1", "label": "", "head": "1;97;44", "tab": "1;4", "tabs": "2",
        "footkey": "1;7", "foot": "", "oom": "97;41", "phase": "2"}
_MONO = {"cur": "7", "curmark": "1", "peak": "1", "head": "7", "tab": "1;4", "footkey": "1;7",
         "oom": "7"}


def _wrap(text: str, width: int) -> list[str]:
    import textwrap
    out = []
    for para in text.split("\n"):
        out += textwrap.wrap(para, max(1, width), break_on_hyphens=False) or [""]
    return out


def hang_wrap(text: str, width: int) -> str:
    """Text wrapped at `width` with hanging indents: a continued line starts under its
    value's column (the summary's 16-column labels, an indented line's own indent), so a
    summary stays readable in 80 columns."""
    import textwrap
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        lead = len(line) - len(line.lstrip(" "))
        if not lead and len(line) > 17 and line[14:16] == "  " and line[16] != " ":
            lead = 16
        elif lead:
            lead += 2
        out += textwrap.wrap(line, max(20, width), subsequent_indent=" " * min(lead, width // 2),
                             break_on_hyphens=False, drop_whitespace=True) or [""]
    return "\n".join(out)


def _cut(s: str, w: int) -> str:
    return s[:w]


def frame_rows(snap, tr, oom: dict | None, steps, w: int, h: int, window: str = "",
               view: tuple[int, int, int] | None = None,
               show_reserved: bool | None = None) -> list[list[tuple[str, str]]]:
    """The whole first screen as the app lays it out at w x h: header, OOM bar, tabs, the
    timeline (or the OOM diagnosis), the event lines and the footer. `view`: (cursor, lo, hi)
    on the timeline (default: the cursor on the peak, the whole trace shown)."""
    rows: list[list[tuple[str, str]]] = [[(_cut(" " + head_text(snap, tr, window, w - 2), w),
                                            "head")]]
    if oom:
        for line in _wrap(oom_bar(oom), w - 2)[:3]:
            rows.append([(" " + line, "oom")])
    tabs = []
    active = "6 OOM" if oom else "1 Timeline"
    for t in tab_labels(bool(oom)):
        tabs += [(" ", "tabs"), (t, "tab" if t == active else "tabs"), (" ", "tabs")]
    rows.append(tabs)
    rows.append([("━" * w, "tabs")])
    body_h = h - len(rows) - 1  # the footer
    if oom:
        body = [[(" " + line[:w - 1], "")] for line in oom_text(oom).split("\n")]
        rows += body[:body_h]
    else:
        i, lo, hi = view or (tr.peak_index if tr.peak_index >= 0 else 0, 0, max(1, tr.n))
        if show_reserved is None:
            show_reserved = default_show_reserved(tr)
        ev = _wrap(event_text(snap, tr, i, w - 2), w - 2)[:3]
        chart_h = max(1, body_h - 3)
        rows += chart_rows(tr, lo, hi, i, steps, -1, show_reserved, w, chart_h,
                           snap.phase_spans(tr.device))
        rows += [[(" " + line, "")] for line in ev]
    while len(rows) < h - 1:
        rows.append([])
    foot = []
    used = 0
    for key, what in FOOTER_KEYS:
        piece = len(key) + len(what) + 3
        if used + piece > w:
            break
        foot += [(f" {key} ", "footkey"), (f"{what} ", "foot")]
        used += piece
    rows = rows[:h - 1] + [foot]
    return rows


def render_ansi(rows, w: int, mono: bool) -> str:
    sgr = _MONO if mono else _SGR
    out = ["\x1b[?1049h\x1b[?25l\x1b[H\x1b[2J"]
    if not mono:
        rows = [[(t, st if st in sgr or not st.startswith("cat:") else "cat:unknown")
                 for t, st in line] for line in rows]
    for r, line in enumerate(rows):
        out.append(f"\x1b[{r + 1};1H")
        used = 0
        for text, st in line:
            text = text[:max(0, w - used)]
            if not text:
                continue
            used += len(text)
            code = sgr.get(st, "")
            out.append(f"\x1b[{code}m{text}\x1b[0m" if code else text)
        out.append("\x1b[K")
    return "".join(out)


_KEY_NAMES = {"?": "question_mark", "/": "slash", "+": "plus", "-": "minus", "=": "equals_sign",
              ",": "comma", ".": "full_stop", "[": "left_square_bracket",
              "]": "right_square_bracket", "<": "less_than_sign", ">": "greater_than_sign", "\r": "enter", "\n": "enter", "\t": "tab"}
_SS3_KEYS = {"A": "up", "B": "down", "C": "right", "D": "left", "H": "home", "F": "end",
             "P": "f1"}
_CSI_KEYS = {**{k: v for k, v in _SS3_KEYS.items() if k != "P"},
             "1~": "home", "7~": "home", "4~": "end", "8~": "end", "11~": "f1", "21~": "f10",
             "5~": "pageup", "6~": "pagedown", "2~": "insert", "3~": "delete"}


def keys_of(text: str) -> list[str]:
    """Textual key names for typed text: letters, digits, the view's punctuation, the arrow
    and other escape-sequence keys; anything else is dropped."""
    return split_keys(text, final=True)[0]


def split_keys(text: str, final: bool = False) -> tuple[list[str], str]:
    """(the Textual key names of typed text, what is left of it): an escape sequence cut at
    the end of a read is left for the next (unless `final`). An escape sequence of a key not
    named here is dropped whole (its bytes are not taken for "[" and digits)."""
    out = []
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\x1b":
            if i + 1 >= n:
                if not final:
                    return out, text[i:]
                out.append("escape")
                break
            nxt = text[i + 1]
            if nxt == "O":              # SS3: ESC O letter
                if i + 2 >= n:
                    if not final:
                        return out, text[i:]
                    break
                k = _SS3_KEYS.get(text[i + 2])
                if k:
                    out.append(k)
                i += 3
                continue
            if nxt == "[":              # CSI: ESC [ parameters, then a final byte @..~
                j = i + 2
                while j < n and not "\x40" <= text[j] <= "\x7e":
                    j += 1
                if j >= n:
                    if not final:
                        return out, text[i:]
                    break
                k = _CSI_KEYS.get(text[i + 2:j + 1])
                if k:
                    out.append(k)
                i = j + 1
                continue
            out.append("escape")
        elif ch.isascii() and ch.isalnum():
            out.append(ch)
        elif ch in _KEY_NAMES:
            out.append(_KEY_NAMES[ch])
        i += 1
    return out, ""


# The keys the plain frame acts on itself (Textual's key names, the app's default bindings: a
# test checks them against ViewApp.BINDINGS) -> the binding id. Every other key waits for the
# app, and so does every key typed after one of them (the order they were typed in is kept).
PLAIN_KEYS = {"left": "view.left", "right": "view.right", "comma": "view.prev_event",
              "full_stop": "view.next_event", "home": "view.start", "end": "view.end",
              "p": "view.peak", "left_square_bracket": "view.prev_step",
              "right_square_bracket": "view.next_step", "plus": "view.zoom_in",
              "equals_sign": "view.zoom_in", "minus": "view.zoom_out", "r": "view.reserved"}
QUIT_KEYS = ("q", "f10")


class PlainFrame:
    """The first screen written as plain ANSI on the alternate screen while Textual loads. It
    acts on the timeline's keys itself (`act`: PLAIN_KEYS), drawing the frame again, and hands
    where it stands (`view`, `show_reserved`) to the app; other keys typed meanwhile are not
    echoed and stay queued for the app. `close()` puts the terminal's modes back (the app then
    takes the screen over without clearing it first); `abandon()` also leaves the alternate
    screen (when the app will not start)."""

    def __init__(self, fd_out: int, fd_in: int):
        self.fd_out, self.fd_in = fd_out, fd_in
        self.saved = None
        self.view: tuple[int, int, int] | None = None   # (cursor, lo, hi) once moved
        self.show_reserved: bool | None = None
        self._args = None

    def show(self, snap, tr, oom, steps, no_color: bool, window: str = "") -> None:
        try:
            w, h = os.get_terminal_size(self.fd_out)
        except OSError:
            w, h = 0, 0
        if w < 20 or h < 8:  # unknown (0x0) or too small to be of use: as Textual's default
            w, h = 80, 24
        try:
            import termios
            self.saved = termios.tcgetattr(self.fd_in)
            new = termios.tcgetattr(self.fd_in)
            new[3] &= ~(termios.ECHO | termios.ICANON)
            termios.tcsetattr(self.fd_in, termios.TCSANOW, new)
        except (ImportError, OSError, Exception):  # noqa: BLE001 - a display nicety only
            self.saved = None
        self._args = (snap, tr, oom, steps, no_color, window, w, h)
        self.draw()

    def draw(self) -> None:
        snap, tr, oom, steps, no_color, window, w, h = self._args
        data = render_ansi(frame_rows(snap, tr, oom, steps, w, h, window, self.view,
                                      self.show_reserved), w, no_color)
        os.write(self.fd_out, data.encode("utf-8", "replace"))

    def act(self, key: str) -> bool:
        """Do what `key` (a Textual key name) does on the app's timeline and draw the frame
        again; False (nothing done) for a key the app must handle: another tab, the help, a
        key remapped by GPUMON_KEYS (then every key is the app's), a step key with no step
        to go to (the app says so), anything on an OOM file's first screen (its OOM tab)."""
        if self._args is None or key not in PLAIN_KEYS or os.environ.get("GPUMON_KEYS"):
            return False
        snap, tr, oom, steps, _nc, _win, w, _h = self._args
        if oom or not tr.n:
            return False
        n = tr.n
        cursor, lo, hi = self.view or (max(0, tr.peak_index), 0, max(1, n))
        what = PLAIN_KEYS[key]
        cols = max(1, w - AXIS_W)
        target = None
        if what in ("view.left", "view.right"):
            target = cursor + (1 if what == "view.right" else -1) * \
                nav_events_per_col(lo, hi, cols)
        elif what in ("view.prev_event", "view.next_event"):
            target = cursor + (1 if what == "view.next_event" else -1)
        elif what in ("view.start", "view.end", "view.peak"):
            target = {"view.start": 0, "view.end": n - 1, "view.peak": tr.peak_index}[what]
        elif what in ("view.prev_step", "view.next_step"):
            bounds = [e for e, _ in steps]
            nxt = [e for e in bounds if e > cursor] if what == "view.next_step" else \
                [e for e in bounds if e < cursor]
            if not nxt:
                return False   # the app says "no further optimizer step"
            target = nxt[0] if what == "view.next_step" else nxt[-1]
        elif what in ("view.zoom_in", "view.zoom_out"):
            lo, hi = nav_zoom(n, lo, hi, cursor, 0.5 if what == "view.zoom_in" else 2)
        elif what == "view.reserved":
            shown = self.show_reserved
            self.show_reserved = not (default_show_reserved(tr) if shown is None else shown)
        if target is not None:
            cursor, lo, hi = nav_cursor(n, lo, hi, target)
        self.view = (cursor, lo, hi)
        self.draw()
        return True

    def typed_keys(self) -> list[str]:
        """The keys typed while the plain frame was up (read from the terminal now, so the app
        can replay them: Textual drops what arrives before its screen is ready)."""
        if self.saved is None:
            return []
        import select
        data = b""
        try:
            while select.select([self.fd_in], [], [], 0)[0] and len(data) < 256:
                b = os.read(self.fd_in, 256)
                if not b:
                    break
                data += b
        except OSError:
            return []
        return keys_of(data.decode("utf-8", "replace"))

    def close(self) -> None:
        if self.saved is not None:
            try:
                import termios
                termios.tcsetattr(self.fd_in, termios.TCSANOW, self.saved)
            except Exception:  # noqa: BLE001
                pass
            self.saved = None

    def abandon(self) -> None:
        self.close()
        try:
            os.write(self.fd_out, b"\x1b[?25h\x1b[?1049l")
        except OSError:
            pass
