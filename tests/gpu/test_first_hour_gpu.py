"""Issue 32 on a real GPU (skipped without CUDA): what a new user meets first.

Run on the GPU machine:  python -m pytest tests/gpu/test_first_hour_gpu.py -v -s
(section `firsthour` of scripts/gpu_session.sh; ~40 s on an H100).

1. `gpumon snapshot PID --steps 1` started while the program builds its model on the CPU (its
   agent waits for the first CUDA call) refused with status 1 on the H100. It now waits, armed,
   and records the first steps once CUDA is up: status 0, a real (not simulated) snapshot whose
   sidecar counts 1 step. Printed: how long after the first CUDA call the recording started.
2. `gpumon demo --once` with CUDA: the workload trains on the GPU, the source is torch, and no
   NVML error is said.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from gpumon import client  # noqa: E402

BUILDS_THEN_TRAINS = textwrap.dedent(r"""
    import sys, time
    import torch
    print("building", flush=True)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # on the CPU
    time.sleep(float(sys.argv[1]))  # a from_pretrained on the CPU, shortened
    model = model.cuda()  # the first CUDA call
    print("cuda", time.time(), flush=True)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2000):
        model(torch.randn(64, 1024, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        time.sleep(0.02)
""")


def test_snapshot_steps_asked_before_cuda_records_the_first_steps(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GPUMON_SOURCE"}
    prog = subprocess.Popen([sys.executable, "-m", "gpumon", "run", "--", sys.executable, "-c",
                             BUILDS_THEN_TRAINS, "6"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert prog.stdout.readline() == "building\n"
        end = time.monotonic() + 30
        while client.scan().get(prog.pid) is None:
            assert time.monotonic() < end, "no waiting agent"
            time.sleep(0.1)
        out = tmp_path / "first.pickle"
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "gpumon", "snapshot", str(prog.pid),
                            "--steps", "1", "-o", str(out)], capture_output=True, text=True,
                           timeout=240)
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        assert "the recording is armed and starts then" in r.stderr
        assert r.stdout.strip() == str(out) and out.stat().st_size > 0
        meta = json.loads(out.with_name(out.name + ".json").read_text())
        assert meta["steps"] == 1 and meta["simulated"] is False, meta
        cuda_at = float(prog.stdout.readline().split()[1])
        print(f"\narmed snapshot: command took {took:.1f} s; recording started "
              f"{meta['since'] - cuda_at:.2f} s after the first CUDA call; "
              f"{meta['entries']} trace entries, {meta['size']} bytes")
    finally:
        prog.kill()
        prog.wait(30)
        prog.stdout.close()
        prog.stderr.close()


def test_demo_once_with_cuda_starts_clean():
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "gpumon", "demo", "--once"], capture_output=True,
                       text=True, timeout=180,
                       env={k: v for k, v in os.environ.items() if k != "GPUMON_SOURCE"})
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert "source torch (training on" in r.stdout, r.stdout
    assert "NVML unavailable" not in r.stdout + r.stderr and "Error" not in r.stdout
    print(f"\ngpumon demo --once with CUDA: {took:.1f} s\n{r.stdout}")
