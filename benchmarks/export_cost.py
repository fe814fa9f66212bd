"""CPU of `gpumon export` following 8 simulated agents at their default rate (10 Hz), served on
/metrics and scraped every 15 s (Prometheus's default), and in --textfile mode at its default
interval. Target (issue 21): under 1% of one core.

    python benchmarks/export_cost.py [--seconds 60] [--agents 8] [--scrape 15]

Each agent is a real process (GPUMON_SOURCE=simulated, gpumon.start()) behind a real socket;
the exporter is a real `python -m gpumon export` process. CPU = the exporter's user+sys time
(/proc/PID/stat) over the measured window, after a warm-up (its start and the agents'
histories), divided by the window's wall time (100% = one core). Results are appended to
benchmarks/export_cost.md.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AGENT = "import gpumon, sys; gpumon.start(); print('up', flush=True); sys.stdin.read()"


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(mode: str, agents: int, seconds: float, scrape_s: float, warmup: float) -> dict:
    base = tempfile.mkdtemp(prefix="gpumon-export-bench-")
    env = dict(os.environ, GPUMON_SOURCE="simulated", GPUMON_SIM_READY="now", GPUMON_DIR=base,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GPUMON", None)
    procs = []
    for r in range(agents):
        p = subprocess.Popen([sys.executable, "-c", AGENT], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env=dict(env, RANK=str(r), LOCAL_RANK=str(r),
                                      WORLD_SIZE=str(agents)))
        procs.append(p)
    for p in procs:
        assert p.stdout.readline() == "up\n"
    port = free_port()
    out = tempfile.mkdtemp(prefix="gpumon-textfile-")
    args = (["--textfile", out] if mode == "textfile" else
            ["--address", "127.0.0.1", "--port", str(port)])
    ex = subprocess.Popen([sys.executable, "-m", "gpumon", "export", *args], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    scrapes = 0
    try:
        def scrape() -> int:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return len(r.read())
        end = time.monotonic() + 20
        while mode == "http":
            try:
                size = scrape()
                break
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)
        time.sleep(warmup)
        c0, t0 = cpu_s(ex.pid), time.monotonic()
        next_scrape = t0
        while (now := time.monotonic()) < t0 + seconds:
            if mode == "http" and now >= next_scrape:
                size = scrape()
                scrapes += 1
                next_scrape += scrape_s
            time.sleep(min(0.5, max(0.0, next_scrape - time.monotonic())) if mode == "http"
                       else 0.5)
        c1, t1 = cpu_s(ex.pid), time.monotonic()
        if mode == "textfile":
            size = os.path.getsize(os.path.join(out, "gpumon.prom"))
    finally:
        ex.terminate()
        ex.wait(10)
        for p in procs:
            p.kill()
            p.wait()
    return {"mode": mode, "agents": agents, "seconds": t1 - t0, "cpu_pct": 100 * (c1 - c0) / (t1 - t0),
            "scrapes": scrapes, "bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--scrape", type=float, default=15.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".md")))
    a = ap.parse_args()
    rows = [measure(m, a.agents, a.seconds, a.scrape, a.warmup) for m in ("http", "textfile")]
    lines = [f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
             f"{os.cpu_count()} cores, Python {platform.python_version()}, load "
             f"{os.getloadavg()[0]:.1f}\n",
             "| mode | agents (10 Hz each) | window | exporter CPU (% of one core) | scrapes | "
             "metrics size |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['agents']} | {r['seconds']:.0f} s | "
                     f"{r['cpu_pct']:.2f}% | {r['scrapes']} | {r['bytes']} B |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(a.out, "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
