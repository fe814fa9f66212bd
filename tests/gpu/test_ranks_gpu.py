"""Two ranks under a real torchrun (skipped without CUDA): on one GPU they share it; with two or
more, rank r uses cuda:r and must have no context on the other rank's device.

Run on the GPU machine:  python -m pytest tests/gpu/test_ranks_gpu.py -q -s

`gpumon run -- python -m torch.distributed.run --standalone --nproc-per-node 2 rank.py`: every
rank gets an agent from the bootstrap; torchrun's own process (Python, imports torch, never
uses CUDA) gets one too, which must never serve. Discovery of the torchrun pid finds both
ranks, in rank order; each rank's figures are its own (rank r holds (r+1) x 64 MiB).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from gpumon import client  # noqa: E402

RANK = textwrap.dedent("""
    import os, sys, time
    import torch
    rank = int(os.environ["RANK"])
    dev = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    x = torch.empty((rank + 1) * (64 << 20), dtype=torch.uint8, device=f"cuda:{dev}")
    torch.cuda.synchronize()
    print("ready", rank, os.getpid(), torch.cuda.memory_allocated(dev), dev, flush=True)
    time.sleep(120)
""")


def nspids(pid):
    """The pid in every namespace (NVML reports the host's in a container)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return {int(x) for x in line.split()[1:]}
    return {pid}


def test_torchrun_ranks_are_discovered_from_the_launcher(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {k: v for k, v in os.environ.items() if k not in ("GPUMON", "GPUMON_SOURCE")}
    cmd = [sys.executable, "-m", "gpumon", "run", "--", sys.executable, "-m",
           "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        ready = {}
        while len(ready) < 2:
            line = p.stdout.readline()
            assert line, "torchrun exited: " + p.stderr.read()[-3000:]
            if line.startswith("ready"):
                _, r, pid, alloc, dev = line.split()
                ready[int(r)] = (int(pid), int(alloc), int(dev))
        end = time.monotonic() + 30
        while len(client.discover(p.pid)) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        found = client.discover(p.pid)
        assert [a.pid for a in found] == [ready[0][0], ready[1][0]]  # rank order
        assert all(a.pid != p.pid for a in client.discover())  # the launcher never serves
        uuids = {}
        for r, a in enumerate(found):
            with client.AgentConnection.connect(a) as c:
                h = c.hello
                uuids[r] = h["devices"][0]["uuid"]
                assert (h["rank"], h["local_rank"], h["world_size"]) == (r, r, 2)
                assert [d["index"] for d in h["devices"]] == [ready[r][2]]
                d = c.request("sample")["devices"][0]
                assert d["allocated"] == ready[r][1] == (r + 1) * (64 << 20)
                assert d["proc_used"] is not None and d["proc_used"] >= d["reserved"]
                print(f"rank {r} pid {a.pid}: allocated {d['allocated']} reserved "
                      f"{d['reserved']} proc_used {d['proc_used']}")
        # NVML's process lists: each rank's pid only on its own device.
        import pynvml
        pynvml.nvmlInit()
        for r, (pid, _, dev) in ready.items():
            pids = nspids(pid)
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                u = pynvml.nvmlDeviceGetUUID(h)
                u = u.decode() if isinstance(u, bytes) else u
                mine = u.lower().removeprefix("gpu-") == str(uuids[r]).lower().removeprefix("gpu-")
                on = {q.pid for q in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
                assert bool(pids & on) == mine, (r, pid, i, u, on)
        ls = subprocess.run([sys.executable, "-m", "gpumon", "ls"], capture_output=True,
                            text=True, timeout=60)
        print(ls.stdout)
        rows = {int(l.split()[0]): l.split()[1] for l in ls.stdout.splitlines()[1:]}
        assert rows == {ready[0][0]: "0/2", ready[1][0]: "1/2"}
        once = subprocess.run([sys.executable, "-m", "gpumon", "attach", str(p.pid), "--once"],
                              capture_output=True, text=True, timeout=60)
        print(once.stdout)
        assert once.returncode == 0 and "rank 0/2" in once.stdout and "rank 1/2" in once.stdout
    finally:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
