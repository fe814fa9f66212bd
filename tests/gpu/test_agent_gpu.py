"""The agent on a real GPU (skipped without CUDA): its figures are torch's own, exactly.

Run on the GPU machine:  python -m pytest tests/gpu/test_agent_gpu.py -q -s

How the comparison is made exact: a real training loop (MLP, AdamW) on cuda:0 stops at
synchronised points (after backward, gradients alive; after the optimizer step), reads
torch.cuda.memory_allocated / memory_reserved / max_memory_allocated / max_memory_reserved and
the agent's seq counter, prints them and waits on stdin. While it waits nothing allocates, so
(a) the agent's `sample` command (figures read now) and (b) every streamed sample whose seq is
past the one printed (taken after the read) must equal torch's figures to the byte. The client
is this test process, over the agent's real socket.
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

CHILD = textwrap.dedent(r"""
    import json, os, sys, time
    mode = sys.argv[1]
    import gpumon.agent.core as core
    if mode == "start":
        import gpumon
        agent = gpumon.start(rate_hz=50)
    else:  # started by `gpumon run`'s bootstrap at interpreter start
        agent = core.current_agent()
    assert agent is not None, "no agent"
    import torch
    time.sleep(1.5)  # six readiness polls: the agent must neither serve nor initialise CUDA
    def emit(**kw):
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()
    cuda_init = torch.cuda.is_initialized()
    emit(event="pre", serving=agent.serving.is_set(), cuda_init=cuda_init,
         contexts=[i for i in range(torch.cuda.device_count())
                   if torch._C._cuda_hasPrimaryContext(i)],  # a query: creates none
         sockets=sorted(os.listdir(core.socket_dir(create=True))))
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                  torch.nn.LayerNorm(1024), torch.nn.GELU())
                                  for _ in range(6)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def sync_point(step, where):
        torch.cuda.synchronize()
        st = torch.cuda.memory_stats(0)
        fig = {"allocated": torch.cuda.memory_allocated(0),
               "reserved": torch.cuda.memory_reserved(0),
               "peak_allocated": torch.cuda.max_memory_allocated(0),
               "peak_reserved": torch.cuda.max_memory_reserved(0),
               "active": st["active_bytes.all.current"],
               "requested": st["requested_bytes.all.current"],
               "segments": st["segment.all.current"],
               "alloc_retries": st["num_alloc_retries"], "ooms": st["num_ooms"]}
        emit(event="sync", step=step, where=where, seq=agent.seq, torch=fig,
             others=[i for i in range(1, torch.cuda.device_count())
                     if torch._C._cuda_hasPrimaryContext(i)])
        assert sys.stdin.readline().strip() == "next"

    for step in range(4):
        x = torch.randn(256, 1024, device=dev)
        loss = model(x).square().mean()
        loss.backward()
        if step in (0, 2):
            sync_point(step, "after_backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync_point(step, "after_step")
    emit(event="done")
    sys.stdin.readline()
""")

FIGURES = ("allocated", "reserved", "peak_allocated", "peak_reserved", "active", "requested",
           "segments", "alloc_retries", "ooms")


def wait_agent(pid, timeout=30.0):
    """The agent notices the program's CUDA init within a readiness poll (0.25 s)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = client.discover(pid)
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no agent serving in pid {pid}")


def norm_uuid(u):
    u = u.decode() if isinstance(u, bytes) else str(u)
    return u.lower().removeprefix("gpu-")


def nvml_pids_by_device():
    """{device UUID: pids in its NVML process list} for every GPU NVML sees."""
    import pynvml
    pynvml.nvmlInit()
    out = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        out[norm_uuid(pynvml.nvmlDeviceGetUUID(h))] = {
            p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
    return out


def own_pids(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return {int(x) for x in line.split()[1:]}
    return {pid}


@pytest.mark.parametrize("mode", ["start", "run"])
def test_agent_figures_equal_torchs_at_synchronised_points(mode):
    cmd = [sys.executable, "-c", CHILD, mode]
    if mode == "run":
        cmd = [sys.executable, "-m", "gpumon", "run", "--rate", "50", "--"] + cmd
    env = {k: v for k, v in os.environ.items() if k not in ("GPUMON", "GPUMON_SOURCE")}
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)

    def next_msg():
        line = p.stdout.readline()
        assert line, "child exited: " + p.stderr.read()[-3000:]
        return json.loads(line)

    conn = None
    try:
        pre = next_msg()
        # The agent waited for the program's CUDA init, and created none itself.
        assert pre["serving"] is False and pre["cuda_init"] is False, pre
        assert pre["contexts"] == [], pre
        assert not [n for n in pre["sockets"] if n.endswith(".sock")], pre
        checked = 0
        while True:
            m = next_msg()
            if m["event"] == "done":
                break
            assert m["event"] == "sync"
            if conn is None:
                (addr,) = wait_agent(p.pid)
                assert addr.pid == p.pid
                conn = client.AgentConnection.connect(addr, timeout=10)
                assert conn.hello["source"] == "torch"
                assert [d["index"] for d in conn.hello["devices"]] == [0]
                assert conn.hello["torch"] == torch.__version__
                if not os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
                    assert conn.hello["allocator"]["backend"] == "native"
                print("hello:", json.dumps({k: conn.hello[k] for k in
                                            ("devices", "allocator", "nvml", "rate_hz")}))
            want = m["torch"]
            # (a) the figures read now
            now = conn.request("sample")["devices"]
            assert [d["index"] for d in now] == [0]
            got = {k: now[0][k] for k in FIGURES}
            assert got == want, (m["where"], got, want)
            # (b) a streamed sample taken after the child's read
            while True:
                msg = conn.recv(timeout=10)
                assert msg is not None
                samples = msg.get("samples", []) if msg["type"] == "history" else (
                    [msg] if msg["type"] == "sample" else [])
                late = [s for s in samples if s["seq"] > m["seq"]]
                if late:
                    d = late[-1]["devices"][0]
                    assert {k: d[k] for k in FIGURES} == want, (m["where"], d, want)
                    break
            # NVML, read fresh by `sample`: the device and this process hold at least what
            # torch reserved (streamed samples may carry an NVML figure up to 5 s old).
            n = now[0]
            assert n["nvml_used"] is not None and n["nvml_used"] >= n["reserved"]
            assert n["nvml_total"] >= n["nvml_used"]
            assert n["proc_used"] is not None, "NVML's process list did not show the process"
            assert n["proc_used"] >= n["reserved"]
            d = {**d, "nvml_used": n["nvml_used"], "proc_used": n["proc_used"]}
            assert m["others"] == [], "a CUDA context exists on another device"
            print(f"{mode} step {m['step']} {m['where']}: allocated {d['allocated']} reserved "
                  f"{d['reserved']} peak {d['peak_allocated']} nvml_used {d['nvml_used']} "
                  f"proc_used {d['proc_used']} (non-PyTorch {d['proc_used'] - d['reserved']}) "
                  f"cost {late[-1]['cost_us']} us")
            checked += 1
            if checked == 2:
                # No context on any other device: NVML's process list of every device.
                pids = own_pids(p.pid)
                by_dev = nvml_pids_by_device()
                mine = norm_uuid(conn.hello["devices"][0]["uuid"])
                assert pids & by_dev[mine], f"pid {p.pid} not on cuda:0 per NVML: {by_dev}"
                for u, on in by_dev.items():
                    if u != mine:
                        assert not (pids & on), f"a context on device {u}"
                print(f"NVML: pid on cuda:0 only, {len(by_dev) - 1} other device(s) clean")
            p.stdin.write("next\n")
            p.stdin.flush()
        assert checked == 6
        st = conn.request("status")
        print(f"{mode} agent cost per sample: last {st['cost_us_last']} us, "
              f"mean {st['cost_us_mean']} us ({len(st['devices'])} device)")
        assert st["cost_us_mean"] < 1000
    finally:
        if conn is not None:
            conn.close()
        if p.poll() is None:
            p.stdin.write("\n")
            p.stdin.flush()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    err = p.stderr.read()
    assert p.returncode == 0, err[-3000:]
    assert "gpumon" not in err, err[-3000:]  # the agent says nothing on the program's stderr


def test_reset_peaks_resets_torchs_own_peak():
    prog = textwrap.dedent("""
        import sys, torch, gpumon
        a = gpumon.start(rate_hz=50)
        x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda"); del x
        torch.cuda.synchronize()
        print(torch.cuda.max_memory_allocated(0), flush=True)
        sys.stdin.readline()
        print(torch.cuda.max_memory_allocated(0), torch.cuda.memory_allocated(0), flush=True)
        sys.stdin.readline()
    """)
    p = subprocess.Popen([sys.executable, "-c", prog], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert int(p.stdout.readline()) >= 256 << 20
        (addr,) = wait_agent(p.pid)
        with client.AgentConnection.connect(addr) as c:
            assert c.request("reset_peaks") == {"reset": [0]}
        p.stdin.write("\n")
        p.stdin.flush()
        peak, now = map(int, p.stdout.readline().split())
        assert peak == now
    finally:
        p.kill()
        p.wait()


def test_demo_trains_on_the_gpu_for_real():
    r = subprocess.run([sys.executable, "-m", "gpumon", "demo", "--once"], capture_output=True,
                       text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "source torch (training on " in r.stdout and "(real CUDA memory)" in r.stdout
    assert "cuda:0" in r.stdout and "allocated" in r.stdout
    assert client.discover() == []  # the workload was stopped and its socket removed
