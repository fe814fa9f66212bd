"""`gpumon view FILE`: explore a memory snapshot in the terminal (no torch, GPU or network)."""
from __future__ import annotations

import os
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "view", help="explore a memory snapshot (.pickle) in the terminal",
        description="Explore a PyTorch memory snapshot (from gpumon snapshot, the OOM recorder "
                    "or torch.cuda.memory._dump_snapshot): timeline, live allocations, segments, "
                    "summary. Needs no torch, GPU or network; the file is read as plain data "
                    "and refused if it names any Python object.")
    p.add_argument("file", metavar="FILE", help="snapshot pickle (may be gzip'd)")
    p.add_argument("--summary", action="store_true", help="print the summary as text and exit")
    p.add_argument("--json", action="store_true", help="print the summary as JSON and exit")
    p.add_argument("--html", metavar="OUT.html",
                   help="write one self-contained offline HTML page and exit")
    p.add_argument("--device", type=int, default=None,
                   help="device index (default: the one with the most trace events)")
    p.add_argument("--top", type=int, default=10, help="groups listed in --summary/--json")
    p.add_argument("--no-color", action="store_true", help="monochrome (also NO_COLOR=1)")
    p.set_defaults(func=run_view)


def _err(msg: str, status: int = 1) -> int:
    print(f"gpumon: {msg}", file=sys.stderr)
    return status


def _size(path: str) -> str:
    try:
        n = os.path.getsize(path)
    except OSError:
        return "?"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def run_view(args) -> int:
    from gpumon.snapshot import SnapshotError, open_snapshot
    from gpumon.snapshot import report

    from gpumon.commands.args import progress
    try:
        with progress(f"reading {os.path.basename(args.file)} ({_size(args.file)})"):
            snap = open_snapshot(args.file)
        if args.device is not None and args.device not in snap.devices:
            return _err(f"no device {args.device} in this snapshot (devices: {snap.devices})")
        with progress("replaying its allocations"):
            snap.trace(args.device)  # the replay; a hostile file may still be refused here
        if args.html:
            try:
                page = report.html_page(snap, args.device)
                tmp = args.html + ".tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(page)
                os.replace(tmp, args.html)
            except OSError as e:
                return _err(f"cannot write {args.html}: {e.strerror or e}")
            print(f"wrote {args.html}")
            if not (args.summary or args.json):
                return 0
        if args.summary or args.json:
            s = report.summary(snap, args.device, top=args.top)
            sys.stdout.write(report.summary_json(s) + "\n" if args.json
                             else report.summary_text(s))
            return 0
    except SnapshotError as e:
        return _err(str(e))
    if not sys.stdout.isatty() or not sys.stdin.isatty():
        return _err("the snapshot view needs a terminal (use ssh -t or srun --pty); "
                    "--summary, --json and --html work without one", status=2)
    from gpumon.tui.view.app import run_view_app
    return run_view_app(snap, device=args.device,
                        no_color=args.no_color or bool(os.environ.get("NO_COLOR")))
