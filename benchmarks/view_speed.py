"""How fast `gpumon view` opens a large snapshot, and how much memory it takes.

For synthetic snapshots (gpumon/snapshot/synth.py, torch's exact format) of N trace events it
times, each in a fresh process (so the peak RSS is that step's own):
  pickle      plain pickle.load of the file (the floor)
  summary     gpumon's safe load + replay + summary text (`gpumon view FILE --summary`)
  first       safe load + replay + the Textual app's first screen at 80x24 (headless)
  process     `gpumon view FILE` in a pseudo-terminal of 80x24: from starting the process
              (interpreter, CLI, Textual import, load, replay) until the first frame, with the
              timeline drawn, has been written to the terminal
  memory_viz  `python -m torch.cuda._memory_viz stats FILE` (when torch is installed)
and writes a Markdown table to benchmarks/view_speed.md (or --out).

    python benchmarks/view_speed.py                    # 40k and 1M events
    python benchmarks/view_speed.py --events 40000 200000
Targets (issue 4): first screen < 1 s at 40k events, < 10 s at 1M; memory < 4x the file size.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import resource
import subprocess
import sys
import tempfile
import time

from first_screen import ROOT, bench_env, first_screen, precompile


def _rss_mib(field: str = "VmHWM") -> float:
    """Peak (VmHWM) or current (VmRSS) RSS of this process in MiB. Not ru_maxrss: on Linux
    that survives exec, so a child would report its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(step: str, path: str) -> dict:
    base = _rss_mib("VmRSS")
    t0 = time.perf_counter()
    if step == "pickle":
        with open(path, "rb") as f:
            pickle.load(f)
    elif step == "summary":
        from gpumon.snapshot import open_snapshot, report
        s = open_snapshot(path)
        report.summary_text(report.summary(s))
    elif step in ("window", "whole"):
        # what `gpumon view FILE --summary` does, with the default window or every event
        from gpumon.snapshot import open_snapshot, report
        from gpumon.snapshot.window import DEFAULT_WINDOW
        s = open_snapshot(path, window=DEFAULT_WINDOW if step == "window" else None)
        report.summary_text(report.summary(s))
        tr = s.trace()
        return {"s": time.perf_counter() - t0, "rss_mib": _rss_mib(), "base_mib": base,
                "kept": tr.n, "n": tr.n_total, "peak": tr.peak,
                "peak_event": tr.peak_index + tr.window_offset}
    elif step == "first":
        import asyncio

        from gpumon.snapshot import open_snapshot
        from gpumon.tui.view.app import ViewApp
        t_import = time.perf_counter() - t0  # textual import, not the file's cost
        base = _rss_mib("VmRSS")
        t0 = time.perf_counter()
        s = open_snapshot(path)
        app = ViewApp(s)

        async def go():
            async with app.run_test(size=(80, 24)) as pilot:
                await pilot.pause()
                app.screen._compositor.render_update(full=True)  # the frame is drawn
        asyncio.run(go())
        return {"s": time.perf_counter() - t0, "import_s": t_import, "rss_mib": _rss_mib(),
                "base_mib": base}
    return {"s": time.perf_counter() - t0, "rss_mib": _rss_mib(), "base_mib": base}


