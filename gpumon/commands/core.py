"""`gpumon run`, `gpumon ls`, `gpumon attach`, `gpumon demo`.

Heavy imports (the TUI, psutil) happen inside the commands, so `gpumon --help` stays fast.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

TTY_HINT = ("gpumon: stdout is not a terminal; the live view needs one (use `ssh -t`, or "
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
                       "(torchrun, a shell script, gpumon run). Without an agent: NVML figures only.")
    p.add_argument("pid", type=int)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help="one JSON object per sample on stdout")
    g.add_argument("--once", action="store_true", help="print the current figures and exit")
    p.add_argument("--fps", type=float, default=4.0, help="screen redraws per second (default 4)")
    p.add_argument("--no-color", action="store_true", help="monochrome (also: NO_COLOR=1)")
    p.add_argument("--estimate", metavar="EST.json",
                   help="show this `gpumon estimate ... --json` output beside the measured "
                        "breakdown (key b), term by term with the error in %%")
    p.add_argument("--inject", action="store_true",
                   help="load the agent into a process started without gpumon")
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
    try:
        # exec: the command keeps this pid, its signals and its exit status, exactly.
        os.execvpe(cmd[0], cmd, env)
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


def _sub(a: Any, b: Any) -> Any:
    return None if a is None or b is None else a - b


def format_once(hello: dict, sample: dict | None, state: str = "running") -> str:
    lines = [f"pid {hello.get('pid')}  rank {_rank(hello)}  {state}  up "
             f"{duration(time.time() - hello['start_time']) if hello.get('start_time') else 'n/a'}"
             f"  {_command(hello)[:60]}"]
    al = hello.get("allocator") or {}
    src = hello.get("source")
    extra = f" ({hello['demo']})" if hello.get("demo") else ""
    lines.append(f"source {src}{extra}  torch {hello.get('torch') or 'n/a'}  allocator "
                 f"{al.get('backend') or 'n/a'}  expandable_segments "
                 f"{al.get('expandable_segments')}  {hello.get('rate_hz')} Hz")
    if hello.get("nvml") and src != "simulated":
        lines.append(f"NVML: {hello['nvml']}")
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
def _hello_of(addr: Any, timeout: float = 1.5) -> tuple[dict | None, str | None]:
    from gpumon import client
    try:
        c = client.AgentConnection.connect(addr, timeout=timeout)
    except client.AttachError as e:
        return None, str(e)
    h = c.hello
    c.close()
    return h, None


def _state(pid: int) -> str:
    try:
        import psutil
        return psutil.Process(pid).status()
    except Exception:
        return "gone"


def cmd_ls(args: argparse.Namespace) -> int:
    from gpumon import client
    rows = []
    for addr in client.discover():
        h, err = _hello_of(addr)
        if h is None:
            rows.append({"pid": addr.pid, "rank": None, "local_rank": None, "world_size": None,
                         "devices": [], "command": None, "state": "unreachable",
                         "age": None, "source": None, "socket": str(addr.path), "error": err})
            continue
        rows.append({"pid": h["pid"], "rank": h.get("rank"), "local_rank": h.get("local_rank"),
                     "world_size": h.get("world_size"),
                     "devices": [d.get("index") for d in h.get("devices") or []],
                     "command": _command(h), "state": _state(h["pid"]),
                     "age": time.time() - h["start_time"] if h.get("start_time") else None,
                     "source": h.get("source"), "socket": str(addr.path), "error": None})
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return 0
    if not rows:
        sys.stdout.write(f"no gpumon agents (looked in {client.socket_dir()})\n")
        return 0
    sys.stdout.write(f"{'PID':>8}  {'RANK':<6} {'DEVICES':<10} {'STATE':<12} {'AGE':>8}  COMMAND\n")
    for r in rows:
        rank = "-" if r["rank"] is None else (
            f"{r['rank']}/{r['world_size']}" if r["world_size"] is not None else str(r["rank"]))
        devs = ",".join(f"{i}" for i in r["devices"]) or "-"
        if r["source"] == "simulated":
            devs += " (sim)"
        cmd = r["command"] or r["error"] or ""
        sys.stdout.write(f"{r['pid']:>8}  {rank:<6} {devs:<10} {r['state']:<12} "
                         f"{duration(r['age']):>8}  {cmd[:100]}\n")
    return 0


# -- attach ----------------------------------------------------------------------------------
def cmd_attach(args: argparse.Namespace) -> int:
    from gpumon import client
    pid = args.pid
    try:
        client.check_pid(pid)
    except client.AttachError as e:
        _err(str(e))
        return 1
    estimate = getattr(args, "estimate", None)
    if estimate and not os.path.isfile(estimate):
        _err(f"no estimate file {estimate} (write one with `gpumon estimate ... --json > FILE`)")
        return 1
    targets = client.discover(pid)
    if not targets and args.inject:
        try:
            from gpumon.inject import inject
        except ImportError:
            _err("--inject is not available in this gpumon build")
            return 1
        try:
            inject(pid)
        except Exception as e:
            _err(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            return 1
        targets = _wait_for(lambda: client.discover(pid), 5.0) or []
        if not targets:
            _err(f"the agent was injected into {pid} but no socket appeared")
            return 1
    if args.json:
        return attach_json(targets, pid)
    if args.once:
        return attach_once(targets, pid)
    if not sys.stdout.isatty():
        _err(TTY_HINT.format(pid=pid))
        return 2
    no_color = args.no_color or bool(os.environ.get("NO_COLOR"))
    tui = _tui(f"gpumon attach {pid} --json")  # before anything is asked or started
    if tui is None:
        return 1
    if not targets:
        from gpumon.commands.inject import offer_inject  # asks on a terminal; [] if declined
        targets = offer_inject(pid)
    if not targets:
        _err(f"no gpumon agent in process {pid}: NVML figures only. For the full view start it "
             f"with `gpumon run -- CMD`, GPUMON=1, or `gpumon attach {pid} --inject`")
        return int(tui.run_attach_nvml(pid, fps=args.fps, no_color=no_color) or 0)
    # A launcher (torchrun, a job script): ranks that start later join the view as they appear.
    launcher = pid if all(t.pid != pid for t in targets) else None
    return int(tui.run_attach(targets, fps=args.fps, no_color=no_color, estimate=estimate,
                              launcher_pid=launcher) or 0)


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


def _wait_for(fn: Any, timeout: float, interval: float = 0.1) -> Any:
    end = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() >= end:
            return v
        time.sleep(interval)


def _no_agent_hint(pid: int) -> str:
    return (f"no gpumon agent in process {pid} or its children (NVML figures only); for the "
            f"full view: gpumon run -- CMD, GPUMON=1, or gpumon attach {pid} --inject")


def attach_json(targets: list, pid: int) -> int:
    """One JSON object per line on stdout: every sample (history first), plus events."""
    from gpumon import client
    out = sys.stdout
    if not targets:
        reader = client.NvmlReader(pid)
        if reader.error:
            _err(f"no gpumon agent in process {pid}, and {reader.error}")
            return 1
        _err(_no_agent_hint(pid))
        seq = 0
        while client._alive(pid):
            s = reader.read()
            s["seq"] = seq
            seq += 1
            out.write(json.dumps(s) + "\n")
            out.flush()
            time.sleep(1.0)
        return 0
    conns = []
    for t in targets:
        try:
            conns.append(client.AgentConnection.connect(t))
        except client.AttachError as e:
            _err(str(e))
    if not conns:
        return 1
    q: queue.Queue = queue.Queue()

    def pump(c: Any) -> None:
        tag = {"pid": c.hello.get("pid"), "rank": c.hello.get("rank")}
        try:
            while True:
                m = c.recv()
                if m is None:
                    break
                if m["type"] == "history":
                    for s in m.get("samples", ()):
                        q.put({**s, **tag})
                elif m["type"] in ("sample", "event"):
                    q.put({**m, **tag})
        finally:
            q.put(None)

    for c in conns:
        threading.Thread(target=pump, args=(c,), daemon=True).start()
    live = len(conns)
    try:
        while live:
            m = q.get()
            if m is None:
                live -= 1
                continue
            out.write(json.dumps(m, separators=(",", ":")) + "\n")
            out.flush()
    except KeyboardInterrupt:
        pass
    finally:
        for c in conns:
            c.close()
    return 0


def _latest_sample(c: Any, timeout: float = 5.0) -> dict | None:
    """The newest sample: the end of the history, or the first live one if history is empty."""
    last = None
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return last
        try:
            m = c.recv(timeout=left)
        except TimeoutError:
            return last
        if m is None:
            return last
        if m["type"] == "history":
            if m.get("samples"):
                last = m["samples"][-1]
            if m.get("last") and last is not None:
                return last
        elif m["type"] == "sample":
            return m


def attach_once(targets: list, pid: int) -> int:
    from gpumon import client
    if not targets:
        reader = client.NvmlReader(pid)
        if reader.error:
            _err(f"no gpumon agent in process {pid}, and {reader.error}")
            return 1
        _err(_no_agent_hint(pid))
        s = reader.read()
        names = {d["index"]: d for d in reader.devices()}
        sys.stdout.write(f"pid {pid} (NVML only)\n")
        if not s["devices"]:
            sys.stdout.write("  no GPU memory in use by this process\n")
        for d in s["devices"]:
            info = names.get(d["index"], {})
            sys.stdout.write(f"cuda:{d['index']}  {info.get('name')}  process {human(d['proc_used'])}"
                             f"  device used {human(d['nvml_used'])} of {human(d['nvml_total'])}\n")
        return 0
    rc = 0
    blocks = []
    for t in targets:
        try:
            c = client.AgentConnection.connect(t)
        except client.AttachError as e:
            _err(str(e))
            rc = 1
            continue
        try:
            blocks.append(format_once(c.hello, _latest_sample(c), _state(c.hello.get("pid"))))
        finally:
            c.close()
    sys.stdout.write("\n\n".join(blocks) + ("\n" if blocks else ""))
    return rc


# -- demo ------------------------------------------------------------------------------------
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
    cmd = [sys.executable, "-m", "gpumon.demo"] + (["--cpu"] if args.cpu else [])
    env = dict(os.environ)
    env.pop("GPUMON", None)  # the demo starts its own agent; no bootstrap needed
    with open(log_path, "wb") as log:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                 start_new_session=True)
    try:
        targets = _wait_for(lambda: client.discover(child.pid) if child.poll() is None else [1],
                            120.0)
        if child.poll() is not None or not targets:
            tail = ""
            try:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-1]
            except (OSError, IndexError):
                pass
            _err(f"the demo workload did not start{': ' + tail if tail else ''} (log: {log_path})")
            return 1
        if args.once:
            time.sleep(0.5)  # a few samples
            return attach_once(targets, child.pid)
        return int(tui.run_attach(targets, fps=args.fps,
                              no_color=args.no_color or bool(os.environ.get("NO_COLOR"))) or 0)
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
