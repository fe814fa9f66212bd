"""`gpumon export` and `gpumon relay` on a real GPU (skipped without CUDA).

Run on the GPU machine:  python -m pytest tests/gpu/test_export_gpu.py -q -s

A real training loop (MLP, AdamW, cuda:0) under the agent stops at a synchronised point and
prints torch's figures; while it waits nothing allocates, so the exporter's
gpumon_allocated_bytes / gpumon_reserved_bytes must equal torch's to the byte (the exporter's
live samples are 1 Hz: the test waits for one taken after the print), the role breakdown and
the last step's peak (with its phase) must be there, and a relay (the node end of attach
--hosts) must stream the same figures.
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
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from gpumon.cluster.export import Exporter  # noqa: E402

CHILD = textwrap.dedent(r"""
    import json, os, sys, time
    os.environ.setdefault("RANK", "0"); os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    import gpumon
    gpumon.start(rate_hz=10)
    import torch
    dev = torch.device("cuda", 0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2048, 2048),
                                  torch.nn.GELU()) for _ in range(6)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 2048, device=dev)
    for step in range(12):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        time.sleep(0.05)
    time.sleep(1.5)  # the last step is reported after a second of quiet
    torch.cuda.synchronize()
    print(json.dumps({"allocated": torch.cuda.memory_allocated(0),
                      "reserved": torch.cuda.memory_reserved(0),
                      "peak": torch.cuda.max_memory_allocated(0), "t": time.time()}),
          flush=True)
    sys.stdin.readline()
""")


def parse(text):
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_export_and_relay_figures_are_torchs(gpumon_dir):
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, GPUMON_SOURCE="torch"))
    ex = Exporter(host="gpu", interval=0.2).start()
    try:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        fig = json.loads(line)
        time.sleep(2.5)  # a 1 Hz live sample taken after the figures were read
        m = parse(ex.text().decode())
        (labels, alloc), = [(lb, v) for lb, v in m["gpumon_allocated_bytes"]
                            if lb.get("rank") == "0"]
        assert alloc == fig["allocated"]
        assert dict(m["gpumon_reserved_bytes"][0][0]) == labels
        assert m["gpumon_reserved_bytes"][0][1] == fig["reserved"]
        assert m["gpumon_peak_allocated_bytes"][0][1] == fig["peak"]
        assert labels["gpu_uuid"].startswith("GPU-") and labels["device"] == "0"
        roles = {lb["role"]: v for lb, v in m.get("gpumon_role_bytes", [])}
        assert roles.get("parameters", 0) > 6 * 2048 * 2048 * 4 * 0.99, roles
        assert roles.get("optimizer_state", 0) > 2 * 6 * 2048 * 2048 * 4 * 0.99, roles
        steps = m.get("gpumon_step_peak_bytes", [])
        assert steps and steps[0][1] > 0, "no step peak exported"
        print("step peak", steps[0])
        assert m["gpumon_non_pytorch_bytes"][0][1] > 100 << 20  # the CUDA context at least
        # the relay streams the same figures
        r = subprocess.Popen([sys.executable, "-m", "gpumon", "relay", "--host", "gpu"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            got = None
            end = time.monotonic() + 20
            while got is None and time.monotonic() < end:
                msg = json.loads(r.stdout.readline())
                if msg.get("type") == "sample" and msg.get("key") == str(p.pid):
                    got = msg["devices"][0]
            assert got and got["allocated"] == fig["allocated"]
        finally:
            r.stdin.close()
            assert r.wait(10) == 0
            r.stdout.close()
    finally:
        ex.close()
        p.stdin.close()
        p.wait(30)
        p.stdout.close()
        p.stderr.close()
