"""Screenshots (SVG, Textual's save_screenshot) of the real live view, made headless.

    python scripts/make_screenshots.py                      # the demo workload + 2 simulated ranks
    python scripts/make_screenshots.py --pid 12345          # a running process with an agent
    python scripts/make_screenshots.py --cmd "python train.py" --prefix gpu-   # under gpumon run

Writes screenshots/<prefix>{attach,breakdown}.svg and (without --pid/--cmd)
screenshots/overview-2-ranks.svg. Each waits --wait seconds of live samples first.

Each SVG carries the hash of the code that draws it (DRAWING_CODE, see drawing_code_hash), in a
comment: tests/tui/test_screenshots_fresh.py fails when a screenshot is older than that code.
The GPU shots (gpu-*) are retaken on the GPU machine: bash scripts/gpu_session.sh shots.
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

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "screenshots"
# the code a screenshot is drawn by: the live view, its widgets, styles and keys
DRAWING_CODE = ("gpumon/tui/attach_app.py", "gpumon/tui/attach.tcss", "gpumon/tui/format.py",
                "gpumon/tui/footer.py", "gpumon/tui/keys.py", "gpumon/tui/widgets/*.py")
MARK = "gpumon-drawing-code-sha256:"


def drawing_code_hash(root: Path = ROOT) -> str:
    """sha256 over the drawing code's files (names and contents, in a fixed order)."""
    import hashlib
    h = hashlib.sha256()
    for pattern in DRAWING_CODE:
        for f in sorted(root.glob(pattern)):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def stamped_hash(svg: Path) -> str | None:
    """The drawing code's hash a screenshot was made with (None: made before the stamp)."""
    import re
    m = re.search(MARK + r"([0-9a-f]{64})", svg.read_text(errors="replace"))
    return m.group(1) if m else None


def _save(app, path: Path) -> None:
    app.save_screenshot(str(path))
    text = path.read_text()
    path.write_text(text.replace("<svg ", f"<!-- {MARK}{drawing_code_hash()} -->\n<svg ", 1))
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
          size=(140, 44), demo: bool = False) -> None:
    from gpumon import client
    from gpumon.tui.attach_app import AttachApp
    pids = {a.pid for a in addresses}

    class Only(client.LocalTarget):  # every agent of the node, these shown
        def publish(self, msg):
            if int(msg["key"]) in pids:
                super().publish(msg)
    app = AttachApp(Only(None), fps=4, demo=demo)  # demo: as `gpumon demo` shows it

    async def main():
        async with app.run_test(headless=True, size=size) as pilot:
            while len(app.panes) < len(addresses):
                await pilot.pause(0.1)
            await asyncio.sleep(wait)
            for name, key in shots:
                if key:
                    await pilot.press(key)
                    await asyncio.sleep(2.0)
                _save(app, OUT / name)
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
            # "python3": the header shows the command line, not this machine's venv path
            cmd = shlex.split(a.cmd) if a.cmd else ["python3", "-m", "gpumon.demo", "--cpu"]
            env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
                       + os.environ.get("PATH", ""))
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
                              (f"{a.prefix}breakdown.svg", "b")], demo=not (a.pid or a.cmd))
        if not a.pid and not a.cmd:
            env = dict(os.environ, GPUMON_SOURCE="simulated", GPUMON_SIM_READY="now",
                       WORLD_SIZE="2", PATH=os.path.dirname(sys.executable) + os.pathsep
                       + os.environ.get("PATH", ""))
            ranks = [subprocess.Popen(["python3", "-c", RANK],
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
