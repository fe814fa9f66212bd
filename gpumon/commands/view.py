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
    p.add_argument("--by", choices=("line", "function", "file", "library", "category",
                                    "module"),
                   default="line",
                   help="group live allocations by source line (default), function, file "
                        "(Python module), library (torch, transformers, your code), "
                        "category (parameter, activation, gradient, ...: in a snapshot made "
                        "from the profiler's memory timeline) or module (the nn.Module whose "
                        "forward or backward allocated it: a snapshot gpumon recorded)")
    p.add_argument("--leaks", action="store_true",
                   help="print what is still live --after N steps after the step that made it, "
                        "grouped by where it was made (text, or JSON with --json) and exit")
    p.add_argument("--after", type=int, default=1, metavar="N",
                   help="steps an allocation must outlive to count for --leaks (default 1)")
    p.add_argument("--table", choices=("live", "segments", "leaks", "timeline"),
                   help="print one table as CSV (or JSON with --json) and exit: live (at the "
                        "peak, or --event), segments, leaks, timeline (every event)")
    p.add_argument("--event", type=int, default=None, metavar="I",
                   help="the event for --table live (default: the peak)")
    p.add_argument("--window", type=int, default=None, metavar="N",
                   help="keep at most N events of a device's trace in memory: a longer trace "
                        "is shown as a window of N events around its peak, read in a second "
                        "pass, and memory stays bounded however long the file (default "
                        "1,000,000; 0 reads every event; in the view < and > move the window)")
    p.add_argument("--window-at", type=int, default=None, metavar="EVENT",
                   help="centre the window on this event of the whole trace (default: the peak)")
    p.add_argument("--no-color", action="store_true", help="monochrome (also NO_COLOR=1)")
    p.set_defaults(func=run_view)

    d = subparsers.add_parser(
        "diff", help="compare two memory snapshots: peaks and what changed, by line and module",
        description="Two snapshots side by side: peak allocated and reserved, and the change in "
                    "what was live at each one's peak, blamed on source lines, files (Python "
                    "modules) and libraries, largest change first. For the question after "
                    "changing the batch size, the model or torch: what grew, and where.")
    d.add_argument("a", metavar="A", help="the first snapshot (the baseline)")
    d.add_argument("b", metavar="B", help="the second snapshot")
    d.add_argument("--json", action="store_true", help="print the comparison as JSON")
    d.add_argument("--at", choices=("peak", "end"), default="peak",
                   help="compare what was live at each one's peak (default) or at its end")
    d.add_argument("--device", type=int, default=None,
                   help="device index in both files (default: each file's busiest)")
    d.add_argument("--grep", default="", metavar="TEXT",
                   help="only allocations with a frame whose file or function contains TEXT")
    d.add_argument("--top", type=int, default=20, help="rows per table (default 20)")
    d.add_argument("--tui", action="store_true",
                   help="show the comparison in the terminal UI (g: line/file/library)")
    d.set_defaults(func=run_diff)


class _LoadProgress:
    """Rich's progress bar on stderr for a load that takes more than `after` seconds (only on
    a terminal): the bytes of the file read, then the replay. Never fails the load."""

    def __init__(self, path: str, after: float = 1.0):
        import time
        self._time = time.monotonic
        self.t0 = self._time()
        self.after = after
        self.path = path
        self.bar = None
        self.task = None
        self.on = sys.stderr.isatty() and not os.environ.get("GPUMON_NO_PROGRESS")

    def _start(self, total):
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                                   TimeElapsedColumn)
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                            TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        self.bar.start()
        self.task = self.bar.add_task(f"reading {os.path.basename(self.path)}", total=total)

    def __call__(self, done: int, total: int) -> None:
        if not self.on:
            return
        if self.bar is None:
            if self._time() - self.t0 < self.after:
                return
            self._start(total)
        self.bar.update(self.task, completed=done, total=total)

    def phase(self, text: str) -> None:
        if self.on and self.bar is None and self._time() - self.t0 >= self.after:
            self._start(None)
        if self.bar is not None:
            self.bar.update(self.task, description=text, total=None)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


