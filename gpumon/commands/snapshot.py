"""`gpumon snapshot PID`: record a running process's CUDA allocation history and dump it.

    gpumon snapshot PID                 record until Enter / Ctrl-C, then dump; prints the path
    gpumon snapshot PID --seconds 10    record 10 s, dump
    gpumon snapshot PID --steps 3       record 3 optimizer steps, dump
    gpumon snapshot PID --start         start recording and return (stop later with --stop)
    gpumon snapshot PID --stop          dump what was recorded, stop recording
    gpumon snapshot PID --status        is it recording, by whom, since when

PID may be a launcher (torchrun, `gpumon run`): every agent under it records, one file per
rank. The agent does the work (gpumon/agent/snapshot.py); this is a thin client.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Callable

from gpumon.commands.args import pid_arg

STOP_TIMEOUT = 600.0  # dumping a large history with C++ stacks can take a while


def register(sub) -> None:
    p = sub.add_parser(
        "snapshot", help="record a running process's CUDA allocation history and dump a snapshot",
        description="Record the CUDA caching allocator's history in a running process (its "
                    "gpumon agent does it) and write a snapshot that `gpumon view` and "
                    "pytorch.org/memory_viz open. Without --seconds/--steps it records until "
                    "you press Enter or Ctrl-C.")
    p.add_argument("pid", type=pid_arg, help="the training process (or its launcher)")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--seconds", type=float, metavar="N", help="record N seconds, then dump")
    when.add_argument("--steps", type=int, metavar="N",
                      help="record N optimizer steps, then dump")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--start", action="store_true",
                      help="start recording and return; dump later with --stop")
    mode.add_argument("--stop", action="store_true", help="dump the recording and stop it")
    mode.add_argument("--status", action="store_true", help="show the recording state")
    p.add_argument("-o", "--out", metavar="FILE",
                   help="where to write (a file, or a folder); default: a per-run folder "
                        "gpumon-snapshots/ in the process's working directory")
    p.add_argument("--stacks", choices=("python", "all"), default="python",
                   help="python (default, fast) or all (adds C++ frames; slower first dump)")
    p.add_argument("--max-entries", type=int, default=None, metavar="N",
                   help="history ring size (default 100000 events)")
    p.add_argument("--rank", type=int, default=None,
                   help="with a launcher pid: only the agent of this rank")
    p.set_defaults(func=run)


def _fmt_size(n) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _err(msg: str) -> int:
    print(f"gpumon: {msg}", file=sys.stderr)
    return 1


def _usage(msg: str) -> int:
    """A command line that cannot work as given: the same one line, status 2."""
    _err(msg)
    return 2


def _who() -> str:
    try:
        import getpass
        user = getpass.getuser()
    except Exception:
        user = "?"
    return f"gpumon snapshot (pid {os.getpid()}, {user})"


class _Agent:
    """One serving process of the target, as this command talks to it: its hello, its
    commands (through the target's connection, which owns the recording: if this command
    is killed, the agent stops and dumps it), and whether it has ended."""

    def __init__(self, target, member) -> None:
        self.target, self.key, self.hello = target, member.key, member.hello or {}

    def request(self, cmd, args=None, timeout=5.0):
        return self.target.request(self.key, cmd, args, timeout=timeout)

    @property
    def ended(self) -> bool:
        from gpumon import client
        m = self.target.members().get(self.key)
        return m is None or m.state in (client.EXITED, client.NO_PROCESS)


class _Events:
    """The target's snapshot events and process ends, per agent, from its subscription."""

    def __init__(self, sub) -> None:
        self.sub = sub

    def next(self, timeout: float):
        """(key, event or None for "it ended") or None when nothing came within timeout."""
        from gpumon import client
        end = time.monotonic() + timeout
        while True:
            try:
                item = self.sub.get(timeout=max(0.0, end - time.monotonic()))
            except TimeoutError:
                return None
            if item is None:
                time.sleep(max(0.0, min(0.05, end - time.monotonic())))
                return None
            m = item[1]
            if m.get("type") == "event" and m.get("kind") == "snapshot":
                return m["key"], m
            if m.get("type") == "state" and m.get("state") in (client.EXITED,
                                                                client.NO_PROCESS):
                return m["key"], None


