"""`gpumon modules PID`: measure the next training step(s) of a running process module by
module (parameters, gradients, optimizer state, activations live at the peak, transients, the
module running at the peak), then remove every hook. The agent does the work
(gpumon/agent/modules.py); gpumon/model/modules.py renders it.

    gpumon modules PID                  one step, the tree to depth 2 and the top 10
    gpumon modules PID --steps 3 --depth 4 --top 20
    gpumon modules PID --json           the agent's result as JSON
"""
from __future__ import annotations

import argparse
import json
import sys

from gpumon.commands.args import no_agent_line, pid_arg, progress, wait_while_only_waiting

MAX_STEPS = 16


def register(sub) -> None:
    p = sub.add_parser(
        "modules", help="measure the next step(s) of a running job per module",
        description="Measure the next training step(s) of a running process per module "
                    "(its gpumon agent does it; every hook is removed afterwards): "
                    "parameters, gradients, optimizer state, the activations live at the "
                    "step's peak, forward/backward transients and the module running at "
                    "the peak. See docs/modules.md.")
    p.add_argument("pid", type=pid_arg, help="the training process (or its launcher)")
    p.add_argument("--steps", type=int, default=1, metavar="N",
                   help=f"measure N steps (1-{MAX_STEPS}, default 1); the peak is the "
                        "highest of them")
    p.add_argument("--depth", type=int, default=2, metavar="D",
                   help="levels of the module tree to show (default 2; 0: the root only)")
    p.add_argument("--top", type=int, default=10, metavar="K",
                   help="the K modules holding the most at the peak (default 10)")
    p.add_argument("--wait", type=float, default=300.0, metavar="S",
                   help="give up after S seconds (default 300; the steps must run by then)")
    p.add_argument("--rank", type=int, default=None,
                   help="with a launcher pid: only the agent of this rank")
    p.add_argument("--json", action="store_true", help="print the agent's result as JSON")
    p.set_defaults(func=run)


def _err(msg: str, rc: int = 1) -> int:
    print(f"gpumon: {msg}", file=sys.stderr)
    return rc


def run(args: argparse.Namespace) -> int:
    from gpumon import client
    from gpumon.model.modules import ModuleReport, render
    if not 1 <= args.steps <= MAX_STEPS:
        return _err(f"--steps must be 1-{MAX_STEPS}", 2)
    if args.depth < 0 or args.top < 0:
        return _err("--depth and --top must be 0 or more", 2)
    if not 0 < args.wait <= 600:  # (NaN fails too)
        return _err("--wait must be more than 0 and at most 600 seconds", 2)
    try:
        client.check_pid(args.pid)
    except client.AttachError as e:
        return _err(str(e))
    target = client.LocalTarget(args.pid, nvml_s=None)
    try:
        target.start()
        wait_while_only_waiting(
            target, "pid {pids}: waiting for the program's first CUDA call; the measurement "
            f"starts once it serves (at most --wait {args.wait:g} s; Ctrl-C: cancel)",
            "pid {pids}: waiting for its first CUDA call", args.wait)
        members = sorted((m for m in target.members().values() if m.serving),
                         key=lambda m: (m.rank is None, m.rank, m.pid))
        if args.rank is not None:
            members = [m for m in members if m.rank == args.rank]
        if not members:
            if args.rank is not None and any(m.serving for m in target.members().values()):
                return _err(f"no agent of rank {args.rank} in process {args.pid} or its "
                            "children")
            return _err(no_agent_line(target, args.pid))
        m = members[0]
        note = f" (rank {m.rank}; --rank picks another)" if len(members) > 1 else ""
        try:
            with progress(f"measuring {args.steps} step(s) of pid {m.pid}{note}"):
                res = target.request(m.key, "modules_measure",
                                     {"steps": args.steps, "wait": args.wait},
                                     timeout=args.wait + 10)
        except client.AgentError as e:
            return _err(str(e))
        if res.get("state") and "ok" not in res:
            try:
                target.request(m.key, "modules_cancel", {}, timeout=5)
            except client.AgentError:
                pass
            if res.get("state") in ("waiting", "baseline"):
                return _err(f"no training step came within {args.wait:g} s (a step ends with "
                            "optimizer.step(); the measurement starts after two of them): "
                            "cancelled")
            return _err(f"the program ran {res.get('steps_done', 0)} of {args.steps} "
                        f"measured step(s) in {args.wait:g} s: cancelled")
        if args.json:
            print(json.dumps(res, indent=1))
            return 0 if res.get("ok") else 1
        try:
            report = ModuleReport.from_result(res)
        except ValueError as e:
            return _err(str(e))
        if note:
            print(f"pid {m.pid}{note}", file=sys.stderr)
        print(render(report, depth=args.depth, top=args.top))
        return 0
    finally:
        target.close()