class _QuitDuringLoad:
    """While a file loads for the interactive view: `q` typed on the terminal stops the load
    at once (the main thread gets KeyboardInterrupt; `quit` tells it apart from Ctrl-C, which
    stays SIGINT), and any other key is kept for the view. Without a terminal it does
    nothing. (A long file took 10 s after q, the whole load, to quit.)

    `plain`: the plain first frame is up (Textual is being imported): the keys are read as
    they come, the timeline's keys are done on the plain frame at once (PlainFrame.act), and
    the others, with every key after the first of them (the order typed is kept), are kept
    in `keys` for the app."""

    def __init__(self, plain=None):
        self.quit = False
        self.typed = b""
        self.plain = plain
        self.keys: list[str] = []
        self._saved = None
        self._stop = None
        self._thread = None

    def __enter__(self):
        try:
            if not (sys.stdin.isatty() and sys.stdout.isatty()):
                return self
            import termios
            import threading
            fd = sys.stdin.fileno()
            self._saved = termios.tcgetattr(fd)
            new = termios.tcgetattr(fd)
            new[3] &= ~(termios.ECHO | termios.ICANON)   # ISIG stays: Ctrl-C is SIGINT
            termios.tcsetattr(fd, termios.TCSANOW, new)
            self._stop = threading.Event()
            self._wake = os.pipe()   # __exit__ wakes the watcher at once (no polling delay)
            self._thread = threading.Thread(target=self._watch, args=(fd,), daemon=True,
                                            name="gpumon-view-keys")
            self._thread.start()
        except Exception:  # noqa: BLE001 - a convenience: the load goes on without it
            self._saved = None
        return self

    def _watch(self, fd: int) -> None:
        import _thread
        import codecs
        import select
        if self.plain is not None:
            from gpumon.tui.view.frame import QUIT_KEYS, split_keys
        text = codecs.getincrementaldecoder("utf-8")("replace")
        rest = ""   # an escape sequence cut by a read
        while not self._stop.is_set():
            try:
                ready = select.select([fd, self._wake[0]], [], [], 0.05 if rest else 1.0)[0]
                if self._stop.is_set():
                    break
                b = os.read(fd, 64) if fd in ready else b""
            except OSError:
                return
            if fd in ready and not b:
                return
            if self.plain is None:
                if b"q" in b:
                    self.quit = True
                    _thread.interrupt_main()
                    return
                self.typed += b
                continue
            if not b and not rest:
                continue
            keys, rest = split_keys(rest + text.decode(b), final=not b)
            if QUIT_KEYS[0] in keys or QUIT_KEYS[1] in keys:
                self.quit = True
                _thread.interrupt_main()
                return
            self.feed(keys)
        if self.plain is not None and rest:
            self.keys += split_keys(rest, final=True)[0]

    def feed(self, keys: list[str]) -> None:
        """Keys typed on the plain frame: done there while no key waits for the app."""
        for k in keys:
            if not self.keys:
                try:
                    if self.plain.act(k):
                        continue
                except Exception:  # noqa: BLE001 - the app does it then
                    pass
            self.keys.append(k)

    def __exit__(self, *exc):
        if self._stop is not None:
            self._stop.set()
            try:
                os.write(self._wake[1], b"x")
            except OSError:
                pass
            self._thread.join(1.0)
            for end in self._wake:
                try:
                    os.close(end)
                except OSError:
                    pass
            self._stop = None
        if self._saved is not None:
            try:
                import termios
                termios.tcsetattr(sys.stdin.fileno(), termios.TCSANOW, self._saved)
            except Exception:  # noqa: BLE001
                pass
        return False


def _sidecar_note(snap, said: set | None = None) -> None:
    """One line on stderr for each thing worth knowing about how the file was read: a file
    beside the snapshot not taken for its sidecar, a file read whole instead of streamed."""
    for note in (getattr(snap, "load_note", None), getattr(snap, "sidecar_note", None)):
        if note and (said is None or note not in said):
            print(f"gpumon: note: {note}", file=sys.stderr)
            if said is not None:
                said.add(note)


def _err(msg: str) -> int:
    print(f"gpumon: {msg}", file=sys.stderr)
    return 1


