"""gpumon view against ptmem's cold start, side by side in one run (issue 18).

For each file: the first summary (`gpumon view F --summary` / `ptmem -s F`) and the first
screen (from starting the process in an 80x24 pseudo-terminal until its first frame is on the
terminal), each tool in turn, repeated; the median wall time and the median CPU time (user +
sys of the child) are reported. ptmem keeps a cache next to the file (.F.memcache): it is
removed before each of its runs, so both are cold. ptmem is taken from PTMEM_PATH (a folder
holding the `ptmem` package: `pip download ptmem==0.1.2 --no-deps` and unzip it) or from the
environment; without it only gpumon is measured.

The files: an "everyday" file of 40,000 events and 8 MB, written as torch's pickler writes a
stacks='all' dump (a fresh 34-frame list per event: gpumon/snapshot/synth_long.py); synthetic
snapshots of --events events from synth.py's allocator model with stacks='all' frames; and any
real snapshot given with --files.

    PTMEM_PATH=/tmp/ptmem python benchmarks/view_vs_ptmem.py [--events 40000 400000] [--files F ...]
"""
from __future__ import annotations

import argparse
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from first_screen import ROOT, bench_env, children_cpu, first_screen, precompile


def _cmd(tool: str, path: str, summary: bool) -> list[str]:
    if tool == "gpumon":
        return [sys.executable, "-m", "gpumon", "view", path] + (["--summary"] if summary else [])
    code = ("import sys; from ptmem.cli import run; sys.argv = ['ptmem'] + sys.argv[1:]; run()")
    return [sys.executable, "-c", code] + (["-s", path] if summary else [path])


def _clear_ptmem_cache(path: str) -> None:
    c = os.path.join(os.path.dirname(os.path.abspath(path)),
                     "." + os.path.basename(path) + ".memcache")
    try:
        os.unlink(c)
    except OSError:
        pass


def run_summary(tool: str, path: str, ptmem_path: str | None) -> tuple[float, float] | None:
    _clear_ptmem_cache(path)
    c0, t0 = children_cpu(), time.perf_counter()
    r = subprocess.run(_cmd(tool, path, True), capture_output=True, env=bench_env(ptmem_path),
                       cwd=ROOT, timeout=600)
    wall, cpu = time.perf_counter() - t0, children_cpu() - c0
    return (wall, cpu) if r.returncode == 0 and r.stdout else None


def run_first_screen(tool: str, path: str, ptmem_path: str | None,
                     interactive: bool = False) -> tuple[float, float] | None:
    """From starting the process until its first frame is on the terminal (the last line each
    draws of it; ptmem: its key hint, cut at 80 columns). interactive: until gpumon's Textual
    frame has replaced the plain first frame (the same marks a second time)."""
    _clear_ptmem_cache(path)
    marks = (b"events/col", b"quit") if tool == "gpumon" else (b"Pan Y",)
    return first_screen(_cmd(tool, path, False), marks, bench_env(ptmem_path),
                        times=2 if interactive else 1)


def run_interactive(tool: str, path: str, ptmem_path: str | None):
    return run_first_screen(tool, path, ptmem_path, interactive=True) if tool == "gpumon" \
        else None


def _median(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return (statistics.median(w for w, _ in xs), statistics.median(c for _, c in xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, nargs="*", default=[40_000, 400_000])
    ap.add_argument("--files", nargs="*", default=[], help="real snapshots to measure as well")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-everyday", dest="everyday", action="store_false",
                    help="skip the 8 MB, 40k-event file (synth_long.py, depth 26)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "view_vs_ptmem.md"))
    a = ap.parse_args()
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
                runs = {t: [] for t in tools}
                for _ in range(a.repeat):
                    for t in tools:   # interleaved, so both see the same machine load
                        runs[t].append(fn(t, path, ptmem_path))
                for t in tools:
                    res[(what, t)] = _median(runs[t])
            rows.append((label, mib, res))
            print(label, res, file=sys.stderr)

    def cell(r):
        return f"{r[0]:.2f} / {r[1]:.2f}" if r else "failed"
    cols = [("summary", t) for t in tools] + [("first", t) for t in tools] + \
        [("interactive", "gpumon")]
    names = {"summary": "summary", "first": "first screen",
             "interactive": "Textual ready"}
    head = "| file | MiB | " + " | ".join(f"{names[w]} {t} s (wall / CPU)" for w, t in cols) + " |"
    lines = [
        "# gpumon view against ptmem, cold start, side by side",
        "",
        f"Written by `python benchmarks/view_vs_ptmem.py` on {platform.node() or '?'} "
        f"({os.cpu_count()} CPUs, shared), Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; median of {a.repeat} "
        "interleaved runs; each from starting the process (interpreter and imports included), "
        "bytecode compiled beforehand as an installed package has it. ptmem's cache is removed "
        "before each of its runs. CPU is user + sys of the child: on a shared machine it moves "
        "less than the wall time.",
        "",
        "First screen: until the first frame (the timeline, the event line and the key hints; "
        "ptmem: its key hint) is on the 80x24 terminal. gpumon writes it as plain text while "
        "Textual is imported; \"Textual ready\" is when the app has drawn its own frame over it "
        "(keys typed in between are replayed to the app).",
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
