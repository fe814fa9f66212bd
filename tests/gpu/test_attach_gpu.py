"""Attached before the first CUDA call, on a real GPU (skipped without CUDA). Issue 16: a
program that builds its model on the CPU first (every Hugging Face script does) was followed
through NVML for its whole run, although the agent served from its first CUDA call on.

Run on the GPU machine:  python -m pytest tests/gpu/test_attach_gpu.py -q -s

`gpumon run -- python CHILD &` then at once `gpumon attach $! --json` (and `--once --wait`).
The child builds its model on the CPU for BUILD_S seconds, moves it to cuda:0 (its first CUDA
call), trains, and stops at synchronised points (as tests/gpu/test_agent_gpu.py does) where it
prints torch's figures and the agent's seq and waits on stdin: the first `--json` sample past
that seq must equal torch's figures to the byte. At the end it exits with status 0, while this
test (its parent) has not collected it yet: the exit event must say "status 0".
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

BUILD_S = 20.0
FIGURES = ("allocated", "reserved", "peak_allocated", "peak_reserved", "active", "requested",
           "segments", "alloc_retries", "ooms")
WAITING = "pid {pid}: gpumon's agent is loaded, waiting for the program's first CUDA call"

CHILD = textwrap.dedent(r"""
    import json, sys, time
    import torch
    import gpumon.agent.core as core
    build_s = float(sys.argv[1])
    def emit(**kw):
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()
    t0 = time.monotonic()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                  torch.nn.LayerNorm(1024), torch.nn.GELU())
                                  for _ in range(6)])  # on the CPU, as from_pretrained
    while time.monotonic() - t0 < build_s:  # "loading weights": CPU work, no CUDA
        with torch.no_grad():
            model(torch.randn(64, 1024))
    emit(event="built", cuda_init=torch.cuda.is_initialized())
    dev = torch.device("cuda", 0)
    model = model.to(dev)  # the first CUDA call
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    agent = core.current_agent()
    for step in range(3):
        loss = model(torch.randn(256, 1024, device=dev)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        st = torch.cuda.memory_stats(0)
        emit(event="sync", step=step, seq=agent.seq, torch={
            "allocated": torch.cuda.memory_allocated(0),
            "reserved": torch.cuda.memory_reserved(0),
            "peak_allocated": torch.cuda.max_memory_allocated(0),
            "peak_reserved": torch.cuda.max_memory_reserved(0),
            "active": st["active_bytes.all.current"],
            "requested": st["requested_bytes.all.current"],
            "segments": st["segment.all.current"],
            "alloc_retries": st["num_alloc_retries"], "ooms": st["num_ooms"]})
        assert sys.stdin.readline().strip() == "next"
    emit(event="done")
    sys.stdin.readline()
    sys.exit(0)
""")


def _lines(stream, q):
    for line in stream:
        q.put(line)
    q.put(None)


def test_attach_json_started_first_switches_to_the_agent_with_torchs_figures():
    env = {k: v for k, v in os.environ.items() if k not in ("GPUMON", "GPUMON_SOURCE")}
    p = subprocess.Popen([sys.executable, "-m", "gpumon", "run", "--rate", "20", "--",
                          sys.executable, "-c", CHILD, str(BUILD_S)], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    started, started_wall = time.monotonic(), time.time()
    a = subprocess.Popen([sys.executable, "-m", "gpumon", "attach", str(p.pid), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    once = None
    out: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(a.stdout, out), daemon=True).start()
    seen: list[dict] = []

    def until(pred, timeout, what):
        end = time.monotonic() + timeout
        while True:
            try:
                line = out.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {what} in {timeout} s; last {seen[-3:]}")
            assert line is not None, f"attach --json ended before {what}: {a.stderr.read()}"
            m = json.loads(line)
            seen.append(m)
            if pred(m):
                return m

    def child():
        line = p.stdout.readline()
        assert line, "child exited: " + p.stderr.read()[-3000:]
        return json.loads(line)

    try:
        until(lambda m: m.get("kind") == "state" and m["line"] == WAITING.format(pid=p.pid),
              60, "the waiting state")
        once = subprocess.Popen([sys.executable, "-m", "gpumon", "attach", str(p.pid),
                                 "--once", "--wait", "120"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        built = child()
        assert built == {"event": "built", "cuda_init": False}
        assert time.monotonic() - started >= BUILD_S - 1
        serving = until(lambda m: m.get("kind") == "state" and m["state"] == "serving", 60,
                        "the switch to the agent")
        before = seen[:seen.index(serving)]
        nvml = [m for m in before if m["type"] == "sample"]
        assert nvml and all(m["source"] == "nvml" for m in nvml), "NVML's view while waiting"
        assert all(d["allocated"] is None for m in nvml for d in m["devices"])
        checked = 0
        while True:
            m = child()
            if m["event"] == "done":
                break
            s = until(lambda x: x["type"] == "sample" and x.get("source") != "nvml"
                      and x["seq"] > m["seq"], 30, f"a sample after seq {m['seq']}")
            d = s["devices"][0]
            assert {k: d[k] for k in FIGURES} == m["torch"], (m["step"], d, m["torch"])
            print(f"step {m['step']}: allocated {d['allocated']} reserved {d['reserved']} "
                  f"peak {d['peak_allocated']} (seq {s['seq']}): equal to torch's")
            checked += 1
            p.stdin.write("next\n")
            p.stdin.flush()
        assert checked == 3
        first = next(m for m in seen if m["type"] == "sample" and m.get("source") != "nvml")
        assert first["seq"] == 0  # the agent's history from its first sample
        o_out, o_err = once.communicate(timeout=60)
        assert once.returncode == 0, o_err
        assert "source torch" in o_out and "NVML only" not in o_out, o_out
        p.stdin.write("\n")
        p.stdin.flush()
        ex = until(lambda m: m.get("kind") == "exit", 60, "the exit event")
        assert (ex["status"], ex["signal"]) == (0, None), ex
        assert ex["line"] == f"pid {p.pid} exited with status 0"
        assert a.wait(60) == 0
        print(f"waited {serving['t'] - started_wall:.1f} s for the first CUDA call; exit: {ex['line']}")
    finally:
        for proc in (a, once, p):
            if proc is not None and proc.poll() is None:
                proc.kill()
        p.wait(30)