def run_child(step: str, path: str) -> dict | None:
    r = subprocess.run([sys.executable, __file__, "--child", step, path], capture_output=True,
                       text=True, cwd=ROOT, env=bench_env())
    if r.returncode:
        print(f"  {step}: failed: {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def from_process_start(path: str) -> tuple[float | None, float | None]:
    """Seconds from starting `gpumon view FILE` in an 80x24 pty until its first frame (the
    chart's axis line and the footer) is on the terminal, and until Textual has drawn its own
    frame over it."""
    env = bench_env()
    marks = (b"events/col", b"quit")
    cmd = [sys.executable, "-m", "gpumon", "view", path]
    first = first_screen(cmd, marks, env, timeout=120)
    ready = first_screen(cmd, marks, env, times=2, timeout=120)
    return (first[0] if first else None), (ready[0] if ready else None)


def memory_viz(path: str) -> float | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", path],
                       capture_output=True, text=True)
    return time.perf_counter() - t0 if r.returncode == 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, nargs="+", default=[40_000, 1_000_000])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "view_speed.md"))
    ap.add_argument("--long", type=int, nargs="*", default=[1_000_000, 10_000_000],
                    help="events of the long traces (synth_long.py) whose memory is measured "
                         "with the default window")
    ap.add_argument("--whole-long", action="store_true",
                    help="also read each long trace whole (--window 0), for comparison")
    ap.add_argument("--child", nargs=2, metavar=("STEP", "FILE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child)))
        return 0
    sys.path.insert(0, ROOT)
    precompile([os.path.join(ROOT, "gpumon")], bench_env())
    from gpumon.snapshot.synth import snapshot_with_events
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for n in a.events:
            t0 = time.perf_counter()
            data = snapshot_with_events(n)
            path = os.path.join(d, f"s{n}.pickle")
            with open(path, "wb") as f:
                pickle.dump(data, f)
            ev = len(data["device_traces"][0])
            del data
            mib = os.path.getsize(path) / 2**20
            print(f"{ev:,} events, {mib:.1f} MiB (made in {time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr)
            res = {k: run_child(k, path) for k in ("pickle", "summary", "first")}
            cold = from_process_start(path)
            mv = memory_viz(path)
            rows.append((ev, mib, res, cold, mv))
            print(f"  {res} process={cold} memory_viz={mv}", file=sys.stderr)
        long_rows = []
        from gpumon.snapshot.synth_long import write_long_trace
        for n in a.long:
            path = os.path.join(d, f"long{n}.pickle")
            t0 = time.perf_counter()
            write_long_trace(path, n)
            mib = os.path.getsize(path) / 2**20
            print(f"long {n:,} events, {mib:.0f} MiB (written in "
                  f"{time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            w = run_child("window", path)
            whole = run_child("whole", path) if a.whole_long else None
            long_rows.append((n, mib, w, whole))
            print(f"  window={w} whole={whole}", file=sys.stderr)
            os.unlink(path)

    def sec(r):
        return f"{r['s']:.2f}" if r else "failed"

    def mem(r, mib):
        return f"{r['rss_mib'] - r['base_mib']:.0f} ({(r['rss_mib'] - r['base_mib']) / mib:.1f}x)" \
            if r else "-"
    lines = [
        "# gpumon view: load and first-screen time",
        "",
        f"Written by `python benchmarks/view_speed.py` on {platform.node() or '?'} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, shared), Python "
        f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "Synthetic snapshots in torch's format (gpumon/snapshot/synth.py: a 24-layer training "
        "loop, python stacks). Each step in a fresh process; memory is the step's peak RSS "
        "growth over the bare interpreter (and its imports), in MiB and as a multiple of the file.",
        "",
        "| events | file MiB | pickle.load s (floor) | --summary s | first screen s | "
        "first screen from process start s | memory_viz stats s | memory pickle.load MiB | "
        "memory --summary MiB | memory view MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ev, mib, res, cold, mv in rows:
        first, ready = cold
        cold = f"{first:.2f}" if first is not None else "failed"
        cold += f" (Textual {ready:.2f})" if ready is not None else ""
        lines.append(f"| {ev:,} | {mib:.1f} | {sec(res['pickle'])} | {sec(res['summary'])} | "
                     f"{sec(res['first'])} | {cold} | "
                     f"{f'{mv:.2f}' if mv is not None else 'n/a'} | "
                     f"{mem(res['pickle'], mib)} | {mem(res['summary'], mib)} | {mem(res['first'], mib)} |")
    imp = [r[2]["first"]["import_s"] for r in rows if r[2]["first"]]
    if imp:
        lines += ["", f"First screen excludes importing Textual and the app "
                      f"({min(imp):.2f} s here); the column after it is the whole `gpumon view "
                      f"FILE` in an 80x24 pseudo-terminal, from starting the process (interpreter, "
                      f"CLI, imports, load, replay) until its first frame is on the terminal "
                      f"(the plain frame gpumon writes while Textual imports), and in brackets "
                      f"until Textual has drawn its own frame over it."]
    lines += ["", "pickle.load is the floor for time only: gpumon does not call it on torch's "
              "files but streams them (gpumon/snapshot/load.py), packing the events as they are "
              "unpickled, so its memory stays below what pickle.load alone needs.",
              "", "Targets (issue 4): first screen < 1 s at 40k events, < 10 s at 1M; memory "
              "< 4x the file size."]
    if long_rows:
        lines += [
            "", "## Long traces: bounded memory (issue 18)", "",
            "Traces written as torch's pickler writes a stacks='all' dump (gpumon/snapshot/"
            "synth_long.py: every event dict memoized, a fresh frame list per event), opened as "
            "`gpumon view FILE --summary` does: at most 1,000,000 events kept per device "
            "(--window), a longer trace read twice (the peak found in the first pass, the "
            "window around it kept in the second). Memory is the peak RSS growth of the "
            "process over the interpreter and its imports.", "",
            "| events | file MiB | events kept | peak found at | --summary s | peak RSS MiB |"
            + (" whole (--window 0) s | whole peak RSS MiB |" if a.whole_long else ""),
            "|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if a.whole_long else ""),
        ]
        for n, mib, w, whole in long_rows:
            if not w:
                lines.append(f"| {n:,} | {mib:.0f} | failed |")
                continue
            row = (f"| {n:,} | {mib:.0f} | {w['kept']:,} | {w['peak_event']:,} | "
                   f"{w['s']:.1f} | {w['rss_mib'] - w['base_mib']:.0f} |")
            if a.whole_long:
                row += (f" {whole['s']:.1f} | {whole['rss_mib'] - whole['base_mib']:.0f} |"
                        if whole else " failed | |")
            lines.append(row)
        lines += ["", "What still grows with the trace when a window is kept is the C "
                  "Unpickler's memo table, while the file is read: 8 bytes (16 after its "
                  "doublings) for each memoized object, two per event in torch's layout (the "
                  "event dict and its frame list). gpumon memoizes None in their place, so the "
                  "objects themselves are dropped; the table's slots are not, and no reader "
                  "built on the C Unpickler avoids them. After the load they are freed: what "
                  "the view keeps is the window (tests/view/test_window.py checks both)."]
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