def _label(conn) -> str:
    h = conn.hello
    r = h.get("rank")
    return f"pid {h.get('pid')}" + (f" rank {r}" if r is not None else "")


def _print_facts(conn, facts: dict, many: bool) -> None:
    prefix = f"{_label(conn)}: " if many else ""
    sim = " (SIMULATED: the agent uses the simulated source, not a real GPU)" \
        if facts.get("simulated") else ""
    # The path alone on stdout (easy to copy or pipe); the details on stderr.
    print(f"{prefix}{facts['path']}")
    print(f"{prefix}{_fmt_size(facts.get('size'))}, {facts.get('entries')} trace entries"
          f"{sim}; open with: gpumon view {facts['path']}", file=sys.stderr)
    if facts.get("note"):
        print(f"{prefix}note: {facts['note']}", file=sys.stderr)


def _armed_until_cuda(target) -> None:
    """Agents loaded but waiting for the program's first CUDA call: the recording asked for is
    armed, and this waits, saying so, until one serves; then the recording starts at once, so
    `--steps N` records the first N steps. It refused (status 1) before."""
    from gpumon.commands.args import wait_while_only_waiting
    wait_while_only_waiting(
        target, "pid {pids}: waiting for the program's first CUDA call; the recording is armed "
        "and starts then (Ctrl-C: cancel, nothing is recorded)",
        "pid {pids}: armed, waiting for its first CUDA call", None)


NEEDS_A_WAY_TO_END = ("stdin is not a terminal, so there is no Enter to stop the recording: "
                      "give --seconds N or --steps N (or --start, then --stop later)")


def run(args: argparse.Namespace) -> int:
    from gpumon import client
    # a value out of range is a usage error (status 2), as argparse's own refusals are
    if args.seconds is not None and not 0 < args.seconds <= 7 * 24 * 3600:  # (NaN fails too)
        return _usage("--seconds must be greater than 0 and at most 604800 (7 days)")
    if args.steps is not None and args.steps <= 0:
        return _usage("--steps must be a positive integer")
    if args.max_entries is not None and args.max_entries <= 0:
        return _usage("--max-entries must be a positive integer")
    manual = not (args.seconds or args.steps or args.start or args.stop or args.status)
    if manual and not (sys.stdin is not None and sys.stdin.isatty()):
        _err(NEEDS_A_WAY_TO_END)
        return 2
    try:
        client.check_pid(args.pid)
    except client.AttachError as e:
        return _err(str(e))
    target = client.LocalTarget(args.pid, nvml_s=None)
    events = _Events(target.subscribe(types=("state", "event")))
    try:
        target.start()
        if not (args.status or args.stop):
            _armed_until_cuda(target)  # a recording asked before CUDA starts with it
        members = target.members().values()
        agents = [_Agent(target, m) for m in sorted(
            (m for m in members if m.serving), key=lambda m: (m.rank is None, m.rank, m.pid))]
        if not agents:
            from gpumon.commands.args import no_agent_line
            return _err(no_agent_line(target, args.pid))
        if args.rank is not None:
            agents = [c for c in agents if c.hello.get("rank") == args.rank]
            if not agents:
                return _err(f"no agent of rank {args.rank} under pid {args.pid}")
        many = len(agents) > 1
        out = os.path.abspath(os.path.expanduser(args.out)) if args.out else None
        if out and args.out.endswith(("/", os.sep)):  # `-o runs/`: a folder (abspath drops the /)
            out = out.rstrip(os.sep) + os.sep
        if out and many:
            os.makedirs(out, exist_ok=True)  # one file per rank, inside
            out = out.rstrip(os.sep) + os.sep
        if args.status:
            return _status(agents, many)
        if args.stop:
            return _stop(agents, out, many)
        return _record(args, agents, events, out, many)
    finally:
        target.close()


