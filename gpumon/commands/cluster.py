"""`gpumon export` (Prometheus metrics of this node's agents) and `gpumon relay` (the node end
of `gpumon attach --hosts/--slurm`: gpumon's protocol over stdin/stdout). The fan-in side
(`attach --hosts/--slurm`) is ``attach_cluster`` here, called from `gpumon attach`."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    from gpumon.cluster.export import DEFAULT_INTERVAL_S, DEFAULT_PORT, STALE_S
    p = sub.add_parser(
        "export", help="serve this node's agents as Prometheus metrics",
        description="Every gpumon agent of this user on this node as Prometheus metrics: "
        "/metrics on a port, or --textfile DIR for node_exporter's textfile collector "
        "(DIR/gpumon.prom, written atomically). Agents that start or end are added and "
        "removed by themselves. See docs/cluster.md.")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port of /metrics (default {DEFAULT_PORT})")
    p.add_argument("--address", default="0.0.0.0",
                   help="address to listen on (default 0.0.0.0; 127.0.0.1: this node only)")
    p.add_argument("--textfile", metavar="DIR",
                   help="write DIR/gpumon.prom every --interval instead of serving a port")
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                   help=f"how often the textfile is written (default {DEFAULT_INTERVAL_S:g})")
    p.add_argument("--once", action="store_true",
                   help="print the metrics once on stdout and exit")
    p.add_argument("--pid-label", action="store_true",
                   help="add each process's pid as a label (more series: off by default)")
    p.add_argument("--host", help="the host label (default: this machine's hostname)")
    p.add_argument("--stale-after", type=float, default=STALE_S, metavar="SECONDS",
                   help="leave out a process whose last sample is older than this (a stopped "
                   f"or hung process; default {STALE_S:g}); gpumon_stale_agents counts them")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "relay", help="gpumon's protocol over stdin/stdout (the node end of attach --hosts)",
        description="Follow every gpumon agent of this user on this node and speak gpumon's "
        "protocol over stdin/stdout, both ways: what `gpumon attach --hosts` and `--slurm` run "
        "on each node (through ssh or srun). Not meant to be run by hand.")
    p.add_argument("--host", help="the name this node is shown under (default: hostname)")
    p.add_argument("--job", metavar="JOBID,...",
                   help="follow only the processes of these jobs (their SLURM_JOB_ID, an "
                   "array's ID_TASK or ID, or their pod)")
    p.set_defaults(func=cmd_relay)


def _err(msg: str) -> None:
    sys.stderr.write(f"gpumon: {msg}\n")
    sys.stderr.flush()


def _on_sigterm(fn: Any) -> None:
    try:
        signal.signal(signal.SIGTERM, lambda *_: fn())
    except ValueError:  # not the main thread (tests)
        pass


# -- export ------------------------------------------------------------------------------------
def _file_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at path (a link itself, not followed), or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _remove_textfile(written: str, earlier: tuple | None) -> tuple[bool, str] | None:
    """Undo this run's textfile (left behind, node_exporter would serve its last figures as
    live ones): (removed, what happened), or None where this run wrote none (an earlier run's
    file, told by its inode, is not this run's to remove)."""
    if _file_id(written) in (None, earlier):
        return None
    try:
        os.unlink(written)
    except OSError:
        return False, f"{written} is left with the last figures"
    return True, f"removed {written}"


def cmd_export(args: argparse.Namespace) -> int:
    if not (args.interval > 0 and args.interval < 1e6):
        _err("--interval must be a positive number of seconds")
        return 2
    if not (args.stale_after > 0 and args.stale_after < 1e6):
        _err("--stale-after must be a positive number of seconds")
        return 2
    if not 0 <= args.port <= 65535:
        _err("--port must be from 0 to 65535")
        return 2
    if args.textfile:
        d = args.textfile
        if not os.path.isdir(d):
            _err(f"--textfile: no directory {d}")
            return 1
        if not os.access(d, os.W_OK | os.X_OK):
            _err(f"--textfile: cannot write in {d}")
            return 1
    try:
        from gpumon.cluster.export import Exporter, serve
    except ImportError as e:
        _err(f"gpumon export needs {getattr(e, 'name', None) or e} (pip install "
             "prometheus_client)")
        return 1
    ex = Exporter(host=args.host, pid_label=args.pid_label, interval=args.interval,
                  stale_s=args.stale_after)
    try:
        ex.start()
        if args.once:
            ex.settle()  # the histories of the agents just connected
            sys.stdout.write(ex.text().decode())
            return 0
        _on_sigterm(ex.stop)
        if args.textfile:
            # From the first write on, Ctrl-C removes the file (one handler: a Ctrl-C just
            # after that write left it behind, seen under load). The file is in place from its
            # rename on, before the write returns (the folder's fsync): whether it is this
            # run's is told by its inode, not by the write having returned.
            from gpumon.cluster.export import TEXTFILE_NAME
            written = os.path.join(args.textfile, TEXTFILE_NAME)
            earlier = _file_id(written)  # an earlier run's file is not this run's to remove
            try:
                ex.write_textfile(args.textfile)
                sys.stderr.write(f"gpumon export: writing {written} every {args.interval:g} s\n")
                sys.stderr.flush()
                ex.run(textfile=args.textfile)
            except OSError as e:
                _err(f"cannot write {args.textfile}: {e.strerror or e}")
                return 1
            except KeyboardInterrupt:
                undone = _remove_textfile(written, earlier)
                if undone is None:
                    raise  # nothing written yet: nothing to undo
                from gpumon.interrupt import Interrupted
                raise Interrupted(undone[1]) from None
            # stopped (SIGTERM: a service stop): the file goes too
            undone = _remove_textfile(written, earlier)
            if undone is not None:
                sys.stderr.write(f"gpumon export: stopped; {undone[1]}\n")
                return 0 if undone[0] else 1
            return 0
        try:
            serve(ex, args.address, args.port)
        except OSError as e:
            _err(f"cannot listen on {args.address}:{args.port}: {e.strerror or e}")
            return 1
        sys.stderr.write(f"gpumon export: serving http://{args.address}:{args.port}/metrics\n")
        sys.stderr.flush()
        ex.run()
        return 0
    finally:
        ex.close()


# -- relay -------------------------------------------------------------------------------------
def cmd_relay(args: argparse.Namespace) -> int:
    from gpumon.cluster.relay import run_relay
    jobs = _jobs(args.job) if args.job else None
    if args.job and jobs is None:
        _err(f"--job {args.job!r}: a comma-separated list of job ids")
        return 2
    return run_relay(sys.stdin.buffer, sys.stdout.buffer, host=args.host, jobs=jobs)


def _jobs(spec: str) -> list[str] | None:
    """Job ids as given (123, 123_4 for an array element, a pod name): letters, digits, _.-"""
    jobs = [j.strip() for j in spec.split(",")]
    if not jobs or any(not j or not all(c.isalnum() or c in "_.-" for c in j)
                       or j.startswith("-") for j in jobs):
        return None
    return jobs


# -- attach --hosts / --slurm --------------------------------------------------------------------
def add_attach_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("every rank of every node (see docs/cluster.md)")
    g.add_argument("--hosts", metavar="HOST,...",
                   help="attach to every gpumon agent on these hosts, over ssh (your own "
                   "ssh config and keys: ProxyJump, user@host, aliases); each runs "
                   "`gpumon relay`")
    g.add_argument("--slurm", metavar="JOBID",
                   help="attach to every node of this running Slurm job, through "
                   "`srun --jobid JOBID --overlap` (one task per node)")
    g.add_argument("--job", metavar="JOBID",
                   help="with --hosts: only the processes of this job (their SLURM_JOB_ID, or "
                   "their pod), not every gpumon agent of yours there; the view ends when "
                   "every rank of it has ended. --slurm implies it")
    g.add_argument("--ssh", default=os.environ.get("GPUMON_SSH", "ssh"), metavar="CMD",
                   help="the ssh command (default: ssh, or $GPUMON_SSH), e.g. "
                   "\"ssh -F ~/.ssh/cluster_config\"")
    g.add_argument("--remote-gpumon", default=os.environ.get("GPUMON_REMOTE", "gpumon"),
                   metavar="CMD", help="how to run gpumon on the nodes (default: gpumon, or "
                   "$GPUMON_REMOTE), e.g. \"~/venv/bin/gpumon\" or \"python -m gpumon\"")


def _hosts(spec: str) -> list[str] | None:
    hosts = [h.strip() for h in spec.split(",")]
    if not hosts or any(not h or h.startswith("-") or any(c.isspace() for c in h)
                        for h in hosts):
        return None
    return hosts


def make_cluster_target(args: argparse.Namespace) -> Any:
    """The ClusterTarget of --hosts or --slurm; AgentError (one line) or ValueError (usage)."""
    from gpumon.client import remote
    if args.hosts and args.slurm:
        raise ValueError("--hosts and --slurm: one or the other")
    job_opt = getattr(args, "job", None)
    jobs = None
    if job_opt is not None:
        jobs = _jobs(job_opt)
        if jobs is None or len(jobs) != 1:
            raise ValueError(f"--job {job_opt!r}: one job id")
    if args.hosts:
        hosts = _hosts(args.hosts)
        if hosts is None:
            raise ValueError(f"--hosts {args.hosts!r}: a comma-separated list of hosts")
        if len(set(hosts)) != len(hosts):
            raise ValueError("--hosts: a host is named twice")
        nodes = [remote.ssh_node(h, args.ssh, args.remote_gpumon, jobs) for h in hosts]
        return remote.ClusterTarget(nodes)
    job = str(args.slurm).strip()
    if not job or not all(c.isalnum() or c in "_." for c in job):
        raise ValueError(f"--slurm {args.slurm!r}: a Slurm job id")
    if jobs and jobs != [job]:
        raise ValueError(f"--slurm {job} follows job {job}: --job names no other")
    on_node, _ = remote.slurm_job(job)
    # srun runs in a job that is there (an array's element); the relay follows what the
    # user named: a job, an array (its elements say SLURM_ARRAY_JOB_ID) or ARRAYID_TASK
    nodes = [remote.srun_node(jid, n, remote=args.remote_gpumon, jobs=[job])
             for n, jid in on_node.items()]
    return remote.ClusterTarget(nodes, job_watch=remote.slurm_watch(job))


def attach_cluster(args: argparse.Namespace) -> int:
    from gpumon.client import AgentError
    from gpumon.commands import core
    if args.pid is not None:
        _err("with --hosts or --slurm, name no PID: every agent of every node is followed")
        return 2
    if args.inject or args.estimate:
        _err("--inject and --estimate work on a local PID, not with --hosts/--slurm")
        return 2
    if args.wait is not None and not args.wait >= 0:
        _err("--wait must be 0 or more seconds")
        return 2
    interactive = not (args.json or args.once)
    if interactive and not sys.stdout.isatty():
        what = f"--hosts {args.hosts}" if args.hosts else f"--slurm {args.slurm}"
        _err(f"stdout is not a terminal; the live view needs one (use `ssh -t`, or `srun "
             f"--pty`), or use `gpumon attach {what} --json` / `--once`")
        return 2
    tui = core._tui("gpumon attach --hosts ... --json") if interactive else None
    if interactive and tui is None:
        return 1
    try:
        target = make_cluster_target(args)
    except ValueError as e:
        _err(str(e))
        return 2
    except AgentError as e:
        _err(str(e))
        return 1
    if args.json:
        return core.attach_json(target)
    if args.once:
        return once_cluster(target, core.DEFAULT_WAIT_S if args.wait is None else args.wait)
    no_color = args.no_color or bool(os.environ.get("NO_COLOR"))
    return int(tui.run_attach(target, fps=args.fps, no_color=no_color) or 0)


def once_cluster(target: Any, wait_s: float, out: Any = None) -> int:
    """Every rank of every node, one line each (host, rank, pid, device, figures), rank order,
    then the imbalance across all of them; nodes that cannot be reached: one line each on
    stderr, status 1."""
    import re
    import time
    from gpumon import client
    from gpumon.commands.core import human
    from gpumon.model.process import ProcessModel, imbalance
    out = out or sys.stdout
    sub = target.subscribe()
    try:
        target.start()

        def settled(ms: dict) -> bool:
            return not any(m.state in (client.WAITING, client.CONNECTING)
                           for m in ms.values())
        target.wait(settled, wait_s)
        models: dict[str, ProcessModel] = {}
        end = time.monotonic() + 5.0
        while True:  # every serving member's history (its latest figures)
            for recv_t, m in sub.drain():
                key = m.get("key")
                if m.get("type") in ("hello", "history", "sample", "event"):
                    models.setdefault(key, ProcessModel(key)).apply(m, recv_t)
            members = target.members()
            want = {k for k, mm in members.items() if mm.serving}
            have = {k for k, p in models.items() if p.history_done}
            if want <= have or time.monotonic() > end:
                break
            time.sleep(0.05)
        members = target.members()
    finally:
        target.close()
    rows, failed = [], []
    for key, m in sorted(members.items()):
        if m.state == client.UNREACHABLE:  # --once retries nothing: no "; reconnecting in 1 s"
            failed.append(re.sub(r"(; reconnecting( in [0-9.]+ s| now)?| \(not retried\))$", "",
                                 m.line or ""))
        elif m.state == client.CONNECTING:
            failed.append(f"{m.line.split(': connecting')[0]}: no answer within {wait_s:g} s")
    shown = [models[k] for k, m in members.items() if m.serving and k in models]
    shown.sort(key=lambda p: (p.rank if p.rank is not None else 1 << 30, p.host or "",
                              p.pid or 0))
    header = (f"{'HOST':<16} {'RANK':<6} {'PID':>8} {'DEV':<6} {'ALLOCATED':>11} "
              f"{'RESERVED':>11} {'PEAK ALLOC':>11} {'NON-PYTORCH':>11} {'RETRIES':>7}")
    devs = []
    for p in shown:
        for idx, d in sorted(p.devices.items()):
            label = f"rank {p.rank}" if p.rank is not None else f"pid {p.pid}"
            devs.append((f"{label} on {p.host} cuda:{idx}", d))
            rank = "-" if p.rank is None else (f"{p.rank}/{p.world_size}"
                                              if p.world_size is not None else str(p.rank))
            rows.append(f"{(p.host or '?')[:16]:<16} {rank:<6} {p.pid or 0:>8} "
                        f"{'cuda:' + str(idx):<6} {human(d.get('allocated')):>11} "
                        f"{human(d.get('reserved')):>11} {human(d.peak_allocated):>11} "
                        f"{human(d.non_pytorch()):>11} {str(d.get('alloc_retries')):>7}")
    if rows:
        out.write(header + "\n" + "\n".join(rows) + "\n")
        imb = imbalance(devs)
        if imb is not None and imb.low > 0:
            out.write(f"imbalance {imb.spread:+.0%}: peak allocated {imb.high_label} "
                      f"{human(imb.high)} vs {imb.low_label} {human(imb.low)}\n")
    else:
        out.write("no gpumon agents on any node" + (" that answered" if failed else "") + "\n")
    for line in failed:
        _err(line)
    return 1 if failed else 0
