"""gpumon view against ptmem's cold start, side by side in one run (issue 18).

For each file: the summary (`gpumon view F --summary` / `ptmem -s F`), the first screen
(from starting the process in an 80x24 pseudo-terminal until its first frame is on the
terminal) and ready for keys (until a right arrow typed the moment the first frame is up has
moved the cursor on the screen: the event at the cursor, read from the screen as pyte, a
terminal emulator, draws it, is another; needs `pip install pyte`), each tool in turn,
repeated; the median wall time and the median CPU time (user + sys of the child) are
reported. Both tools keep a cache of a file they have read (ptmem:
.F.memcache next to it; gpumon: its cache folder, here a temporary one): "cold" runs remove
both caches before each run, "warm" runs find both filled (the everyday case: a file opened
again). ptmem is taken from PTMEM_PATH (a folder holding the `ptmem` package: `pip download
ptmem==0.1.2 --no-deps` and unzip it) or from the environment; without it only gpumon is
measured.

The files: an "everyday" file of 40,000 events and 8 MB, written as torch's pickler writes a
stacks='all' dump (a fresh 34-frame list per event: gpumon/snapshot/synth_long.py); synthetic
snapshots of --events events from synth.py's allocator model with stacks='all' frames; and the
real snapshots given as paths (scripts/make_real_snapshots.py makes 3.7-8.6 MB ones, C++ stacks or Python
on a GPU: `gpu_session.sh realsnaps`). With paths and no --events, only the paths are measured.

    PTMEM_PATH=/tmp/ptmem python benchmarks/view_vs_ptmem.py [F.pickle ...] [--events 40000]
"""
from __future__ import annotations

import argparse
import os
import pickle
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

from first_screen import ROOT, bench_env, children_cpu, first_key, first_screen, precompile


def _cmd(tool: str, path: str, summary: bool) -> list[str]:
    if tool == "gpumon":
        return [sys.executable, "-m", "gpumon", "view", path] + (["--summary"] if summary else [])
    code = ("import sys; from ptmem.cli import run; sys.argv = ['ptmem'] + sys.argv[1:]; run()")
    return [sys.executable, "-c", code] + (["-s", path] if summary else [path])


CACHE = tempfile.mkdtemp(prefix="gpumon-view-cache-")   # gpumon's cache folder here


def _env(ptmem_path):
    return {**bench_env(ptmem_path), "GPUMON_VIEW_CACHE_DIR": CACHE}


def _clear_caches(tool: str, path: str) -> None:
    if tool == "ptmem":
        c = [os.path.join(os.path.dirname(os.path.abspath(path)),
                          "." + os.path.basename(path) + ".memcache")]
    else:
        c = [os.path.join(CACHE, n) for n in os.listdir(CACHE)]
    for f in c:
        try:
            os.unlink(f)
        except OSError:
            pass


def run_summary(tool: str, path: str, ptmem_path: str | None,
                warm: bool = False) -> tuple[float, float] | None:
    if not warm:
        _clear_caches(tool, path)
    c0, t0 = children_cpu(), time.perf_counter()
    r = subprocess.run(_cmd(tool, path, True), capture_output=True, env=_env(ptmem_path),
                       cwd=ROOT, timeout=600)
    wall, cpu = time.perf_counter() - t0, children_cpu() - c0
    return (wall, cpu) if r.returncode == 0 and r.stdout else None


def run_first_screen(tool: str, path: str, ptmem_path: str | None,
                     warm: bool = False) -> tuple[float, float] | None:
    """From starting the process until its first frame is on the terminal (the last line each
    draws of it; ptmem: its key hint, cut at 80 columns)."""
    if not warm:
        _clear_caches(tool, path)
    return first_screen(_cmd(tool, path, False), _MARKS[tool], _env(ptmem_path))


_MARKS = {"gpumon": (b"events/col", b"quit"), "ptmem": (b"Pan Y",)}
_GPUMON_EVENT = re.compile(r"^ ?(?:event|ev) ([\d,]+)\s.*\ball")   # the event line
_PTMEM_EVENT = re.compile(r"Cursor: event (\d+)")


def _cursor_event(tool: str):
    def at(lines):
        for line in lines:
            m = (_GPUMON_EVENT.match(line) if tool == "gpumon" else _PTMEM_EVENT.search(line))
            if m:
                return m.group(1)
        return None
    return at


def run_interactive(tool: str, path: str, ptmem_path: str | None, warm: bool = False):
    """Until a key typed the moment the first frame is up (the right arrow: the cursor one
    column on) has changed the screen: the event at the cursor on the screen is another."""
    if not warm:
        _clear_caches(tool, path)
    return first_key(_cmd(tool, path, False), _MARKS[tool], _env(ptmem_path),
                     _cursor_event(tool))


