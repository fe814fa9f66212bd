"""Screenshots (SVG, Textual's save_screenshot) of the real live view, made headless.

    python scripts/make_screenshots.py                      # the demo workload + 2 simulated ranks
    python scripts/make_screenshots.py --pid 12345          # a running process with an agent
    python scripts/make_screenshots.py --cmd "python train.py" --prefix gpu-   # under gpumon run

Writes screenshots/<prefix>{attach,breakdown}.svg and (without --pid/--cmd)
screenshots/overview-2-ranks.svg. Each waits --wait seconds of live samples first.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "screenshots"
RANK = ("import os, time, gpumon; gpumon.start(rate_hz=10.0); time.sleep(600)")


def _wait_agents(pid: int | None, n: int, timeout: float = 60) -> list:
    from gpumon import client
    end = time.time() + timeout
    while True:
        found = client.discover(pid=pid)
        if len(found) >= n:
            return found
        if time.time() > end:
            raise SystemExit(f"no gpumon agent appeared (pid {pid})")
        time.sleep(0.2)


def shoot(addresses: list, wait: float, shots: list[tuple[str, str | None]],
          size=(140, 44)) -> None:
    from gpumon import client
    from gpumon.tui.attach_app import AttachApp
    pids = {a.pid for a in addresses}

    class Only(client.LocalTarget):  # every agent of the node, these shown
        def publish(self, msg):
            if int(msg["key"]) in pids:
                super().publish(msg)
    app = AttachApp(Only(None), fps=4)

    async def main():
        async with app.run_test(headless=True, size=size) as pilot:
            while len(app.panes) < len(addresses):
                await pilot.pause(0.1)
            await asyncio.sleep(wait)
            for name, key in shots:
                if key:
                    await pilot.press(key)
                    await asyncio.sleep(2.0)
                app.save_screenshot(str(OUT / name))
                print("wrote", OUT / name)
            await app.action_quit()
    asyncio.run(main())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, help="attach to this pid (it or its children run an agent)")
    ap.add_argument("--cmd", help="run this command under `gpumon run` and attach to it")
    ap.add_argument("--prefix", default="", help="file name prefix (e.g. gpu-)")
    ap.add_argument("--wait", type=float, default=20.0, help="seconds of samples before a shot")
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    children = []
    try:
        if a.pid:
            addrs = _wait_agents(a.pid, 1)
        else:
            cmd = shlex.split(a.cmd) if a.cmd else [sys.executable, "-m", "gpumon.demo"]
            env = dict(os.environ)
            if not a.cmd:
                env.setdefault("GPUMON_DIR", tempfile.mkdtemp(prefix="gpumon-shots-"))
                os.environ["GPUMON_DIR"] = env["GPUMON_DIR"]
            # the demo starts its own agent (simulated source without CUDA); a user command
            # runs under `gpumon run` so the agent starts in it with no change to its code
            full = cmd if not a.cmd else [sys.executable, "-m", "gpumon", "run", "--", *cmd]
            p = subprocess.Popen(full, env=env)
            children.append(p)
            addrs = _wait_agents(p.pid, 1)
        shoot(addrs, a.wait, [(f"{a.prefix}attach.svg", None),
                              (f"{a.prefix}breakdown.svg", "b")])
        if not a.pid and not a.cmd:
            env = dict(os.environ, GPUMON_SOURCE="simulated", GPUMON_SIM_READY="now",
                       WORLD_SIZE="2")
            ranks = [subprocess.Popen([sys.executable, "-c", RANK],
                                      env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
                     for r in range(2)]
            children += ranks
            addrs = [x for r in ranks for x in _wait_agents(r.pid, 1)]
            shoot(addrs, a.wait, [("overview-2-ranks.svg", None)])
    finally:
        for p in children:
            p.terminate()
        for p in children:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
