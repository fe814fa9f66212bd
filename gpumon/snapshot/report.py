"""Summaries of a snapshot: the figures as a dict (for --json), as text (--summary), the OOM
diagnosis with a plain-words verdict, and a self-contained offline HTML page (--html)."""
from __future__ import annotations

import os

from .analysis import ACTIONS, A_OOM, NO_STACK, DeviceTrace, Snapshot, fmt_bytes, fmt_frame


SIDECAR_FORMAT = "gpumon-snapshot-meta"   # what gpumon/agent/snapshot.py writes
SUMMARY_FORMAT = "gpumon-view-summary"     # what `gpumon view --json` writes
# the keys of the sidecars gpumon wrote before they carried SIDECAR_FORMAT
_OLD_SIDECAR_KEYS = ("pid", "kind")
MAX_SIDECAR_BYTES = 16 << 20


def _sidecar_kind(d) -> str | None:
    """None for a gpumon sidecar, else why it is not one."""
    if not isinstance(d, dict):
        return "not a gpumon sidecar (not a JSON object)"
    if d.get("format") == SIDECAR_FORMAT:
        return None
    if "format" not in d and isinstance(d.get("pid"), int) and isinstance(d.get("kind"), str):
        return None  # an old sidecar, from before the format marker
    if d.get("format") == SUMMARY_FORMAT or ("peak" in d and "segments" in d):
        return "not a gpumon sidecar (it is gpumon view's own --json)"
    return "not a gpumon sidecar (no format marker)"


def load_sidecar(path: str, with_note: bool = False):
    """The sidecar gpumon writes beside a snapshot (FILE.json, or FILE minus its .pickle
    suffix plus .json): a JSON object with "format": "gpumon-snapshot-meta" (an old one: with
    its "pid" and "kind"). Anything else there (gpumon view's own --json, a file of the user's)
    is ignored, and so is a file past 16 MiB or nested too deep for the parser. With
    `with_note`: (sidecar, note), note one line saying what was ignored and why, or None."""
    cands = [path + ".json"]
    root, ext = os.path.splitext(path)
    if ext:
        cands.append(root + ".json")
    note = None
    for c in cands:
        why = None
        try:
            if os.path.getsize(c) > MAX_SIDECAR_BYTES:
                why = "larger than 16 MiB"
            else:
                with open(c, "rb") as f:
                    raw = f.read(MAX_SIDECAR_BYTES + 1)
                import json   # only where there is a file: most snapshots have none (1 ms)
                d = json.loads(raw)
                why = _sidecar_kind(d)
                if why is None:
                    return (d, None) if with_note else d
        except FileNotFoundError:
            continue
        except OSError as e:
            why = f"unreadable ({e.strerror or e})"
        except RecursionError:
            why = "nested too deep to be a gpumon sidecar"
        except (ValueError, UnicodeDecodeError):
            why = "not JSON"
        if note is None:
            note = f"{c}: {why}; ignored"
    return ({}, note) if with_note else {}


def _num(d: dict, *keys):
    for k in keys:
        v = d.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**63:
            return v
        if isinstance(v, float) and abs(v) < 2.0**63:  # also False for nan
            return int(v)
    return None


def is_simulated(snap: Snapshot) -> bool:
    """Made by gpumon's simulated source (demo, CI), not by a GPU: the capture part says so in
    the sidecar (`"simulated": true`) and in the file name (`simulated-...`)."""
    return snap.sidecar.get("simulated") is True or \
        os.path.basename(snap.path).startswith("simulated-")


def recorded_info(snap: Snapshot) -> dict | None:
    """What the sidecar says about the recording, each field checked for its type (the sidecar
    is as untrusted as the pickle)."""
    side = snap.sidecar
    out: dict = {}
    for k in ("kind", "torch", "python", "stacks", "hostname", "cwd", "who", "by"):
        if isinstance(side.get(k), str):
            out[k] = side[k][:200]
    for k in ("pid", "rank", "max_entries", "entries", "steps"):
        v = _num(side, k)
        if v is not None:
            out[k] = v
    for k in ("since", "until"):
        v = side.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:
            out[k] = float(v)
    argv = side.get("argv")
    if isinstance(argv, list):
        out["argv"] = [str(a)[:200] for a in argv[:50]]
    if is_simulated(snap):
        out["simulated"] = True
    elif "simulated" in side:
        out["simulated"] = False
    return out or None