def _status(conns, many) -> int:
    from gpumon import client
    rc = 0
    for c in conns:
        prefix = f"{_label(c)}: " if many else ""
        try:
            st = c.request("snapshot_status")
        except client.AgentError as e:
            print(f"{prefix}error: {e}", file=sys.stderr)
            rc = 1
            continue
        if st.get("recording"):
            by = st.get("who") or st.get("by")
            since = time.strftime("%H:%M:%S", time.localtime(st["since"]))
            extra = ""
            if st.get("seconds"):
                extra = f", stops after {st['seconds']:g} s"
            elif st.get("steps"):
                extra = f", step {st.get('steps_done')}/{st['steps']}"
            print(f"{prefix}recording since {since} ({st.get('elapsed', 0):.0f} s) by {by}"
                  f"{extra}")
        elif st.get("dumping"):
            print(f"{prefix}writing a snapshot")
        else:
            avail = "" if st.get("available") else f" (snapshots unavailable: {st.get('reason')})"
            print(f"{prefix}not recording{avail}")
        if st.get("oom_recorder"):
            print(f"{prefix}OOM flight recorder on ({st.get('oom_dumps', 0)} OOM snapshots)")
        last = st.get("last")
        if last:
            print(f"{prefix}last snapshot: {last.get('path')}")
    return rc


