"""`gpumon run`, `gpumon ls`, `gpumon attach`, `gpumon demo`.

Heavy imports (the TUI, psutil) happen inside the commands, so `gpumon --help` stays fast.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any

from gpumon.commands.args import pid_arg

TTY_HINT = ("stdout is not a terminal; the live view needs one (use `ssh -t`, or "
            "`srun --pty` under Slurm), or use `gpumon attach {pid} --json` / `--once`")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a command with the gpumon agent in every Python process",
                       description="Run CMD with the gpumon agent started in every Python process "
                       "it spawns (torchrun's ranks included). Example: gpumon run -- python train.py")
    p.add_argument("--oom-snapshot", action="store_true",
                   help="keep an allocation history and dump a snapshot at an out-of-memory error")
    p.add_argument("--rate", type=float, default=None, metavar="HZ",
                   help="samples per second (default 10)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("ls", help="list the agents on this node",
                       description="List this user's gpumon agents: pid, rank, devices, state, age, command.")
    p.add_argument("--json", action="store_true", help="one JSON array, for scripts")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("attach", help="live view of a process (or of a launcher's ranks)",
                       description="Attach to PID: its agent, or the agents among its descendants "
                       "(torchrun, a shell script, gpumon run), at any moment of its life: an "
                       "agent still waiting for the program's first CUDA call is shown as such "
                       "and followed as soon as it serves; ranks that start later or restart "
                       "join. Without an agent: NVML figures only.")
    p.add_argument("pid", type=pid_arg, nargs="?")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help="one JSON object per sample on stdout")
    g.add_argument("--once", action="store_true", help="print the current figures and exit")
    p.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                   help="with --once: how long to wait for an agent that is loaded but waits "
                        f"for the program's first CUDA call (default {DEFAULT_WAIT_S:g})")
    p.add_argument("--fps", type=float, default=4.0, help="screen redraws per second (default 4)")
    p.add_argument("--no-color", action="store_true", help="monochrome (also: NO_COLOR=1)")
    p.add_argument("--estimate", metavar="EST.json",
                   help="show this `gpumon estimate ... --json` output beside the measured "
                        "breakdown (key b), term by term with the error in %%")
    p.add_argument("--inject", action="store_true",
                   help="load the agent into a process started without gpumon")
    from gpumon.commands.cluster import add_attach_args
    add_attach_args(p)  # --hosts, --slurm: every rank of every node
    p.set_defaults(func=cmd_attach)

    p = sub.add_parser("demo", help="a built-in training run and the live view, no GPU needed",
                       description="Train a small transformer with AdamW in a child process under "
                       "the agent (on the GPU if there is one, else on the CPU with simulated GPU "
                       "memory) and open the live view on it.")
    p.add_argument("--once", action="store_true", help="print the figures once instead of the UI")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even where CUDA is")
    p.add_argument("--fps", type=float, default=4.0)
    p.add_argument("--no-color", action="store_true")
    p.set_defaults(func=cmd_demo)


def _err(msg: str) -> None:
    sys.stderr.write(f"gpumon: {msg}\n")
    sys.stderr.flush()


# -- run -------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        _err("nothing to run: gpumon run -- python train.py")
        return 2
    if args.rate is not None and not (0.1 <= args.rate <= 1000):
        _err("--rate must be between 0.1 and 1000 Hz")
        return 2
    from gpumon.agent import bootstrap
    from gpumon.agent.paths import UnsafeDirectory
    try:
        env = bootstrap.run_env(rate_hz=args.rate, oom_snapshot=args.oom_snapshot)
    except UnsafeDirectory as e:
        _err(str(e))
        return 1
    except OSError as e:  # the socket dir can't be made (read-only, full disk)
        from gpumon.agent.paths import base_dir
        _err(f"cannot prepare gpumon's folder in {e.filename or base_dir()}: "
             f"{e.strerror or e}; set GPUMON_DIR to a writable directory")
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    held = _hold_sigint_for(cmd, env)
    try:
        # exec: the command keeps this pid, its signals and its exit status, exactly.
        os.execvpe(cmd[0], cmd, env)
    except OSError:
        if held:
            import signal
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            env.pop(bootstrap.SIGINT_HELD, None)
        try:
            raise
        except FileNotFoundError:
            _err(f"command not found: {cmd[0]}")
            return 127
        except PermissionError:
            _err(f"permission denied: {cmd[0]}")
            return 126
        except OSError as e:
            _err(f"cannot run {cmd[0]}: {e.strerror or e}")
            return 126
    return 0  # not reached


def _hold_sigint_for(cmd: list[str], env: dict[str, str]) -> bool:
    """Block SIGINT across the exec when the command is a Python that will run gpumon's
    sitecustomize, which lets it go at the end of the interpreter's start-up (see
    bootstrap.SITECUSTOMIZE): a Ctrl-C while the interpreter starts then ends the program by
    SIGINT, as before it had started, instead of "Fatal Python error: init_import_site" (a
    window that gpumon's own start-up would otherwise add to the program's). Never for
    anything else: a shell would keep SIGINT blocked for all its children."""
    import signal
    from gpumon.agent import bootstrap
    try:
        if signal.getsignal(signal.SIGINT) not in (signal.SIG_DFL, signal.default_int_handler) \
                or signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set()):
            return False
        if not bootstrap.runs_our_sitecustomize(cmd, env):
            return False
        env[bootstrap.SIGINT_HELD] = "1"
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        return True
    except (OSError, ValueError, AttributeError):
        return False


# -- figures, as text ------------------------------------------------------------------------
def human(n: Any) -> str:
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def duration(s: float | None) -> str:
    if s is None:
        return "n/a"
    s = int(max(0, s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _rank(h: dict) -> str:
    r, w = h.get("rank"), h.get("world_size")
    if r is None:
        return "-"
    return f"{r}/{w}" if w is not None else str(r)


def _command(h: dict) -> str:
    """The argv as one printable line (a `python -c` program has newlines; a hostile argv may
    have terminal escapes): control characters are shown escaped."""
    import shlex
    cmd = " ".join(shlex.quote(a) for a in h.get("argv") or []) or "?"
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in cmd)


def clip(text: str, width: int) -> str:
    """text in at most width characters, cut at a word boundary with an ellipsis (a command
    line cut mid-word reads as a different command)."""
    if len(text) <= width:
        return text
    cut = text[:width - 1]
    space = cut.rfind(" ")
    if space >= width // 2:
        cut = cut[:space]
    return cut.rstrip() + "…"


def _sub(a: Any, b: Any) -> Any:
    return None if a is None or b is None else a - b


ONCE_WIDTH = 80  # `attach --once` is read in an 80-column terminal as often as in a log


def _wrap(text: str, width: int = ONCE_WIDTH) -> list[str]:
    """A line of prose in lines of at most width, cut between words, the rest indented."""
    import textwrap
    return textwrap.wrap(text, width, subsequent_indent="    ", break_on_hyphens=False,
                         break_long_words=True) or [""]


def format_once(hello: dict, sample: dict | None, state: str = "running") -> str:
    head = (f"pid {hello.get('pid')}  rank {_rank(hello)}  {state}  up "
            f"{duration(time.time() - hello['start_time']) if hello.get('start_time') else 'n/a'}"
            "  ")
    lines = [head + clip(_command(hello), max(20, ONCE_WIDTH - len(head)))]
    al = hello.get("allocator") or {}
    src = hello.get("source")
    extra = f" ({hello['demo']})" if hello.get("demo") else ""
    lines += _wrap(f"source {src}{extra}")
    lines += _wrap(f"  torch {hello.get('torch') or 'n/a'}  allocator {al.get('backend') or 'n/a'}"
                   f"  expandable_segments {al.get('expandable_segments')}"
                   f"  {hello.get('rate_hz')} Hz")
    if hello.get("nvml") and src != "simulated":
        lines += _wrap(f"NVML: {hello['nvml']}")
    if sample is None:
        lines.append("  (no sample yet)")
        return "\n".join(lines)
    names = {d.get("index"): d for d in hello.get("devices") or []}
    for d in sample.get("devices") or []:
        info = names.get(d.get("index"), {})
        total = d.get("nvml_total") or info.get("total")
        lines.append(f"cuda:{d.get('index')}  {info.get('name') or '?'}  ({human(total)})")
        rows = [
            ("allocated", human(d.get("allocated")), "peak " + human(d.get("peak_allocated"))),
            ("reserved", human(d.get("reserved")), "peak " + human(d.get("peak_reserved"))),
            ("active", human(d.get("active")), "peak " + human(d.get("peak_active"))),
            ("cache (reserved - allocated)", human(_sub(d.get("reserved"), d.get("allocated"))),
             "inactive split " + human(d.get("inactive_split"))),
            ("device used (NVML)", human(d.get("nvml_used")),
             "free " + human(_sub(d.get("nvml_total"), d.get("nvml_used")))),
            ("this process (NVML)", human(d.get("proc_used")),
             "non-PyTorch " + human(_sub(d.get("proc_used"), d.get("reserved")))),
            ("alloc retries / OOMs", f"{d.get('alloc_retries')} / {d.get('ooms')}",
             f"segments {d.get('segments')}"),
        ]
        for label, v, note in rows:
            lines.append(f"  {label:<30}{v:>12}   {note}")
    if sample.get("phase") is not None or sample.get("step") is not None:
        lines.append(f"  phase {sample.get('phase')}  step {sample.get('step')}")
    lines.append(f"  agent cost {sample.get('cost_us')} us per sample")
    return "\n".join(lines)


# -- ls --------------------------------------------------------------------------------------
def _state(pid: int) -> str:
    try:
        import psutil
        return psutil.Process(pid).status()
    except Exception:
        return "gone"


def cmd_ls(args: argparse.Namespace) -> int:
    from gpumon import client
    t = client.LocalTarget(None, nvml_s=None)  # every agent of this node: serving or waiting
    try:
        members = sorted(t.start().members().values(), key=lambda m: m.pid)
    finally:
        t.close()
    from gpumon.client import discovery
    sockets = {pid: f.path for pid, f in discovery.scan().items()}
    rows = []
    for m in members:
        h = m.hello if m.serving else None
        if h is None:
            from gpumon.client import procs
            argv = procs.argv(m.pid)
            rows.append({"pid": m.pid, "rank": m.rank, "local_rank": None, "world_size": None,
                         "devices": [], "command": _command({"argv": argv}) if argv else None,
                         "state": m.state, "age": _age(procs.start_time(m.pid)),
                         "source": None, "socket": None, "error": None, "line": m.line})
            continue
        rows.append({"pid": h["pid"], "rank": h.get("rank"), "local_rank": h.get("local_rank"),
                     "world_size": h.get("world_size"),
                     "devices": [d.get("index") for d in h.get("devices") or []],
                     "command": _command(h), "state": _state(h["pid"]),
                     "age": _age(h.get("start_time")), "source": h.get("source"),
                     "socket": str(sockets.get(h["pid"]) or client.socket_dir() /
                                   f"{h['pid']}.sock"), "error": None,
                     "line": m.line})
    refused = discovery.unsafe_dirs()
    for d, why in refused.items():  # (an agent there would not be listed)
        _err(f"not looked in {d}: {why}")
    if refused and not rows:  # nothing to list, and a reason why there may be: a failure
        return 1
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return 0
    if not rows:
        looked = [str(d) for d in discovery.candidate_dirs()]
        sys.stdout.write(f"no gpumon agents (looked in {', '.join(looked)})\n")
        return 0
    sys.stdout.write(f"{'PID':>8}  {'RANK':<6} {'DEVICES':<10} {'STATE':<12} {'AGE':>8}  COMMAND\n")
    room = ls_command_width(sys.stdout)
    notes = []
    for r in rows:
        rank = "-" if r["rank"] is None else (
            f"{r['rank']}/{r['world_size']}" if r["world_size"] is not None else str(r["rank"]))
        devs = ",".join(f"{i}" for i in r["devices"]) or "-"
        if r["source"] == "simulated":
            devs += " (sim)"
        cmd = r["command"] or r["error"] or ""
        sys.stdout.write(f"{r['pid']:>8}  {rank:<6} {devs:<10} {r['state']:<12} "
                         f"{duration(r['age']):>8}  {clip(cmd, room)}\n")
        if r["socket"] is None and r["state"] not in ("helper",):
            notes.append(r["line"])
    for line in notes:
        sys.stdout.write(f"{line}\n")
    return 0


LS_FIXED = 51  # the columns before COMMAND in `gpumon ls`


def ls_command_width(out) -> int:
    """How much of the command `ls` shows: on a terminal, what is left of its width (a row
    that wraps at 80 columns breaks the table); piped, 100 characters as before."""
    import shutil
    try:
        tty = out.isatty()
    except (AttributeError, ValueError):
        tty = False
    if not tty:
        return 100
    return max(20, shutil.get_terminal_size((80, 24)).columns - LS_FIXED)


def _age(start: float | None) -> float | None:
    return time.time() - start if start else None


# -- attach ----------------------------------------------------------------------------------
DEFAULT_WAIT_S = 10.0


def cmd_attach(args: argparse.Namespace) -> int:
    from gpumon import client
    if getattr(args, "hosts", None) or getattr(args, "slurm", None):
        from gpumon.commands.cluster import attach_cluster
        return attach_cluster(args)
    if getattr(args, "job", None) is not None:
        _err("--job goes with --hosts (a job's ranks on those nodes); --slurm JOBID implies it")
        return 2
    pid = args.pid
    if pid is None:
        _err("attach needs a PID (or --hosts HOST,... / --slurm JOBID)")
        return 2
    try:
        client.check_pid(pid)
    except client.AttachError as e:
        _err(str(e))
        return 1
    if args.wait is not None and not args.wait >= 0:
        _err("--wait must be 0 or more seconds")
        return 2
    estimate = getattr(args, "estimate", None)
    if estimate and (why := _bad_estimate(estimate)):
        _err(why)
        return 1
    # Every usage check before any side effect (the injection stops the target under gdb).
    interactive = not (args.json or args.once)
    if interactive and not sys.stdout.isatty():
        _err(TTY_HINT.format(pid=pid))
        return 2
    tui = _tui(f"gpumon attach {pid} --json") if interactive else None
    if interactive and tui is None:
        return 1
    if args.inject and not _has_agent(pid) and (rc := _inject(pid)):
        return rc
    if interactive and not args.inject and not _has_agent(pid):
        from gpumon.client.target import classify
        if classify(pid)[0] == client.NO_AGENT:
            from gpumon.commands.inject import offer_inject
            offer_inject(pid)  # on a terminal: asks, and loads the agent if told to
    target = client.LocalTarget(pid)
    if args.json:
        return attach_json(target)
    if args.once:
        return attach_once(target, DEFAULT_WAIT_S if args.wait is None else args.wait)
    no_color = args.no_color or bool(os.environ.get("NO_COLOR"))
    return int(tui.run_attach(target, fps=args.fps, no_color=no_color, estimate=estimate) or 0)


def _bad_estimate(path: str) -> str | None:
    """Why the --estimate file cannot be used (one line), or None: checked before anything
    starts, for the live view and --once/--json alike."""
    hint = "write one with `gpumon estimate ... --json > FILE`"
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        return f"no estimate file {path} ({hint})"
    except OSError as e:
        return f"cannot read the estimate {path}: {e.strerror or e} ({hint})"
    except ValueError:
        return f"{path} is not JSON, so not a gpumon estimate ({hint})"
    from gpumon.estimate.compare import as_estimate_dict
    try:
        as_estimate_dict(d)
    except (ValueError, TypeError, KeyError, AttributeError):
        return f"{path} is not a gpumon estimate ({hint})"
    return None


def _has_agent(pid: int) -> bool:
    """An agent, serving or waiting for CUDA, in pid or under it."""
    from gpumon import client
    found = client.scan()
    return pid in found or any(p in found for p in client.descendants(pid))


def _inject(pid: int) -> int:
    from gpumon.commands.args import progress
    from gpumon.inject import InjectError, InjectInterrupted, _uid_of, _user_name, inject
    owner = _uid_of(pid)
    if owner is not None and owner != os.geteuid():  # checked before anything is loaded
        who = _user_name(owner)
        _err(f"process {pid} belongs to {who}: an agent loaded into it runs as {who} and serves "
             f"them, not this view: `gpumon inject {pid}` loads it, then view it as that user "
             f"(sudo -u {who} gpumon attach {pid})")
        return 1
    try:
        with progress(f"loading the agent into process {pid}"):
            inject(pid)
    except InjectError as e:
        _err(str(e))
        return 1
    except InjectInterrupted as e:  # Ctrl-C: finished or undone, said in one line
        _err(str(e))
        return 130
    return 0


def _tui(alternative: str) -> Any:
    """The live view's module, or None after one line saying what is missing (the client may
    run where Textual is not installed, e.g. a GPU node with only torch)."""
    try:
        from gpumon.tui import attach_app
    except ImportError as e:
        missing = getattr(e, "name", None) or str(e)
        _err(f"the live view needs {missing} (pip install textual); meanwhile: {alternative}"
             " or --once")
        return None
    return attach_app


NOT_SERVING_SAID = ("waiting", "no_agent", "not_python", "unreachable")


def attach_json(target: Any) -> int:
    """One JSON object per line on stdout: every sample (history first, NVML's while there is
    no agent), the agents' events, and a state event at each change of a process's state
    (the exit event when one ends); until everything followed has ended, or Ctrl-C. The
    lines of states that explain missing figures (waiting for CUDA, no agent) also go to
    stderr."""
    from gpumon import client
    out = sys.stdout
    sub = target.subscribe()
    ranks: dict[str, Any] = {}
    hinted: set = set()
    try:
        target.start()
        if _nothing_to_show(target):
            return 1
        while (item := sub.get()) is not None:
            _, m = item
            key, kind = m.get("key"), m.get("type")
            if kind in ("hello", "state") and m.get("rank") is not None:
                ranks[key] = m["rank"]
            if kind == "hello":
                continue
            tag = {"pid": m.get("pid") or _pid_of(key), "rank": ranks.get(key)}
            if "host" in m:  # a process on another node (attach --hosts/--slurm)
                tag["host"] = m["host"]
            if kind == "state":
                line = {"type": "event", "kind": "state", **tag, "state": m["state"],
                        "line": m.get("line"), "t": m.get("since")}
                for f in ("status", "signal", "how"):
                    if f in m:
                        line[f] = m[f]
                if _say_on_stderr(key, m):
                    _err(m.get("line") or m["state"])
                    if m["state"] == "waiting" and key not in hinted:  # what that means, once
                        hinted.add(key)
                        _err(client.NO_CUDA_YET)
                rows = [line]
            elif kind == "history":
                rows = [{**s, **tag} for s in m.get("samples", ())]
            elif kind in ("sample", "event"):
                rows = [{**{k: v for k, v in m.items() if k != "key"}, **tag}]
            else:
                continue
            for r in rows:
                out.write(json.dumps(r, separators=(",", ":")) + "\n")
            out.flush()
    finally:  # Ctrl-C goes on to cli.main: 130 (gpumon/interrupt.py)
        target.close()
    # (attach --hosts/--slurm) no node could be followed: access denied, no such job
    return 1 if getattr(target, "ended_how", None) == "failed" else 0


def _say_on_stderr(key: Any, m: dict) -> bool:
    """A process's state that explains missing figures goes to stderr too; a node's
    (attach --hosts/--slurm: connecting, retrying) only where it is not retried."""
    if isinstance(key, str) and key.endswith(":"):
        return m["state"] == "unreachable" and "(not retried)" in (m.get("line") or "")
    return m["state"] in NOT_SERVING_SAID


def _pid_of(key: Any) -> int | None:
    return int(key) if isinstance(key, str) and key.isdigit() else None


def _nothing_to_show(target: Any) -> bool:
    """A process with no agent where NVML does not work either: one line, nothing to stream."""
    from gpumon import client
    ms = [m for m in target.members().values() if m.state not in (client.LAUNCHER,
                                                                   client.HELPER)]
    if not ms or any(m.state != client.NO_AGENT for m in ms):
        return False
    errors = [(m.hello or {}).get("nvml") for m in ms]
    if all(errors):
        from gpumon.client.target import no_figures_line
        _err(no_figures_line(ms[0].pid, errors[0]))
        return True
    return False


def attach_once(target: Any, wait_s: float) -> int:
    """The figures of each process now. Agents still waiting for the program's first CUDA
    call get up to wait_s seconds; what has no serving agent then is NVML's table, after the
    line that says why."""
    from gpumon import client
    sub = target.subscribe()
    try:
        target.start()
        if _nothing_to_show(target):
            return 1

        def settled(ms: dict) -> bool:
            return not any(m.state in (client.WAITING, client.UNREACHABLE) for m in ms.values())
        from gpumon.commands.args import progress
        waiting = [m.pid for m in target.members().values() if m.state == client.WAITING]
        with (progress(f"pid {waiting[0]}: up to {wait_s:g} s (--wait) for its first CUDA "
                       "call") if waiting and wait_s > 0
              else contextlib.nullcontext()):
            target.wait(settled, wait_s)
        shown = sorted((m for m in target.members().values()
                        if m.state not in (client.LAUNCHER, client.HELPER)),
                       key=lambda m: (m.rank is None, m.rank or 0, m.pid))
        # the pid named is not among them (a launcher, a shell, pid 1 of a container): why
        # other pids are shown, said once (`attach 1 --once` showed another job's figures)
        named = [m.line for m in target.members().values()
                 if m.state == client.LAUNCHER and m.pid == target.pid and shown]
        # the figures to wait for: an agent's history, NVML's reading where NVML answers (a
        # waiting agent's NVML that does not answer sends none: --wait 0 took 5 s for it)
        latest = _latest_samples(sub, {m.key for m in shown if m.state not in (
            client.EXITED, client.NO_PROCESS, client.NOT_PYTHON)  # (no sample comes of it)
            and (m.serving or not (m.hello or {}).get("nvml"))})
        blocks, failed = [], []
        for m in shown:
            sample = latest.get(m.key)
            if m.state == client.UNREACHABLE:  # an agent is there but its answer is unusable
                failed.append(m.line.removesuffix("; retrying"))
            elif m.state in (client.EXITED, client.NO_PROCESS):  # ended while --once waited: no figures of it now
                failed.append(m.line)
            elif m.state == client.NOT_PYTHON:  # (NVML is not read for it: no block of figures)
                failed.append(m.line)
            elif m.serving and m.hello:
                blocks.append(format_once(m.hello, sample, _state(m.pid)))
            else:
                blocks.append(format_nvml_once(m, sample))
    finally:
        target.close()
    for line in named:
        print(f"gpumon: {line}", file=sys.stderr)
    sys.stdout.write("\n\n".join(blocks) + ("\n" if blocks else ""))
    for line in failed:
        print(f"gpumon: {line}", file=sys.stderr)
    return 1 if failed else 0


def _latest_samples(sub: Any, keys: set, timeout: float = 5.0) -> dict:
    """The newest sample of each key now: everything queued is read, then what is missing
    (a history not complete yet) is waited for."""
    last: dict = {}
    complete: set = set()

    def take(m: dict) -> None:
        key = m.get("key")
        if m["type"] == "history":
            if m.get("samples"):
                last[key] = m["samples"][-1]
            if m.get("last"):
                complete.add(key)
        elif m["type"] == "sample":
            last[key] = m
            complete.add(key)
        elif m["type"] == "state" and m["state"] in ("exited", "no_process"):
            complete.add(key)

    end = time.monotonic() + timeout
    while True:
        for _, m in sub.drain():
            take(m)
        left = end - time.monotonic()
        if keys <= complete or left <= 0 or sub.ended:
            return last
        try:
            item = sub.get(timeout=min(left, 0.2))
        except TimeoutError:
            continue
        if item is not None:
            take(item[1])


def format_nvml_once(m: Any, sample: dict | None) -> str:
    """A process without a serving agent: why (its state line), then what NVML says."""
    from gpumon import client
    h = m.hello or {}
    lines = [m.line] + (_wrap("  " + client.NO_CUDA_YET) if m.state == client.WAITING else [])
    lines.append(f"pid {m.pid} (NVML only)")
    if h.get("nvml"):
        lines.append(f"  NVML: {h['nvml']}")
        return "\n".join(lines)
    if sample is None:  # no reading came: nothing is known of its memory, not "none"
        lines.append("  NVML: no reading of this process yet")
        return "\n".join(lines)
    gpus = {g["index"]: g for g in h.get("gpus") or []}
    devs = sample.get("devices") or []
    if not devs:
        lines.append("  no GPU memory in use by this process")
    for d in devs:
        info = gpus.get(d["index"], {})
        lines.append(f"cuda:{d['index']}  {info.get('name')}  process {human(d['proc_used'])}"
                     f"  device used {human(d['nvml_used'])} of {human(d['nvml_total'])}")
    mine = {d["index"] for d in devs}
    for idx, used, total in (sample or {}).get("gpus") or []:
        if idx not in mine:
            lines.append(f"cuda:{idx}  {gpus.get(idx, {}).get('name')}  device used "
                         f"{human(used)} of {human(total)} (other processes)")
    return "\n".join(lines)


# -- demo ------------------------------------------------------------------------------------
def _wait_for(fn: Any, timeout: float, interval: float = 0.1) -> Any:
    end = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() >= end:
            return v
        time.sleep(interval)


def cmd_demo(args: argparse.Namespace) -> int:
    from gpumon import client
    from gpumon.agent.core import socket_dir
    interactive = not args.once
    if interactive and not sys.stdout.isatty():
        _err("stdout is not a terminal; the live view needs one (use `ssh -t`, or `srun --pty`"
             " under Slurm), or use `gpumon demo --once`")
        return 2
    tui = _tui("gpumon demo --once") if interactive else None
    if interactive and tui is None:
        return 1
    log_path = socket_dir(create=True) / f"demo-{os.getpid()}.log"
    cmd = [sys.executable, "-m", "gpumon.demo", "--parent", str(os.getpid())] \
        + (["--cpu"] if args.cpu else [])
    env = dict(os.environ)
    env.pop("GPUMON", None)  # the demo starts its own agent; no bootstrap needed
    with open(log_path, "wb") as log:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                 start_new_session=True)
    try:
        # its agent is there (waiting while the demo builds its model), or the child died
        from gpumon.commands.args import progress
        with progress("starting the demo's training run (Python and torch load first)"):
            _wait_for(lambda: child.poll() is not None or child.pid in client.scan(), 120.0)
        if child.poll() is not None or child.pid not in client.scan():
            tail = ""
            try:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-1]
            except (OSError, IndexError):
                pass
            _err(f"the demo workload did not start{': ' + tail if tail else ''} (log: {log_path})")
            return 1
        target = client.LocalTarget(child.pid, child=child)
        if args.once:
            return attach_once(target, 120.0)
        return int(tui.run_attach(target, fps=args.fps, demo=True,
                                  no_color=args.no_color or bool(os.environ.get("NO_COLOR")))
                   or 0)
    except KeyboardInterrupt as e:  # the workload is stopped below, before the line is said
        from gpumon.interrupt import Interrupted
        said = getattr(e, "outcome", None)
        raise Interrupted((said + "; " if said else "") + "the demo's workload was stopped") \
            from None
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        try:
            log_path.unlink()
        except OSError:
            pass