def oom_info(snap: Snapshot, device: int | None = None, top: int = 10) -> dict | None:
    """The diagnosis of the trace's last OOM (or of the sidecar's), None when there is none."""
    tr = snap.trace(device)
    side = snap.sidecar.get("oom") if isinstance(snap.sidecar.get("oom"), dict) else {}
    idx = tr.action.tobytes().rfind(bytes([A_OOM]))  # the last OOM event (C speed), or -1
    if idx < 0 and not side:
        return None
    requested = _num(side, "requested", "size", "alloc_size")
    device_free = _num(side, "device_free", "free")
    device_total = _num(side, "device_total", "total")
    if idx >= 0:
        requested = tr.size[idx] if requested is None else requested
        device_free = tr.addr[idx] if device_free is None else device_free
    at = idx if idx >= 0 else tr.n - 1
    live = tr.allocated_at(at)
    seg = tr.segment_totals()
    cached_free = seg["free"] + seg["pending_free"]
    largest = seg["largest_free_block"]
    requested = requested or 0
    device_free = device_free or 0
    # the device's capacity is known only from the OOM observer (the sidecar): reserved + free
    # leaves out the CUDA context, other processes and memory outside PyTorch's allocator
    capacity = device_total or 0
    reachable = seg["reserved"] + device_free   # all this process's allocator could use
    free_total = device_free + cached_free
    groups = tr.groups_at(at)[:top]
    if capacity and requested > capacity:
        verdict, kind = (f"one huge request: {fmt_bytes(requested)} was asked, more than the "
                         f"whole device ({fmt_bytes(capacity)}); look at the size computation in "
                         "the stack of the failing call"), "huge"
    elif not capacity and requested > reachable:
        verdict, kind = (f"one huge request: {fmt_bytes(requested)} was asked, more than "
                         f"PyTorch's whole reservation and the device's free memory together "
                         f"({fmt_bytes(reachable)}; the device's capacity is not in the file); "
                         "look at the size computation in the stack of the failing call"), "huge"
    elif capacity and requested >= capacity / 2 and requested > live:
        verdict, kind = (f"one huge request: {fmt_bytes(requested)} is "
                         f"{100 * requested / capacity:.0f}% of the device and more than all "
                         f"live tensors together ({fmt_bytes(live)})"), "huge"
    elif requested <= free_total and cached_free >= 0.1 * (capacity or reachable):
        verdict, kind = (f"fragmented: {fmt_bytes(free_total)} was free in total "
                         f"({fmt_bytes(cached_free)} cached inside PyTorch's segments + "
                         f"{fmt_bytes(device_free)} on the device), enough for the "
                         f"{fmt_bytes(requested)} asked, but no single piece was large enough "
                         f"(largest cached free block {fmt_bytes(largest)}); try "
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"), "fragmented"
    else:
        top_txt = f"; the largest holder: {groups[0].key} ({fmt_bytes(groups[0].bytes)})" \
            if groups else ""
        verdict, kind = (f"genuinely full: {fmt_bytes(live)} was live and only "
                         f"{fmt_bytes(free_total)} free in total, less than the "
                         f"{fmt_bytes(requested)} asked{top_txt}"), "full"
        if requested <= free_total:
            of = (f", {100 * free_total / capacity:.0f}% of the device," if capacity else "")
            verdict = (f"genuinely full (and a little fragmented): {fmt_bytes(live)} was live; "
                       f"the {fmt_bytes(free_total)} still free{of} was in pieces smaller "
                       f"than the {fmt_bytes(requested)} asked{top_txt}")
        verdict += ("; to fit, hold less at this point: a smaller batch or sequence, "
                    "activation checkpointing, bf16/fp16, or an optimizer with less state")
    frames = tr.reading_order(tr.fid[idx]) if idx >= 0 else ()
    return {
        # torch.cuda.memory_allocated/reserved read in the OOM observer (capture's sidecar)
        "torch_allocated": _num(side, "allocated"), "torch_reserved": _num(side, "reserved"),
        "event": idx, "event_abs": idx + tr.window_offset if idx >= 0 else idx,
        "requested": requested, "device_free": device_free,
        "device_total": device_total, "live_allocated": live, "reserved": seg["reserved"],
        "cached_free": cached_free, "largest_free_block": largest,
        "unusable_reserved": cached_free if largest < requested else 0,
        "kind": kind, "verdict": verdict,
        "stack": [fmt_frame(f, full=True) for f in frames],
        "call": [fmt_frame(f, full=True) for f in (_call(tr, tr.fid[idx]) if idx >= 0
                                                   else ())],
        "top": [_group_dict(tr, g) for g in groups],
    }


def _call(tr: DeviceTrace, fid: int) -> tuple:
    """A stack's Python frames in reading order (the user's frame, the library frames it
    called, its callers), or its C++ frames when it has no Python frame."""
    head, callers, cpp = tr.python_first(fid)
    return head + callers if head else cpp


def _group_dict(tr: DeviceTrace, g, stacks: bool = True) -> dict:
    d = {"where": g.key, "bytes": g.bytes, "count": g.count}
    if g.frame:
        d["file"], d["line"], d["function"] = g.frame
    if stacks and g.elements:
        fid = tr.el_fid[g.elements[0]]
        # Python first: the user's frame, the library frames it called, its callers; then
        # the C++ frames (stacks='all'), innermost first
        d["largest_stack"] = [fmt_frame(f, full=True) for f in tr.reading_order(fid)]
        d["largest_call"] = [fmt_frame(f, full=True) for f in _call(tr, fid)]
        d["largest_cpp_frames"] = len(tr.python_first(fid)[2])
    return d


def summary(snap: Snapshot, device: int | None = None, top: int = 10, by: str = "line") -> dict:
    tr = snap.trace(device)
    groups = tr.groups_at(tr.peak_index, by=by)
    seg = tr.segment_totals()
    counts = tr.counts()
    steps = snap.step_boundaries(tr.device)
    dominated = groups[0] if groups else None
    t_peak = tr.event_time_s(tr.peak_index) if tr.peak_index >= 0 else None
    pr, pr_at = tr.peak_reserved
    off = tr.window_offset
    w = tr.window
    return {
        "format": SUMMARY_FORMAT,
        "file": snap.path,
        "window": {"first_event": off, "events": tr.n, "of": tr.n_total,
                   "peak_of_whole_trace": w["peak_index"]} if w else None,
        "recorded": recorded_info(snap),
        "device": tr.device,
        "devices": snap.devices,
        "events": tr.n,
        "counts": counts,
        "duration_s": tr.event_time_s(tr.n - 1) if tr.n else None,
        "live_at_start": tr.base,
        "live_at_end": tr.allocated_at(tr.n - 1),
        "peak": {"bytes": tr.peak, "event": tr.peak_index + off, "time_s": t_peak,
                 "step": sum(1 for e, _ in steps if e < tr.peak_index),
                 "in": snap.step_at(tr.peak_index, tr.device) if tr.peak_index >= 0 else None,
                 "live_allocations": sum(g.count for g in groups)},
        # the same peak as torch.cuda.max_memory_allocated() counts it: blocks, not requests
        "peak_blocks": {"bytes": tr.peak_blocks,
                        "event": tr.peak_blocks_index + off if tr.peak_blocks_index >= 0
                        else -1,
                        "time_s": tr.event_time_s(tr.peak_blocks_index)
                        if tr.peak_blocks_index >= 0 else None,
                        "in": snap.step_at(tr.peak_blocks_index, tr.device)
                        if tr.peak_blocks_index >= 0 else None,
                        "exact": tr.blocks_exact},
        "peak_reserved": {"bytes": pr, "event": pr_at + off if pr_at >= 0 else pr_at,
                          "time_s": tr.event_time_s(pr_at) if pr_at >= 0 else None},
        "reserved_at_start": tr.reserved_at(0) if tr.n else pr,
        "dominated_by": _group_dict(tr, dominated) if dominated else None,
        "grouped_by": by,
        "categories_at_peak": _by_category(tr, tr.peak_index) if tr.categories else None,
        "top_at_peak": [_group_dict(tr, g, stacks=False) for g in groups[:top]],
        "segments": seg,
        "steps": len(steps),
        "annotations": len(snap.annotations(tr.device)),
        "allocator_settings": snap.allocator_settings(),
        "oom": oom_info(snap, tr.device, top),
    }


def _by_category(tr: DeviceTrace, i: int) -> dict:
    """Bytes live at event i per profiler category (largest first)."""
    out: dict[str, int] = {}
    for g in tr.groups_at(i, by="category"):
        out[g.key] = g.bytes
    return out


def summary_text(s: dict) -> str:
    lines = []
    p = s["peak"]
    w = s.get("window")
    when = f"event {p['event']:,} of {(w['of'] if w else s['events']):,}" if s["events"] else \
        "no trace events: what the segments held at the dump"
    if p["time_s"] is not None:
        when += f", {p['time_s']:.3f} s into the recording"
    if p.get("in"):
        when += ", " + p["in"]["text"]
    elif s["steps"]:
        when += f", after {p['step']} of {s['steps']} optimizer steps"
    lines.append(f"snapshot  {s['file']}  (device {s['device']}"
                 + (f" of {s['devices']}" if len(s["devices"]) > 1 else "") + ")")
    rec = s.get("recorded") or {}
    if rec.get("simulated"):
        lines.append("SIMULATED: made by gpumon's simulated memory source (demo/test), not by a "
                     "GPU; the figures are not from a real run")
    if rec.keys() - {"simulated"}:
        argv = " ".join(rec.get("argv") or [])[:80]
        lines.append(f"recorded  {rec.get('kind', '?')} snapshot of pid {rec.get('pid', '?')}"
                     + (f" rank {rec['rank']}" if rec.get("rank") is not None else "")
                     + (f" ({argv})" if argv else "")
                     + (f", torch {rec['torch']}" if rec.get("torch") else ""))
    if w:
        inside = w["first_event"] <= w["peak_of_whole_trace"] < w["first_event"] + w["events"]
        lines.append(f"window    events {w['first_event']:,} to "
                     f"{w['first_event'] + w['events'] - 1:,} of {w['of']:,} "
                     + ("(around the peak of the whole trace" if inside else
                        f"(the whole trace peaks at event {w['peak_of_whole_trace']:,}")
                     + "; --window 0 reads every event, --window-at moves it); figures below "
                     "are the window's, counted from the whole trace")
    o = s.get("oom")
    if o:
        lines.append("")
        lines.append(f"OUT OF MEMORY at event {o.get('event_abs', o['event']):,}: asked {fmt_bytes(o['requested'])}, "
                     f"device free {fmt_bytes(o['device_free'])}"
                     + (f" of {fmt_bytes(o['device_total'])}" if o["device_total"] else ""))
        lines.append(f"  live {fmt_bytes(o['live_allocated'])}, reserved {fmt_bytes(o['reserved'])}"
                     f", cached free {fmt_bytes(o['cached_free'])} (largest block "
                     f"{fmt_bytes(o['largest_free_block'])}, unusable for this request "
                     f"{fmt_bytes(o['unusable_reserved'])})")
        if o.get("torch_allocated") is not None:
            lines.append(f"  torch.cuda.memory_allocated() at the OOM: "
                         f"{fmt_bytes(o['torch_allocated'])}, reserved "
                         f"{fmt_bytes(o['torch_reserved'] or 0)} (from the recorder's sidecar)")
        lines.append(f"  verdict: {o['verdict']}")
        if o.get("call") or o["stack"]:
            lines.append("  failing call: " + " · ".join((o.get("call") or o["stack"])[:4]))
        if o["top"]:
            lines.append("  held by:")
            for g in o["top"][:5]:
                lines.append(f"    {fmt_bytes(g['bytes']):>12}  {g['count']:>6}x  {g['where']}")
    lines.append("")
    lines.append(f"peak allocated  {fmt_bytes(p['bytes'])} requested, as memory_viz counts  "
                 f"({when})")
    pb = s.get("peak_blocks")
    if pb:
        bw = f"event {pb['event']:,}" if pb["event"] >= 0 else "at the dump"
        if pb.get("in"):
            bw += ", " + pb["in"]["text"]
        lines.append(f"                {'' if pb['exact'] else '~'}{fmt_bytes(pb['bytes'])} in "
                     f"blocks, as torch.cuda.max_memory_allocated() counts  ({bw})")
    if s["dominated_by"]:
        d = s["dominated_by"]
        share = 100 * d["bytes"] / p["bytes"] if p["bytes"] else 0
        lines.append(f"dominated by    {d['where']}: {fmt_bytes(d['bytes'])} ({share:.0f}%) "
                     f"in {d['count']} allocations")
    if s.get("categories_at_peak"):
        lines.append("by category     " + ", ".join(
            f"{k} {fmt_bytes(v)}" for k, v in s["categories_at_peak"].items()) +
            " (the profiler's categories, at the peak)")
    lines.append(f"live at start   {fmt_bytes(s['live_at_start'])}   at end "
                 f"{fmt_bytes(s['live_at_end'])}")
    sg = s["segments"]
    pr = s.get("peak_reserved") or {}
    if pr.get("event", -1) >= 0:
        lines.append(f"peak reserved   {fmt_bytes(pr['bytes'])}  (event {pr['event']:,}; "
                     "the segments PyTorch held, cached free memory included)")
    lines.append(f"reserved        {fmt_bytes(sg['reserved'])} in {sg['segments']} segments "
                 f"(at the dump); cached free {fmt_bytes(sg['free'])}, largest free block "
                 f"{fmt_bytes(sg['largest_free_block'])}")
    if sg.get("empty_segments"):
        lines.append(f"                {fmt_bytes(sg['empty_segments_bytes'])} of it in "
                     f"{sg['empty_segments']} wholly empty segments: cache that "
                     "torch.cuda.empty_cache() would hand back")
    lines.append(f"fragmentation   {100 * sg['fragmentation']:.0f}%: "
                 f"{fmt_bytes(sg.get('free_in_used_segments', 0))} free in holes between live "
                 "blocks, of the segments that hold them")
    c = s["counts"]
    lines.append("events          " + ", ".join(f"{c[k]:,} {k}" for k in ACTIONS if k in c)
                 if c else "events          none")
    if s["duration_s"] is not None:
        lines.append(f"recording       {s['duration_s']:.3f} s, {s['steps']} optimizer steps, "
                     f"{s['annotations']} annotations")
    if s["top_at_peak"]:
        lines.append("")
        by = s.get("grouped_by", "line")
        lines.append("live at the peak, by " + ("first user frame" if by == "line" else by) + ":")
        for g in s["top_at_peak"]:
            lines.append(f"  {fmt_bytes(g['bytes']):>12}  {g['count']:>6}x  {g['where']}")
    return "\n".join(lines) + "\n"


def summary_json(s: dict) -> str:
    import json
    return json.dumps(s, indent=2, default=str)


def _step_band(bounds, n: int, off: int, ex, L: int, W: int, y: float) -> list[str]:
    """The optimizer steps as a band under the axis: one rect per step (alternating shades),
    merged k at a time when the steps are narrower than 3 px, and every Nth step numbered
    (N in 1, 2, 5, 10, 20, 50, ...: at most 12 labels). A long run's 1,650 steps were 1,650
    dashed lines painting the chart green."""
    import html
    if not bounds:
        return []
    px = (W - L - 10) / max(1, len(bounds))
    k = max(1, int(3 / px + 0.999))                 # steps per rect
    every = 1
    while len(bounds) / every > 12:
        every = every * 5 // 2 if str(every)[0] == "2" else every * 2   # 1 2 5 10 20 50 ...
    out = []
    prev = -1
    edge = lambda e: ex(e) + 0.5 * (W - L - 10) / n  # noqa: E731  (right edge of event e)
    for g in range(0, len(bounds), k):
        chunk = bounds[g:g + k]
        first, last = (prev + 1, chunk[-1][0])
        x0, x1 = (edge(prev) if prev >= 0 else L), edge(last)
        names = f"step {g + 1}" if k == 1 else f"steps {g + 1}-{g + len(chunk)}"
        out.append(f'<rect class="step" data-step="{g + 1}" data-last-event="{last + off}" '
                   f'x="{x0:.1f}" y="{y:.1f}" width="{max(0.5, x1 - x0):.1f}" height="6" '
                   f'fill="{"#59a14f" if (g // k) % 2 == 0 else "#a6d19c"}"><title>{names} '
                   f'({html.escape(chunk[-1][1])}): events {first + off:,}-{last + off:,}'
                   '</title></rect>')
        prev = last
    for k2 in range(every - 1, len(bounds), every):
        e = bounds[k2][0]
        out.append(f'<text class="step-label" x="{edge(e):.1f}" y="{y + 15:.1f}" '
                   f'font-size="10" text-anchor="middle" fill="#3b7a34">{k2 + 1}</text>')
    return out


_PHASE_FILL = {"forward": "#76b7b2", "backward": "#b07aa1", "optimizer": "#edc948",
               "other": "#bab0ac"}


def html_page(snap: Snapshot, device: int | None = None, cols: int = 1200) -> str:
    """One self-contained page: inline SVG timeline, inline JS for a hover readout, the top
    allocations at the peak. No external resource of any kind."""
    import html
    import json
    tr = snap.trace(device)
    s = summary(snap, tr.device, top=25)
    W, H, L, B = 1100, 340, 80, 48
    off = tr.window_offset   # event numbers are the whole trace's, as the summary's
    cols = max(1, min(cols, tr.n or 1))
    dec = tr.decimate(0, tr.n, cols) if tr.n else [(tr.base, tr.base)]
    rdec = tr.decimate_series(tr.reserved, 0, tr.n, cols) if tr.n else \
        [(tr.reserved_at(-1),) * 2]
    pr, pr_at = tr.peak_reserved
    ymax = max([mx for _, mx in dec] + [mx for _, mx in rdec] + [1])
    ys = lambda v: H - B - (H - B - 10) * v / ymax  # noqa: E731
    # column c covers [xe(c), xe(c + 1)): a step function, flat across each column's events
    xe = lambda c: L + (W - L - 10) * c / len(dec)  # noqa: E731
    n = max(1, tr.n)
    ex = lambda i: L + (W - L - 10) * (max(0, i) + 0.5) / n  # noqa: E731  (an event's middle)

    def steps_pts(vals):
        return " ".join(f"{xe(c):.1f},{ys(v):.1f} {xe(c + 1):.1f},{ys(v):.1f}"
                        for c, v in enumerate(vals))
    top_pts = steps_pts([mx for _, mx in dec])
    bot_pts = f"{xe(len(dec)):.1f},{ys(0):.1f} {xe(0):.1f},{ys(0):.1f}"  # down to 0
    res_pts = steps_pts([mx for _, mx in rdec])
    parts = []
    for frac in (0, 0.25, 0.5, 0.75, 1):
        v = ymax * frac
        parts.append(f'<line x1="{L}" x2="{W - 10}" y1="{ys(v):.1f}" y2="{ys(v):.1f}" '
                     f'stroke="#ddd"/><text x="{L - 6}" y="{ys(v) + 4:.1f}" text-anchor="end" '
                     f'font-size="11">{html.escape(fmt_bytes(v))}</text>')
    parts.append(f'<polygon id="allocated" points="{top_pts} {bot_pts}" fill="#4e79a7" '
                 'stroke="#4e79a7" stroke-width="1"><title>allocated</title></polygon>')
    parts.append(f'<polyline id="reserved" points="{res_pts}" fill="none" stroke="#f28e2b" '
                 'stroke-width="1.5"><title>reserved (segments)</title></polyline>')
    parts += _step_band(snap.step_boundaries(tr.device), n, off, ex, L, W, H - B + 11)
    # gpumon's phases (the sidecar's timeline): a band under the axis, one rect per phase
    spans = snap.phase_spans(tr.device)
    for e0, e1, step, phase in spans:
        x0, x1 = ex(e0) - 0.5 * (W - L - 10) / n, ex(e1) + 0.5 * (W - L - 10) / n
        parts.append(f'<rect class="phase" data-phase="{html.escape(phase)}" '
                     f'data-first="{e0 + off}" data-last="{e1 + off}" x="{x0:.1f}" '
                     f'y="{H - B + 2}" width="{max(0.5, x1 - x0):.1f}" height="7" '
                     f'fill="{_PHASE_FILL.get(phase, _PHASE_FILL["other"])}"><title>step {step}: '
                     f'{html.escape(phase)} (events {e0 + off:,}-{e1 + off:,})</title></rect>')
    # the labels (peak, peak reserved, OOM) are laid out so that none covers another: each
    # takes the first of its rows that is free where its text runs (the OOM page's two peak
    # labels overlapped)
    placed: list[tuple[float, float, float]] = []   # (x0, x1, y) of each label's text

    def place(x: float, anchor: str, text: str, size: int, rows) -> float:
        wdt = 0.62 * size * len(text)
        x0, x1 = (x - wdt, x) if anchor == "end" else (x, x + wdt)
        for y in rows:
            if all(x1 < a or x0 > b or abs(y - yy) >= size + 3 for a, b, yy in placed):
                break
        placed.append((x0, x1, y))
        return y
    free_rows = [22 + 15 * k for k in range(8)]
    if tr.peak_index >= 0:
        px = ex(tr.peak_index)
        anchor = "end" if px > W / 2 else "start"
        tx = px - 4 if anchor == "end" else px + 4
        text = f"peak {fmt_bytes(tr.peak)}"
        py = place(tx, anchor, text, 12, free_rows)
        parts.append(f'<line id="peak" x1="{px:.1f}" x2="{px:.1f}" y1="10" y2="{H - B}" '
                     f'stroke="#e15759" data-event="{tr.peak_index + off}" '
                     f'data-bytes="{tr.peak}"/>'
                     f'<circle cx="{px:.1f}" cy="{ys(tr.peak):.1f}" r="3.5" fill="#e15759"/>'
                     f'<text id="peak-label" x="{tx:.1f}" y="{py}" text-anchor="{anchor}" '
                     f'fill="#e15759" font-size="12" paint-order="stroke" stroke="#fff" '
                     f'stroke-width="3">{html.escape(text)}</text>')
    if pr_at >= 0:
        # above its line where there is room, else just under it; a white halo keeps it
        # readable over the line and the bars
        ry = ys(pr) - 5 if ys(pr) - 5 >= 14 else ys(pr) + 14
        text = f"peak reserved {fmt_bytes(pr)}"
        ry = place(W - 10, "end", text, 11, [round(ry, 1)] + [ry + 15 * k for k in (1, 2, 3)]
                   + free_rows)
        parts.append(f'<text id="peak-reserved-label" x="{W - 10}" y="{ry:.1f}" '
                     f'text-anchor="end" fill="#f28e2b" font-size="11" paint-order="stroke" '
                     f'stroke="#fff" stroke-width="3">{html.escape(text)}</text>')
    if s["oom"] and s["oom"]["event"] >= 0:
        ox = ex(s["oom"]["event"])
        oy = place(ox - 4, "end", "OOM", 12, free_rows[1:] + free_rows[:1])
        parts.append(f'<line x1="{ox:.1f}" x2="{ox:.1f}" y1="10" y2="{H - B}" stroke="#000" '
                     f'stroke-width="2"/><text id="oom-label" x="{ox - 4:.1f}" y="{oy}" '
                     'text-anchor="end" font-size="12" paint-order="stroke" stroke="#fff" '
                     'stroke-width="3">OOM</text>')
    parts.append(f'<text x="{L}" y="{H - 6}" font-size="11">event {off:,}</text>'
                 f'<text x="{W - 10}" y="{H - 6}" font-size="11" text-anchor="end">event '
                 f'{off + max(0, tr.n - 1):,}</text>')
    svg = (f'<svg id="tl" viewBox="0 0 {W} {H}" width="100%" font-family="sans-serif">'
           f'{"".join(parts)}<line id="cur" y1="10" y2="{H - B}" stroke="#333" '
           'visibility="hidden"/></svg>')
    def stack_cell(grp) -> str:
        """Python first: the user's frame, '→' the library frames it called, 'called from'
        its callers, and how many C++ frames are left out."""
        if not grp.elements:
            return ""
        head, callers, cpp = tr.python_first(tr.el_fid[grp.elements[0]])
        if not head:
            return html.escape(" · ".join(fmt_frame(f, full=True) for f in cpp[:6]))
        out = html.escape(fmt_frame(head[0], full=True))
        out += "".join("<br>&nbsp;&nbsp;→ " + html.escape(fmt_frame(f, full=True))
                       for f in head[1:5])
        if callers:
            out += "<br>called from " + html.escape(", ".join(
                fmt_frame(f, full=True) for f in callers[:2]))
        if cpp:
            out += f"<br>(+ {len(cpp)} C++ frames)"
        return out
    rows = "".join(
        f"<tr><td class=r>{html.escape(fmt_bytes(g.bytes))}</td><td class=r>{g.count}</td>"
        f"<td class=r>{100 * g.bytes / max(1, s['peak']['bytes']):.1f}%</td>"
        f"<td>{html.escape(g.key)}</td><td class=s>{stack_cell(g)}</td></tr>"
        for g in tr.groups_at(tr.peak_index)[:50])
    oom = ""
    if s["oom"]:
        o = s["oom"]
        oom = (f"<div class=oom><b>Out of memory</b>: asked {html.escape(fmt_bytes(o['requested']))}"
               f", device free {html.escape(fmt_bytes(o['device_free']))}, live "
               f"{html.escape(fmt_bytes(o['live_allocated']))}, reserved "
               f"{html.escape(fmt_bytes(o['reserved']))}.<br>Verdict: "
               f"{html.escape(o['verdict'])}</div>")
    data = json.dumps({"cols": [mx for _, mx in dec], "n": tr.n, "off": off,
                       "labels": [f"allocated {fmt_bytes(mx)}, reserved {fmt_bytes(r)}"
                                  for (_, mx), (_, r) in zip(dec, rdec)], "L": L, "W": W})
    text = html.escape(summary_text(s))
    sim = ("<div class=oom><b>SIMULATED</b>: made by gpumon's simulated memory source (demo or "
           "test), not by a GPU.</div>" if is_simulated(snap) else "")
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>gpumon view: {html.escape(os.path.basename(snap.path))}</title>
<style>body{{font-family:sans-serif;margin:1.5em;color:#222}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border-bottom:1px solid #eee;padding:3px 8px;text-align:left;vertical-align:top}}
.r{{text-align:right;white-space:nowrap}}.s{{font-family:monospace;font-size:11px;color:#555}}
pre{{background:#f6f6f6;padding:1em;font-size:12px}}.oom{{background:#fde2e1;padding:.8em;margin:.8em 0}}
#read{{font-family:monospace;height:1.2em}}</style></head><body>
<h2>GPU memory snapshot: {html.escape(os.path.basename(snap.path))} (device {tr.device})</h2>
{sim}{oom}
<p>Allocated bytes (blue) and reserved bytes (orange line) over the recording's events: peak allocated {html.escape(fmt_bytes(tr.peak))} {f"at event {s['peak']['event']:,}" if tr.n else "at the dump (no trace events)"}{html.escape(", " + s["peak"]["in"]["text"] if s["peak"].get("in") else "")} (requested bytes, as memory_viz counts; {html.escape(fmt_bytes(tr.peak_blocks))} in blocks {f"at event {s['peak_blocks']['event']:,}" if s['peak_blocks']['event'] >= 0 else "at the dump"}, as torch.cuda.max_memory_allocated counts), peak reserved {html.escape(fmt_bytes(pr))}. The green band under the axis: optimizer steps, one shade per step (every Nth numbered).{" Under the axis, the phases of gpumon's tracker: forward (teal), backward (purple), optimizer (yellow), other (grey)." if spans else ""}</p>
<div id="read"></div>
{svg}
<h3>Live at the peak, by where it was allocated</h3>
<table><tr><th>bytes</th><th>allocs</th><th>share</th><th>where</th><th>stack of the largest</th></tr>{rows}</table>
<h3>Summary</h3><pre>{text}</pre>
<p style="font-size:11px;color:#777">Written by gpumon view; self-contained, works offline.</p>
<script>
(function(){{var d={data};var svg=document.getElementById('tl'),cur=document.getElementById('cur'),r=document.getElementById('read');
svg.addEventListener('mousemove',function(ev){{var b=svg.getBoundingClientRect();var x=(ev.clientX-b.left)*{W}/b.width;
var c=Math.floor((x-d.L)/(d.W-d.L-10)*d.cols.length);if(c<0||c>=d.cols.length)return;
cur.setAttribute('x1',x);cur.setAttribute('x2',x);cur.setAttribute('visibility','visible');
var ev0=d.off+Math.floor(c*d.n/d.cols.length);r.textContent='event ~'+ev0.toLocaleString('en')+': '+d.labels[c];}});}})();
</script></body></html>
"""


__all__ = ["summary", "summary_text", "summary_json", "oom_info", "html_page", "load_sidecar",
           "is_simulated", "recorded_info", "table", "table_text", "TABLES",
           "NO_STACK"]


# -- tables for export (CSV or JSON) ----------------------------------------------------------
TABLES = ("live", "segments", "leaks", "timeline")


def table(snap: Snapshot, name: str, device: int | None = None, by: str = "line",
          event: int | None = None, after: int = 1) -> tuple[list[str], list[list]]:
    """(columns, rows) of one of TABLES, in plain numbers (bytes as ints):
    live: allocations live at `event` (default: the peak) grouped `by` line/function/file/library;
    segments: the allocator's segments at the dump; leaks: what survives `after` steps;
    timeline: allocated and reserved after every event."""
    tr = snap.trace(device)
    if name == "live":
        i = tr.peak_index if event is None else event
        total = tr.allocated_at(i)
        rows = []
        for g in tr.groups_at(i, by=by):
            f = g.frame or ("", None, "")  # no frame (a library, no stack): no line either
            rows.append([g.key, g.bytes, g.count, round(100 * g.bytes / total, 3) if total else 0,
                         f[0], f[1], f[2]])
        return ["where", "bytes", "count", "share_pct", "file", "line", "function"], rows
    if name == "segments":
        return (["address", "reserved", "allocated", "requested", "pending_free", "free",
                 "largest_free", "blocks", "stream", "pool", "expandable"],
                [[s.address, s.total, s.allocated, s.requested, s.pending_free, s.free,
                  s.largest_free, s.blocks, s.stream, s.pool, s.expandable]
                 for s in tr.segment_infos()])
    if name == "leaks":
        from .leaks import leaks
        d = leaks(snap, tr.device, after=after, by=by, top=10**9)
        return (["kind", "where", "bytes", "count", "steps_leaking", "live_at_end", "per_step"],
                [[k, g["where"], g["bytes"], g["count"], g["steps_leaking"], g["live_at_end"],
                  " ".join(map(str, g["per_step"]))]
                 for k in ("growing", "bounded", "long_lived") for g in d[k]])
    if name == "timeline":
        res = tr.reserved
        return (["event", "time_us", "action", "size", "allocated", "reserved"],
                [[i, tr.time_us[i], ACTIONS[tr.action[i]], tr.size[i], tr.allocated[i], res[i]]
                 for i in range(tr.n)])
    raise ValueError(f"no table {name!r} (tables: {', '.join(TABLES)})")


def table_text(columns: list[str], rows: list[list], fmt: str = "csv") -> str:
    if fmt == "json":
        import json
        return json.dumps([dict(zip(columns, r)) for r in rows], indent=1) + "\n"
    import csv
    import io
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    w.writerows(rows)
    return buf.getvalue()
