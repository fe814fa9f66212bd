"""Injection into a real GPU training loop started WITHOUT gpumon (skipped without CUDA or gdb).

Run on the GPU machine:  python -m pytest tests/gpu/test_inject_gpu.py -q -s -rs
(without gdb there: bash scripts/make_gdb_bundle.sh here, carry .gdb, and there
 mkdir -p /tmp/gdb && tar xJf .gdb/gdb-bundle.tar.xz -C /tmp/gdb && export GPUMON_GDB=/tmp/gdb/gdb)

The child trains an MLP with AdamW on cuda:0 for a fixed number of steps with a fixed seed and
deterministic algorithms, printing every loss exactly (float.hex). While a file `pause` exists
it stops between two steps, synchronises, writes torch.cuda's own figures to a file and waits
in a Python loop (so the injected code can run, and nothing allocates). The test injects the
real (torch) agent during the first pause, compares the agent's figures with the child's to the
byte, lets it train on, compares again at a second pause, detaches, and lets it finish. The
loss sequence must equal, bit for bit, that of the same training run never injected.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import polling
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
from gpumon import client, inject  # noqa: E402

if sys.version_info < inject.REMOTE_EXEC_VERSION:
    try:
        inject.find_debugger()
    except inject.InjectError:
        pytest.skip(f"injection into Python {sys.version_info[0]}.{sys.version_info[1]} needs "
                    "gdb, which this machine lacks (apt-get install gdb, or GPUMON_GDB=the gdb "
                    "of scripts/make_gdb_bundle.sh)", allow_module_level=True)

STEPS = 120
CHILD = textwrap.dedent(r"""
    import json, os, sys, time
    ctl = sys.argv[1]
    import torch
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                  torch.nn.LayerNorm(1024), torch.nn.GELU())
                                  for _ in range(6)], torch.nn.Linear(1024, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device=dev).manual_seed(1)
    pauses = 0
    for step in range(int(sys.argv[2])):
        x = torch.randn(512, 1024, device=dev, generator=g)
        y = torch.randn(512, 1, device=dev, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(step, loss.item().hex(), flush=True)
        if os.path.exists(os.path.join(ctl, "pause")):
            torch.cuda.synchronize()
            fig = {"step": step, "allocated": torch.cuda.memory_allocated(0),
                   "reserved": torch.cuda.memory_reserved(0),
                   "peak_allocated": torch.cuda.max_memory_allocated(0),
                   "peak_reserved": torch.cuda.max_memory_reserved(0)}
            tmp = os.path.join(ctl, "figs.tmp")
            with open(tmp, "w") as f:
                json.dump(fig, f)
            os.replace(tmp, os.path.join(ctl, f"figs{pauses}.json"))
            pauses += 1
            while os.path.exists(os.path.join(ctl, "pause")):
                time.sleep(0.005)  # Python code: the interpreter's pending calls run here
        time.sleep(0.01)
    print("done", flush=True)
    print(json.dumps({"gpumon": "gpumon" in sys.modules,
                      "threads": sorted(t.name for t in __import__("threading").enumerate())}),
          file=sys.stderr, flush=True)
""")
FIGURES = ("allocated", "reserved", "peak_allocated", "peak_reserved")


def wait_until(fn, timeout=60.0, interval=0.02):
    return polling.wait_until(fn, timeout, interval)


def start_child(tmp_path, name):
    ctl = tmp_path / name
    ctl.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMON") or k == "GPUMON_DIR"}
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(ctl), str(STEPS)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return p, ctl


def finish(p, first=""):
    out, err = p.communicate(timeout=300)
    out = first + out
    assert p.returncode == 0, err[-3000:]
    lines = out.splitlines()
    assert lines[-1] == "done", lines[-3:]
    return lines[:-1], err


def compare(conn, want):
    now = conn.request("sample", timeout=10)["devices"]
    assert [d["index"] for d in now] == [0]
    got = {k: now[0][k] for k in FIGURES}
    assert got == {k: want[k] for k in FIGURES}, (got, want)
    return now[0]


def test_inject_into_gpu_training_figures_and_unchanged_losses(tmp_path):
    ref, _ = start_child(tmp_path, "ref")  # the same run, never injected
    p, ctl = start_child(tmp_path, "inj")
    sock = None
    try:
        first = p.stdout.readline()
        assert first.startswith("0 "), (first, p.poll() is not None and p.stderr.read()[-3000:])
        (ctl / "pause").touch()
        figs0 = wait_until(lambda: (ctl / "figs0.json").exists() and
                           json.loads((ctl / "figs0.json").read_text()))
        assert figs0, "the child did not pause"
        t0 = time.monotonic()
        try:
            sock = inject.inject(p.pid, timeout=30)  # the real torch source
        except inject.InjectError as e:
            if "not permitted to attach" in str(e):  # the machine forbids ptrace: say why
                pytest.skip(str(e))
            raise
        took = time.monotonic() - t0
        with client.AgentConnection.connect(sock, timeout=10) as conn:
            assert conn.hello["pid"] == p.pid and conn.hello["source"] == "torch"
            assert conn.hello["torch"] == torch.__version__
            assert "detach" in conn.hello["commands"]
            d0 = compare(conn, figs0)
            # A streamed sample too (taken while nothing allocates).
            msg = wait_until(lambda: [m for m in [conn.recv(timeout=10)]
                                      if m and m["type"] == "sample"], timeout=30)
            assert msg, "no streamed sample"
            assert {k: msg[0]["devices"][0][k] for k in FIGURES} == {k: figs0[k] for k in FIGURES}
            print(f"inject took {took:.2f} s; at step {figs0['step']}: allocated "
                  f"{d0['allocated']} reserved {d0['reserved']} peak {d0['peak_allocated']} "
                  f"(torch: {figs0['allocated']} {figs0['reserved']} {figs0['peak_allocated']})")
            # Train on with the agent in, then a second synchronised comparison.
            (ctl / "pause").unlink()
            time.sleep(0.5)
            (ctl / "pause").touch()
            figs1 = wait_until(lambda: (ctl / "figs1.json").exists() and
                               json.loads((ctl / "figs1.json").read_text()))
            assert figs1 and figs1["step"] > figs0["step"]
            d1 = compare(conn, figs1)
            print(f"at step {figs1['step']}: allocated {d1['allocated']} reserved "
                  f"{d1['reserved']} (torch: {figs1['allocated']} {figs1['reserved']})")
        inject.detach(p.pid, timeout=15)
        assert not sock.exists() and client.discover(p.pid) == []
        (ctl / "pause").unlink()
        lines, err = finish(p, first)
        ref_lines, ref_err = finish(ref)
        assert len(lines) == len(ref_lines) == STEPS
        assert lines == ref_lines, "the injected run's losses differ from the plain run's"
        report = json.loads(err.strip().splitlines()[-1])
        assert err.strip().splitlines()[:-1] == [], err[-2000:]  # nothing on its stderr
        assert not [t for t in report["threads"] if t.startswith("gpumon")], report
        print(f"{STEPS} losses equal bit for bit; last {lines[-1]}")
    finally:
        for q in (p, ref):
            if q.poll() is None:
                q.kill()
                q.wait()