def _summary_options(args, window: int) -> str:
    """What shapes `--summary`/`--json`'s output besides the file: the summary cache's key."""
    return f"device={args.device}|top={args.top}|by={args.by}|window={window}|" \
        f"at={args.window_at}|{'json' if args.json else 'text'}"


def run_view(args) -> int:
    try:
        rc = _run_view(args)
    finally:
        cache = sys.modules.get("gpumon.snapshot.cache")
        if cache is not None:
            cache.flush()   # the entries the interactive view held
    if (args.summary or args.json or args.html or args.table or args.leaks) and _the_program():
        # everything is printed and written: leave without the interpreter's teardown, which
        # frees the loaded file object by object (6.6 ms of a 3.5 MiB file's 130 ms --summary,
        # measured; os._exit ends the process as the return would, minus that)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _the_program() -> bool:
    """Whether this process is `gpumon` run from the shell (the console script or `python -m
    gpumon`), which exits as soon as main() returns; not a caller of main() in its own
    process (a test, a script), whose interpreter must go on."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        return spec.name in ("gpumon.__main__", "gpumon.cli")
    return os.path.basename(sys.argv[0] or "") == "gpumon"


def _run_view(args) -> int:
    from gpumon.snapshot.window import DEFAULT_WINDOW
    if args.window is not None and args.window < 0:
        print("gpumon: --window must be 0 (every event) or more", file=sys.stderr)
        return 2
    window = DEFAULT_WINDOW if args.window is None else args.window
    summary_only = (args.summary or args.json) and not (args.html or args.table or args.leaks)
    summary_key = None
    if summary_only:
        # a file summarised before: what that run printed (cache.py), before importing the
        # analysis (the imports, the load and the replay are most of a warm run's time)
        from gpumon.snapshot import cache
        summary_key = cache.summary_ident(args.file, _summary_options(args, window))
        kept = cache.summary_get(summary_key)
        if kept is not None and len(kept) == 2:
            notes, out = kept
            for note in filter(None, notes.split("\n")):
                print(f"gpumon: note: {note}", file=sys.stderr)
            sys.stdout.write(out)
            return 0
    from gpumon.snapshot import SnapshotError, open_snapshot
    from gpumon.snapshot import report
    prog = _LoadProgress(args.file)
    interactive = not (args.summary or args.json or args.html or args.table or args.leaks)
    keys = _QuitDuringLoad() if interactive else None
    if interactive:
        # the cache's entries are written when the view ends (run_view): written while the
        # plain frame takes keys, marshal held the interpreter's lock for milliseconds
        from gpumon.snapshot import cache
        cache.defer_writes()
    try:
        try:
            if keys is not None:
                keys.__enter__()
            snap = open_snapshot(args.file, progress=prog, window=window or None,
                                 window_at=args.window_at)
            _sidecar_note(snap)
            if args.device is not None and args.device not in snap.devices:
                return _err(f"no device {args.device} in this snapshot (devices: {snap.devices})")
            prog.phase("replaying the trace")
            tr = snap.trace(args.device)  # the replay; a hostile file may still be refused here
        except KeyboardInterrupt:
            if keys is not None and keys.quit:
                return 0   # q while loading: leave at once, as q does in the view
            raise
        finally:
            if keys is not None:
                keys.__exit__(None, None, None)
            prog.close()
        if args.after < 1:
            print("gpumon: --after must be at least 1", file=sys.stderr)
            return 2
        if args.table:
            if args.event is not None and not 0 <= args.event < max(1, tr.n):
                print(f"gpumon: --event must be between 0 and {max(0, tr.n - 1)}",
                      file=sys.stderr)
                return 2
            cols, rows = report.table(snap, args.table, args.device, by=args.by,
                                      event=args.event, after=args.after)
            sys.stdout.write(report.table_text(cols, rows, "json" if args.json else "csv"))
            return 0
        if args.leaks:
            from gpumon.snapshot.leaks import leaks, leaks_json, leaks_text
            d = leaks(snap, args.device, after=args.after, by=args.by, top=args.top)
            sys.stdout.write(leaks_json(d) + "\n" if args.json else leaks_text(d))
            return 0
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
            from gpumon.snapshot.load import gc_paused
            with gc_paused():   # its collections walked the loaded data again: 2 ms of 28
                s = report.summary(snap, args.device, top=args.top, by=args.by)
            out = report.summary_json(s) + "\n" if args.json else report.summary_text(s)
            sys.stdout.write(out)
            if summary_only:
                sys.stdout.flush()
                from gpumon.snapshot import cache
                notes = [n for n in (getattr(snap, "load_note", None),
                                     getattr(snap, "sidecar_note", None)) if n]
                cache.summary_put(summary_key, ["\n".join(notes), out])
            return 0
    except SnapshotError as e:
        return _err(str(e))
    if not sys.stdout.isatty() or not sys.stdin.isatty():
        print("gpumon: the interactive view needs a terminal (use ssh -t or srun --pty); "
              "--summary, --json and --html work without one", file=sys.stderr)
        return 2
    no_color = args.no_color or bool(os.environ.get("NO_COLOR"))
    # The first screen goes up as plain text now; importing Textual and building its first frame
    # takes longer than reading an everyday file. The app then draws over it.
    from gpumon.tui.view.frame import PlainFrame
    plain = PlainFrame(sys.stdout.fileno(), sys.stdin.fileno())
    starting = _QuitDuringLoad(plain)
    try:
        tr = snap.trace(args.device)
        plain.show(snap, tr, report.oom_info(snap, tr.device),
                   snap.step_boundaries(tr.device), no_color)
        # the plain frame acts on the timeline's keys while Textual is imported (~0.1 s, and
        # ~0.1 s more for its first frame); q leaves at once
        if keys is not None and keys.typed:   # typed while the file loaded: done first
            from gpumon.tui.view.frame import keys_of
            starting.feed(keys_of(keys.typed.decode("utf-8", "replace")))
        starting.__enter__()
        # a key's thread waits for the interpreter's lock while the import holds it: ask for
        # it back sooner than the default 5 ms (it is only asked for when a key came)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, 0.0005))
        try:
            from gpumon.tui.view.app import run_view_app
        finally:
            sys.setswitchinterval(interval)
            starting.__exit__(None, None, None)
    except KeyboardInterrupt:
        plain.abandon()
        if starting.quit:
            return 0
        raise
    except BaseException:
        plain.abandon()
        raise
    keys = starting.keys + plain.typed_keys()
    plain.close()
    return run_view_app(snap, device=args.device, no_color=no_color, keys=keys,
                        view=plain.view, show_reserved=plain.show_reserved)


def run_diff(args) -> int:
    from gpumon.snapshot import SnapshotError, open_snapshot
    from gpumon.snapshot.diff import diff, diff_json, diff_text

    if args.top < 1:
        print("gpumon: --top must be at least 1", file=sys.stderr)
        return 2
    snaps = []
    said: set = set()
    try:
        for path in (args.a, args.b):
            prog = _LoadProgress(path)
            try:
                s = open_snapshot(path, progress=prog)
            finally:
                prog.close()
            _sidecar_note(s, said)
            if args.device is not None and args.device not in s.devices:
                print(f"gpumon: no device {args.device} in {path} (devices: {s.devices})",
                      file=sys.stderr)
                return 1
            s.trace(args.device)
            snaps.append(s)
        d = diff(snaps[0], snaps[1], args.device, args.device, at=args.at, query=args.grep,
                 top=args.top)
    except SnapshotError as e:
        print(f"gpumon: {e}", file=sys.stderr)
        return 1
    m = d.get("matched")
    if m is not None and not m["a"] and not m["b"]:
        point = "peak" if args.at == "peak" else "end"
        print(f"gpumon: no allocation live at either file's {point} has a frame whose file or "
              f"function contains '{args.grep}'", file=sys.stderr)
        return 1
    if args.tui and not args.json:
        if not sys.stdout.isatty() or not sys.stdin.isatty():
            print("gpumon: diff --tui needs a terminal (use ssh -t or srun --pty); without "
                  "--tui the comparison prints as text", file=sys.stderr)
            return 2
        from gpumon.tui.view.diff_app import run_diff_app
        return run_diff_app(d)
    import shutil
    sys.stdout.write(diff_json(d) + "\n" if args.json
                     else diff_text(d, width=shutil.get_terminal_size((100, 24)).columns))
    return 0
