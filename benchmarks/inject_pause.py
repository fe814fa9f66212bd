"""How long injection stops a running program, and how long `gpumon inject` takes.

The target (started without gpumon, torch imported, so gdb has many libraries to skip) runs a
loop that notes the longest gap between two iterations 1 ms apart; the gap over an injection
is the time the debugger held it stopped (plus the bootstrap's own moment on its main thread).
Run by hand: python benchmarks/inject_pause.py [--rounds 5] [--torch] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET = r"""
import json, os, sys, time
if sys.argv[2] == "1":
    import torch
ctl = sys.argv[1]
print("ready", flush=True)
gap, last = 0.0, time.monotonic()
while not os.path.exists(os.path.join(ctl, "stop")):
    if os.path.exists(os.path.join(ctl, "report")):
        with open(os.path.join(ctl, "gap"), "w") as f:
            f.write(repr(gap))
        os.unlink(os.path.join(ctl, "report"))
        gap = 0.0
    time.sleep(0.001)
    now = time.monotonic()
    gap, last = max(gap, now - last), now
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--torch", action="store_true", help="import torch in the target")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from gpumon import inject
    ctl = Path(tempfile.mkdtemp(prefix="gpumon-inject-bench-"))
    os.environ.setdefault("GPUMON_DIR", str(ctl / "sock"))
    env = {k: v for k, v in os.environ.items() if k not in ("GPUMON", "GPUMON_SOURCE")}
    env["GPUMON_SIM_READY"] = "now"  # the injected simulated agent serves without torch
    p = subprocess.Popen([sys.executable, "-c", TARGET, str(ctl), "1" if a.torch else "0"],
                         stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline() == "ready\n"
    rows = []
    try:
        for _ in range(a.rounds):
            time.sleep(0.3)
            (ctl / "report").touch()  # reset the gap
            while (ctl / "report").exists():
                time.sleep(0.01)
            t0 = time.monotonic()
            inject.inject(p.pid, timeout=30, source="simulated")
            took = time.monotonic() - t0
            (ctl / "report").touch()
            while (ctl / "report").exists():
                time.sleep(0.01)
            gap = float((ctl / "gap").read_text())
            inject.detach(p.pid)
            rows.append({"inject_s": round(took, 3), "longest_stop_s": round(gap, 3)})
    finally:
        (ctl / "stop").touch()
        p.wait(30)
    text = (f"python {sys.version.split()[0]}, torch imported: {a.torch}, "
            f"{os.cpu_count()} cpus\n" + "\n".join(json.dumps(r) for r in rows) + "\n"
            f"worst: inject {max(r['inject_s'] for r in rows)} s, "
            f"target stopped {max(r['longest_stop_s'] for r in rows)} s\n")
    sys.stdout.write(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
