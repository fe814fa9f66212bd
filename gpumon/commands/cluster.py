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
    from gpumon.cluster.export import DEFAULT_INTERVAL_S, DEFAULT_PORT
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
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "relay", help="gpumon's protocol over stdin/stdout (the node end of attach --hosts)",
        description="Follow every gpumon agent of this user on this node and speak gpumon's "
        "protocol over stdin/stdout, both ways: what `gpumon attach --hosts` and `--slurm` run "
        "on each node (through ssh or srun). Not meant to be run by hand.")
    p.add_argument("--host", help="the name this node is shown under (default: hostname)")
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
def cmd_export(args: argparse.Namespace) -> int:
    if not (args.interval > 0 and args.interval < 1e6):
        _err("--interval must be a positive number of seconds")
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
    ex = Exporter(host=args.host, pid_label=args.pid_label, interval=args.interval)
    try:
        ex.start()
        if args.once:
            import time
            time.sleep(0.3)  # histories of the agents just connected
            sys.stdout.write(ex.text().decode())
            return 0
        _on_sigterm(ex.stop)
        if args.textfile:
            try:
                path = ex.write_textfile(args.textfile)
            except OSError as e:
                _err(f"cannot write {args.textfile}: {e.strerror or e}")
                return 1
            sys.stderr.write(f"gpumon export: writing {path} every {args.interval:g} s\n")
            sys.stderr.flush()
            try:
                ex.run(textfile=args.textfile)
            except OSError as e:
                _err(f"cannot write {args.textfile}: {e.strerror or e}")
                return 1
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
    except KeyboardInterrupt:
        return 0
    finally:
        ex.close()


# -- relay -------------------------------------------------------------------------------------
def cmd_relay(args: argparse.Namespace) -> int:
    from gpumon.cluster.relay import run_relay
    return run_relay(sys.stdin.buffer, sys.stdout.buffer, host=args.host)
