"""Two snapshots side by side (`gpumon diff A B`): their peaks, and the difference in what was
live at each one's peak (or end) blamed on source lines, files and libraries, largest change
first. The question it answers is the one asked after changing the batch size, the model or
torch: what grew, and where was it allocated?"""
from __future__ import annotations

import json

from .analysis import Snapshot, fmt_bytes
from .report import is_simulated

LEVELS = ("line", "file", "library")


def _side(snap: Snapshot, device: int | None, at: str, query: str) -> tuple[dict, int]:
    tr = snap.trace(device)
    i = tr.peak_index if at == "peak" else tr.n - 1
    pr, pr_at = tr.peak_reserved
    return {
        "file": snap.path, "device": tr.device, "events": tr.n,
        "peak": tr.peak, "peak_event": tr.peak_index,
        "peak_reserved": pr, "peak_reserved_event": pr_at,
        "at": at, "at_event": i, "live": tr.allocated_at(i),
        "reserved_at_dump": tr.segment_totals()["reserved"],
        "simulated": is_simulated(snap),
    }, i


def _rows(a_groups, b_groups) -> list[dict]:
    rows: dict[str, dict] = {}
    for side, groups in (("a", a_groups), ("b", b_groups)):
        for g in groups:
            r = rows.setdefault(g.key, {"where": g.key, "a_bytes": 0, "b_bytes": 0,
                                        "a_count": 0, "b_count": 0})
            r[f"{side}_bytes"] += g.bytes
            r[f"{side}_count"] += g.count
    out = list(rows.values())
    for r in out:
        r["change"] = r["b_bytes"] - r["a_bytes"]
        r["status"] = ("new" if not r["a_count"] else "gone" if not r["b_count"]
                       else "grew" if r["change"] > 0 else "shrank" if r["change"] < 0
                       else "same")
    out.sort(key=lambda r: (-abs(r["change"]), -r["b_bytes"], r["where"]))
    return out


def diff(a: Snapshot, b: Snapshot, device_a: int | None = None, device_b: int | None = None,
         at: str = "peak", query: str = "", top: int = 20) -> dict:
    """The comparison as plain data (for --json and the text). Each level's rows add up to the
    change in live bytes at the compared points; rows past `top` are summed in `rest`."""
    sa, ia = _side(a, device_a, at, query)
    sb, ib = _side(b, device_b, at, query)
    ta, tb = a.trace(device_a), b.trace(device_b)
    levels = {}
    matched = {}
    # by module too when a side carries gpumon's module annotations (its sidecar's modules)
    extra = ("module",) if ta.module_index is not None or tb.module_index is not None else ()
    for by in LEVELS + extra:
        ga, gb = ta.groups_at(ia, query, by), tb.groups_at(ib, query, by)
        if query and by == "line":
            # the selection's own totals: what matches, not the whole file's live bytes
            sa["live"], sb["live"] = sum(g.bytes for g in ga), sum(g.bytes for g in gb)
            matched = {"a": sum(g.count for g in ga), "b": sum(g.count for g in gb)}
        rows = _rows(ga, gb)
        shown, rest = rows[:top], rows[top:]
        levels[by] = {
            "rows": shown,
            "rest": {"rows": len(rest), "a_bytes": sum(r["a_bytes"] for r in rest),
                     "b_bytes": sum(r["b_bytes"] for r in rest),
                     "change": sum(r["change"] for r in rest)},
        }
    return {
        "a": sa, "b": sb, "query": query or None,
        # allocations matching `query` at each side's point (None: no query, all of them)
        "matched": matched or None,
        "change": {"peak": sb["peak"] - sa["peak"],
                   "peak_reserved": sb["peak_reserved"] - sa["peak_reserved"],
                   "live": sb["live"] - sa["live"]},
        "by": levels,
    }