def _stop(conns, out, many) -> int:
    from gpumon import client
    rc = 0
    results: dict = {}

    def one(c):
        try:
            results[id(c)] = c.request("snapshot_stop", {"out": out}, timeout=STOP_TIMEOUT)
        except client.AgentError as e:
            results[id(c)] = e

    threads = [threading.Thread(target=one, args=(c,), daemon=True) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in conns:
        r = results.get(id(c))
        if isinstance(r, dict):
            _print_facts(c, r, many)
        else:
            print(f"gpumon: {_label(c) + ': ' if many else ''}{r}", file=sys.stderr)
            rc = 1
    return rc


def _defer_signals(seen: list) -> Callable[[], object]:
    """Hold Ctrl-C and SIGTERM back (noting them in `seen`) until the returned function is
    called. While recordings are being started, an interrupt must not end this command with a
    recording left on in the program; it is handled once every start has answered. SIGTERM
    (a job's end, `kill`) then ends the command as Ctrl-C does: stop, dump, say where."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, lambda signum, frame: seen.append(signum))
    except (ValueError, OSError):
        pass

    def restore() -> None:  # calling it twice is harmless
        for sig, h in old.items():
            signal.signal(sig, h)
    return restore


class _Terminated(KeyboardInterrupt):
    """SIGTERM while recording: stop and dump as Ctrl-C does, but end with the command's own
    status (a job's end is not the user's Ctrl-C)."""


def _sigterm_as_interrupt() -> Callable[[], object]:
    """While waiting: SIGTERM stops the recording and dumps it, as Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_term(signum, frame):
        raise _Terminated

    try:
        old = signal.signal(signal.SIGTERM, on_term)
    except (ValueError, OSError):
        return lambda: None
    return lambda: signal.signal(signal.SIGTERM, old)


def _record(args, conns, events, out, many) -> int:
    from gpumon import client
    start_args = {"stacks": args.stacks, "max_entries": args.max_entries,
                  "seconds": args.seconds, "steps": args.steps, "who": _who(),
                  "out": out,  # the agent checks it can write there before recording
                  "keep": bool(args.start)}  # else it ends with this command's connection
    started = []
    rc = 0
    interrupted: list = []
    ctrl_c = False
    restore_signals = _defer_signals(interrupted)
    restore_term = lambda: None  # noqa: E731
    try:
        for c in conns:
            prefix = f"{_label(c)}: " if many else ""
            try:
                res = c.request("snapshot_start", start_args, timeout=60.0)
            except client.AgentError as e:
                print(f"gpumon: {prefix}{e}", file=sys.stderr)
                rc = 1
                continue
            started.append(c)
            if res.get("note"):
                print(f"{prefix}note: {res['note']}", file=sys.stderr)
            if res.get("simulated"):
                print(f"{prefix}note: simulated source: the snapshot will be SIMULATED",
                      file=sys.stderr)
        if not started:
            return rc or 1
        if args.start:
            for c in started:
                print(f"{_label(c)}: recording; dump it with: gpumon snapshot "
                      f"{c.hello.get('pid')} --stop", file=sys.stderr)
            return rc
        timed = args.seconds is not None or args.steps is not None
        what = (f"{args.seconds:g} s" if args.seconds is not None else
                f"{args.steps} optimizer steps" if args.steps is not None else None)
        if timed:
            print(f"recording {what} ... (Ctrl-C: stop now and dump)", file=sys.stderr)
        else:
            print("recording ... press Enter (or Ctrl-C) to stop and dump", file=sys.stderr)
        try:
            restore_signals()
            restore_term = _sigterm_as_interrupt()
            if interrupted:  # Ctrl-C or SIGTERM while the recordings were starting
                raise (KeyboardInterrupt if signal.SIGINT in interrupted else _Terminated)
            if timed:
                pending = {c.key: c for c in started}
                deadline = None if args.seconds is None else time.monotonic() + args.seconds + 120
                _wait_events(events, pending, deadline, many)
                if pending:
                    rc = 1
                    for c in pending.values():
                        print(f"gpumon: {_label(c)}: no snapshot came back (the "
                              "process exited or the dump failed; see `gpumon snapshot "
                              f"{c.hello.get('pid')} --status`)", file=sys.stderr)
                return rc
            _wait_enter(started)
        except KeyboardInterrupt as e:
            ctrl_c = not isinstance(e, _Terminated)
            print("", file=sys.stderr)
    finally:
        restore_signals()
        restore_term()
    alive = [c for c in started if not c.ended]
    gone = {c.key: c for c in started if c.ended}
    if gone:
        rc = _exit_snapshots(events, gone, many) or rc
    if alive:
        rc = _stop(alive, out, many) or rc
    if ctrl_c:  # the interrupt rule: finished (dumped) what it started, then 130
        from gpumon.interrupt import Interrupted
        raise Interrupted("the recording was stopped and saved (path above)" if rc == 0 else
                          "the recording was stopped; saving it failed (see above)")
    return rc


def _wait_enter(conns) -> None:
    """Until Enter, EOF on stdin, or every agent gone (the process exited)."""
    done = threading.Event()

    def read_stdin():
        try:
            sys.stdin.readline()
        except Exception:
            pass
        done.set()

    if sys.stdin is not None and sys.stdin.isatty():
        threading.Thread(target=read_stdin, daemon=True).start()
    while not done.wait(0.2):
        if all(c.ended for c in conns):
            return


def _wait_events(events, pending: dict, deadline, many) -> None:
    """Wait for each agent's snapshot event (or its failure, or its end), printing results."""
    while pending:
        got = events.next(0.2) if events is not None else None
        if got is not None and got[0] in pending:
            key, msg = got
            c = pending.pop(key)
            if msg is None:  # the process went away; its exit dump would have come first
                print(f"gpumon: {_label(c)}: the process exited before the snapshot",
                      file=sys.stderr)
            elif msg.get("ok", True) and msg.get("path"):
                _print_facts(c, msg, many)
            else:
                print(f"gpumon: {_label(c) + ': ' if many else ''}"
                      f"{msg.get('error')}", file=sys.stderr)
        if deadline is not None and time.monotonic() > deadline:
            return


def _exit_snapshots(events, gone: dict, many) -> int:
    """Processes that ended while recording: the agent dumped at exit; print where."""
    rc = 0
    end = time.monotonic() + 2.0
    while gone and time.monotonic() < end:
        got = events.next(0.2)
        if got is None or got[0] not in gone:
            continue
        key, msg = got
        if msg is not None and msg.get("path"):
            _print_facts(gone.pop(key), msg, many)
    for c in gone.values():
        print(f"gpumon: {_label(c)}: the process exited while recording",
              file=sys.stderr)
        rc = 1
    return rc
