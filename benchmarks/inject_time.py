"""How long `gpumon inject PID` takes, end to end (the command as a user runs it), on targets
that have no CUDA: a plain Python loop, a CPU training loop with torch, a program that keeps
building models (most of its time in torch's C++ initialisers), and a second inject where the
agent is already loaded (it must answer at once, without a debugger).

Run by hand: python benchmarks/inject_time.py [--rounds 3] [--device cuda] [--out FILE]
The torch source waits for CUDA, so on the CPU targets inject returns once the agent is loaded
and waiting (`<pid>.waiting`), as it does on a GPU program before its first CUDA call. With
--device cuda, two more: a training loop on the GPU and a program that keeps building a model
on the CPU and moving it to the GPU (inject returns once the agent serves).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TARGETS = {
    "plain": "import time\nprint('ready', flush=True)\nwhile True:\n    time.sleep(0.02)\n",
    "torch_train": (
        "import torch\ntorch.set_num_threads(1)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))\n"
        "opt = torch.optim.AdamW(m.parameters())\nx = torch.randn(512, 256)\n"
        "print('ready', flush=True)\n"
        "while True:\n    opt.zero_grad(); m(x).sum().backward(); opt.step()\n"),
    "model_building": (
        "import torch\ntorch.set_num_threads(1)\nprint('ready', flush=True)\n"
        "while True:\n"
        "    layers = [torch.nn.TransformerEncoderLayer(512, 8, 2048) for _ in range(4)]\n"
        "    del layers\n"),
}
CUDA_TARGETS = {
    "cuda_train": (
        "import torch\n"
        "m = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()\n"
        "opt = torch.optim.AdamW(m.parameters())\nx = torch.randn(256, 2048, device='cuda')\n"
        "print('ready', flush=True)\n"
        "while True:\n    opt.zero_grad(); m(x).sum().backward(); opt.step()\n"
        "    torch.cuda.synchronize()\n"),
    "cuda_model_building": (
        "import torch\ntorch.cuda.init()\nprint('ready', flush=True)\n"
        "while True:\n"
        "    m = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(1024, 16, 4096)\n"
        "                              for _ in range(4)]).cuda()\n"
        "    del m\n"),
}


def run_inject(pid: int, env: dict) -> float:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "gpumon", "inject", str(pid), "--timeout", "30"],
                       capture_output=True, text=True, env=env, timeout=120)
    dt = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"inject failed: {r.stderr.strip()}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = ap.parse_args()
    targets = dict(TARGETS, **(CUDA_TARGETS if a.device == "cuda" else {}))
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "sock"
        base.mkdir(mode=0o700)
        env = dict(os.environ, GPUMON_DIR=str(base),
                   PYTHONPATH=os.pathsep.join([str(ROOT)] + [
                       p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        for k in ("GPUMON", "GPUMON_SOURCE", "GPUMON_INJECT_SOURCE"):
            env.pop(k, None)
        for name, code in targets.items():
            first, again = [], []
            for _ in range(a.rounds):
                p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                     text=True, env=env)
                try:
                    assert p.stdout.readline() == "ready\n"
                    time.sleep(0.5)
                    first.append(run_inject(p.pid, env))
                    again.append(run_inject(p.pid, env))
                finally:
                    p.kill()
                    p.wait()
            results[name] = {"first": first, "already_loaded": again}
    lines = [f"gpumon inject, seconds (median of {a.rounds}; min-max), {os.cpu_count()} cores:"]
    for name, r in results.items():
        lines.append(f"  {name:<15} first {statistics.median(r['first']):.2f} "
                     f"({min(r['first']):.2f}-{max(r['first']):.2f})   already loaded "
                     f"{statistics.median(r['already_loaded']):.2f} "
                     f"({min(r['already_loaded']):.2f}-{max(r['already_loaded']):.2f})")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