# The library level groups by who made the allocation (the innermost Python frame), not by
# whose line it is: a line of yours that calls an nn.Module is under that line above and under
# torch here, so "your code" here is only what your own lines allocate directly. Said under the
# table: "your code 512 KiB -> 4 KiB" beside a line of yours that grew 52 MiB read as a
# contradiction. Each level adds up to the same total change.
LIBRARY_NAME = "library that made it"
LIBRARY_NOTE = ("(a line of yours that calls torch or transformers is counted under that line "
                "above",
                "and under the library here: `your code` is what your lines allocate "
                "themselves)")


def _pct(new: int, old: int) -> str:
    return f" ({100 * (new - old) / old:+.0f}%)" if old else ""


def _signed(n: int) -> str:
    return ("+" if n > 0 else "") + fmt_bytes(n) if n else "0"


def _sim(side: dict) -> str:
    """As `gpumon view` marks it: made by the simulated source (demo, CI), not by a GPU."""
    return "  [SIMULATED, not a GPU run]" if side.get("simulated") else ""


def diff_text(d: dict, width: int = 100) -> str:
    a, b, c = d["a"], d["b"], d["change"]
    lines = [
        f"A  {a['file']}  (device {a['device']}, {a['events']:,} events){_sim(a)}",
        f"B  {b['file']}  (device {b['device']}, {b['events']:,} events){_sim(b)}",
        "",
        f"{'':16}{'A':>12}  {'B':>12}  {'change':>12}",
        f"{'peak allocated':16}{fmt_bytes(a['peak']):>12}  {fmt_bytes(b['peak']):>12}  "
        f"{_signed(c['peak']):>12}{_pct(b['peak'], a['peak'])}",
        f"{'peak reserved':16}{fmt_bytes(a['peak_reserved']):>12}  "
        f"{fmt_bytes(b['peak_reserved']):>12}  {_signed(c['peak_reserved']):>12}"
        f"{_pct(b['peak_reserved'], a['peak_reserved'])}",
    ]
    point = "at each one's peak" if a["at"] == "peak" else "at the end of each trace"
    if d.get("query"):
        point += f", stacks matching '{d['query']}'"
    label = ("matching" if d.get("query") else "live ") + \
        (" at peak" if a["at"] == "peak" else " at end")
    lines.append(f"{label:16}"
                 f"{fmt_bytes(a['live']):>12}  {fmt_bytes(b['live']):>12}  "
                 f"{_signed(c['live']):>12}")
    if d.get("query"):
        lines.append(f"  (peaks: the whole files'; the line above and the tables: only "
                     f"allocations with a frame matching '{d['query']}')")
    names = {"line": "source line", "file": "file (Python module)", "library": LIBRARY_NAME,
             "module": "module (nn.Module forward/backward)"}
    for by, n in (("line", None), ("file", 8), ("library", 6), ("module", 12)):
        lvl = d["by"].get(by)
        if lvl is None:
            continue
        rows = lvl["rows"] if n is None else lvl["rows"][:n]
        lines += ["", f"what changed {point}, by {names[by]} (largest change first):",
                  f"  {'A':>11} {'B':>11} {'change':>12}  where"]
        for r in rows:
            if not r["change"]:
                continue
            tag = f" [{r['status']}]" if r["status"] in ("new", "gone") else ""
            where = (r["where"] + tag)[:max(20, width - 41)]
            lines.append(f"  {fmt_bytes(r['a_bytes']):>11} {fmt_bytes(r['b_bytes']):>11} "
                         f"{_signed(r['change']):>12}  {where}")
        rest = lvl["rest"] if n is None else None
        if rest and rest["rows"]:
            lines.append(f"  {fmt_bytes(rest['a_bytes']):>11} {fmt_bytes(rest['b_bytes']):>11} "
                         f"{_signed(rest['change']):>12}  ({rest['rows']} more)")
        if by == "library":
            lines += [f"  {x}" for x in LIBRARY_NOTE]
    return "\n".join(lines) + "\n"


def diff_json(d: dict) -> str:
    return json.dumps(d, indent=2)


__all__ = ["diff", "diff_text", "diff_json", "LEVELS"]