def _median(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return (statistics.median(w for w, _ in xs), statistics.median(c for _, c in xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", help="real snapshots to measure")
    ap.add_argument("--events", type=int, nargs="*", default=None,
                    help="synthetic files of these many events (default 40000 400000, none "
                         "when paths are given)")
    ap.add_argument("--files", nargs="*", default=[], help="real snapshots (as paths)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-everyday", dest="everyday", action="store_false",
                    help="skip the 8 MB, 40k-event file (synth_long.py, depth 26)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "view_vs_ptmem.md"))
    a = ap.parse_args()
    a.files = a.paths + a.files
    if a.events is None:
        a.events = [] if a.files else [40_000, 400_000]
    if a.files and "--no-everyday" not in sys.argv and "--everyday" not in sys.argv:
        a.everyday = False
    ptmem_path = os.environ.get("PTMEM_PATH")
    probe = subprocess.run([sys.executable, "-c", "import ptmem.cli"],
                           env=bench_env(ptmem_path), capture_output=True)
    tools = ["gpumon"] + (["ptmem"] if probe.returncode == 0 else [])
    if len(tools) == 1:
        print("ptmem not found (set PTMEM_PATH): measuring gpumon only", file=sys.stderr)
    precompile([os.path.join(ROOT, "gpumon")] + ([ptmem_path] if ptmem_path else []),
               bench_env(ptmem_path))
    sys.path.insert(0, ROOT)
    from gpumon.snapshot.synth import snapshot_with_events
    rows = []
    with tempfile.TemporaryDirectory() as d:
        files = []
        if a.everyday:
            from gpumon.snapshot.synth_long import write_long_trace
            path = os.path.join(d, "everyday-40k.pickle")
            write_long_trace(path, 40_000, depth=26)
            files.append((f"synthetic everyday file, 40,000 events, a fresh {26 + 8}-frame "
                          "list per event", path))
        for n in a.events:
            path = os.path.join(d, f"all-stacks-{n}.pickle")
            with open(path, "wb") as f:
                pickle.dump(snapshot_with_events(n, all_stacks=True), f, protocol=4)
            files.append((f"synthetic stacks='all', {n:,} events", path))
        files += [(os.path.basename(p), p) for p in a.files]
        for label, path in files:
            mib = os.path.getsize(path) / 2**20
            res = {}
            for what, fn in (("summary", run_summary), ("first", run_first_screen),
                             ("interactive", run_interactive)):
                for warm in (False, True):
                    runs = {t: [] for t in tools}
                    if warm:
                        for t in tools:   # fill both caches
                            run_summary(t, path, ptmem_path)
                    for _ in range(a.repeat):
                        for t in tools:   # interleaved, so both see the same machine load
                            runs[t].append(fn(t, path, ptmem_path, warm))
                    for t in tools:
                        res[(what + (" warm" if warm else ""), t)] = _median(runs[t])
            rows.append((label, mib, res))
            print(label, res, file=sys.stderr)

    def cell(r):
        return f"{r[0]:.2f} / {r[1]:.2f}" if r else "failed"
    cols = [(w + warm, t) for w in ("summary", "first", "interactive") for warm in ("", " warm")
            for t in tools]
    names = {"summary": "summary cold", "first": "first screen cold",
             "interactive": "ready for keys cold", "summary warm": "summary warm",
             "first warm": "first screen warm", "interactive warm": "ready for keys warm"}
    head = "| file | MiB | " + " | ".join(f"{names[w]} {t} s (wall / CPU)" for w, t in cols) + " |"
    lines = [
        "# gpumon view against ptmem, cold start, side by side",
        "",
        f"Written by `python benchmarks/view_vs_ptmem.py` on {platform.node() or '?'} "
        f"({os.cpu_count()} CPUs, shared), Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; median of {a.repeat} "
        "interleaved runs; each from starting the process (interpreter and imports included), "
        "bytecode compiled beforehand as an installed package has it. Cold: both tools' caches "
        "removed before each run; warm: both filled (a file opened again). CPU is user + sys of "
        "the child: on a shared machine it moves less than the wall time.",
        "",
        "First screen: until the first frame (the timeline, the event line and the key hints; "
        "ptmem: its key hint) is on the 80x24 terminal. Ready for keys: until a key typed the "
        "moment the first frame is up (the right arrow) has moved the cursor on the screen "
        "(the event at the cursor, read from the screen as a terminal emulator, pyte, draws "
        "it, is another). gpumon's first frame is plain text written while Textual is "
        "imported; it moves along the timeline itself and hands where it stands to the app. "
        "The CPU of ready for keys is the child's when it was stopped, from /proc (10 ms "
        "ticks); gpumon's includes Textual's import, which goes on meanwhile: compare the "
        "wall times there.",
        "",
        head,
        "|---|---:|" + "---:|" * len(cols),
    ]
    for label, mib, res in rows:
        lines.append(f"| {label} | {mib:.1f} | " + " | ".join(
            cell(res[c]) for c in cols) + " |")
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
