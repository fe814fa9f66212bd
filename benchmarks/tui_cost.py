"""CPU of the live view attached to 1 and 8 simulated agents at 10 Hz, and sample-to-screen delay.

    python benchmarks/tui_cost.py [--seconds 60] [--agents 1 8] [--fps 4]

Each agent is a real process (GPUMON_SOURCE=simulated, gpumon.start(rate_hz=10)) behind a real
socket; the TUI runs headless in this process. CPU = this process's user+sys time / wall time
(100% = one core). Delay = screen time of a frame minus the time the newest drawn sample was
taken (so it includes up to one frame period of waiting). Results go to benchmarks/tui_cost.md.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

AGENT = ("import os, time, gpumon; gpumon.start(rate_hz=10.0); "
         "time.sleep(float(os.environ['BENCH_S']))")


def run(n_agents: int, seconds: float, fps: float) -> dict:
    from gpumon import client
    from gpumon.tui.attach_app import AttachApp
    sockdir = tempfile.mkdtemp(prefix="gpumon-bench-")
    env = dict(os.environ, GPUMON_SOURCE="simulated", GPUMON_SIM_READY="now", GPUMON_DIR=sockdir,
               BENCH_S=str(seconds + 30), WORLD_SIZE=str(n_agents))
    procs = [subprocess.Popen([sys.executable, "-c", AGENT],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(n_agents)]
    try:
        os.environ["GPUMON_DIR"] = sockdir
        end = time.time() + 60
        while len(client.discover()) < n_agents:
            if time.time() > end:
                raise SystemExit("agents did not start")
            time.sleep(0.1)
        app = AttachApp(client.LocalTarget(None), fps=fps)  # every agent of the node

        async def main():
            async with app.run_test(headless=True, size=(160, 48)) as pilot:
                while len(app.panes) < n_agents:
                    await pilot.pause(0.1)
                app.frame_delays.clear()
                c0, w0 = time.process_time(), time.monotonic()
                await asyncio.sleep(seconds)
                c1, w1 = time.process_time(), time.monotonic()
                await app.action_quit()
            return (c1 - c0) / (w1 - w0), list(app.frame_delays)

        cpu, delays = asyncio.run(main())
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    delays.sort()
    return {"agents": n_agents, "cpu": cpu, "n": len(delays),
            "median_ms": statistics.median(delays) * 1e3 if delays else float("nan"),
            "p95_ms": delays[int(len(delays) * 0.95) - 1] * 1e3 if delays else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--agents", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--fps", type=float, default=4.0)
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".md")))
    a = ap.parse_args()
    rows = [run(n, a.seconds, a.fps) for n in a.agents]
    lines = [f"# TUI cost ({a.seconds:g} s per row, agents at 10 Hz, --fps {a.fps:g}, "
             f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')})", "",
             "Headless Textual at 160x48, overview tab visible when there are several agents. "
             "CPU: this process only (100% = one core). Target: <10% with 8 agents; delay < 250 ms.",
             "", "| agents | CPU of one core | delays measured (frames x agents) | delay median | delay p95 |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['agents']} | {r['cpu']:.1%} | {r['n']} | {r['median_ms']:.0f} ms | "
                     f"{r['p95_ms']:.0f} ms |")
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
