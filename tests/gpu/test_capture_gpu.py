"""Snapshot capture and the OOM flight recorder on a real GPU (skipped without CUDA).

Run on the GPU machine:  python -m pytest tests/gpu/test_capture_gpu.py -q -s
Each test starts a real training process with the real agent (torch source) and drives it
through a real client, as `gpumon attach`'s `s` key and `gpumon snapshot` do.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from gpumon import client  # noqa: E402

TRAIN = textwrap.dedent("""
    import os, select, sys, time
    import torch
    if os.environ.get("WITH_GPUMON") == "1":
        import gpumon
        gpumon.start()
    if os.environ.get("USER_RECORDS") == "1":
        torch.cuda.memory._record_memory_history(max_entries=5000)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                  torch.nn.GELU()) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device="cuda")
    print("ready", flush=True)
    deadline = time.time() + 180
    step = 0
    while time.time() < deadline:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        step += 1
        time.sleep(0.02)
        if select.select([sys.stdin], [], [], 0)[0]:
            break
    print("HISTORY_ON", torch._C._cuda_isHistoryEnabled(), flush=True)
""")

OOM = textwrap.dedent("""
    import os, sys
    import torch
    if os.environ.get("WITH_GPUMON") == "1":
        import gpumon
        gpumon.start()
    model = torch.nn.Linear(4096, 4096).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(256, 4096, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
    keep = torch.empty(123 << 20, dtype=torch.uint8, device="cuda")
    try:
        huge = torch.empty(10 << 40, dtype=torch.uint8, device="cuda")  # 10 TiB
    except torch.OutOfMemoryError:
        print("ALLOCATED", torch.cuda.memory_allocated(), flush=True)
        raise
""")


def start_training(tmp_path, **env):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    e = dict(os.environ, WITH_GPUMON="1", **env)
    p = subprocess.Popen([sys.executable, "-c", TRAIN], cwd=work, env=e, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    deadline = time.monotonic() + 60
    while not client.discover(p.pid):
        assert time.monotonic() < deadline, "agent never served"
        time.sleep(0.1)
    p.work = work
    return p


def finish(p) -> str:
    p.stdin.write("stop\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return out


def wait_event(conn, kind, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = conn.recv(timeout=1.0)
        except TimeoutError:
            continue
        assert msg is not None, f"EOF before a {kind} event"
        if msg.get("type") == "event" and msg.get("kind") == kind:
            return msg
    raise AssertionError(f"no {kind} event")


def check_snapshot(path):
    with open(path, "rb") as f:
        data = pickle.load(f)  # plain pickle, as pytorch.org/memory_viz reads it
    assert data["segments"], "no segments"
    trace = data["device_traces"][0]
    actions = {e["action"] for e in trace}
    assert {"alloc", "free_requested", "free_completed"} <= actions, actions
    # every entry is this recording's, with its stack (none of the phases meter's trace-only
    # entries from before it started); torch marks each snapshot taken while it records (the
    # meter reads one at each measured step's end) with a 'snapshot' entry that has no stack
    missing = [(e["action"], e.get("time_us")) for e in trace
               if "frames" not in e and e["action"] != "snapshot"]
    assert not missing, (len(missing), len(trace), missing[:5])
    assert any(f["filename"].endswith(".py") for e in trace for f in e["frames"])
    from gpumon.snapshot import load  # and the view's restricted loader takes it too
    load.loads_plain(open(path, "rb").read())
    return data


def test_capture_steps_during_training(tmp_path):
    p = start_training(tmp_path)
    try:
        conn = client.AgentConnection.connect(client.discover(p.pid)[0], timeout=10)
        t0 = time.monotonic()
        res = conn.request("snapshot_start", {"steps": 3, "who": "gpu test"}, timeout=60)
        assert res["recording"] and not res["user_recording"]
        ev = wait_event(conn, "snapshot")
        print(f"steps=3 snapshot: {ev['entries']} entries, {ev['size']} bytes, "
              f"{time.monotonic() - t0:.2f} s")
        assert ev["ok"] and ev["reason"] == "steps" and ev["steps"] == 3
        assert Path(ev["path"]).parent.parent == p.work / "gpumon-snapshots"
        data = check_snapshot(ev["path"])
        names = [a["name"] for a in data.get("external_annotations", [])]
        print("annotations:", sorted(set(names)))
        meta = json.load(open(ev["path"] + ".json"))
        assert meta["kind"] == "manual" and meta["simulated"] is False
        conn.close()
    finally:
        out = finish(p)
    assert "HISTORY_ON False" in out  # we started it, so we stopped it


def test_capture_start_stop_all_stacks_and_cli(tmp_path):
    p = start_training(tmp_path)
    try:
        conn = client.AgentConnection.connect(client.discover(p.pid)[0], timeout=10)
        conn.request("snapshot_start", {"stacks": "all", "max_entries": 20000}, timeout=60)
        time.sleep(1.0)
        t0 = time.monotonic()
        facts = conn.request("snapshot_stop", {}, timeout=300)
        print(f"stacks=all stop: {facts['entries']} entries, {facts['size']} bytes, dump "
              f"{time.monotonic() - t0:.2f} s")
        check_snapshot(facts["path"])
        conn.close()
        r = subprocess.run([sys.executable, "-m", "gpumon", "snapshot", str(p.pid),
                            "--seconds", "1"], capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stderr
        check_snapshot(r.stdout.strip())
    finally:
        finish(p)


def test_user_recording_is_left_on(tmp_path):
    p = start_training(tmp_path, USER_RECORDS="1")
    try:
        conn = client.AgentConnection.connect(client.discover(p.pid)[0], timeout=10)
        res = conn.request("snapshot_start", {"seconds": 0.5}, timeout=60)
        assert res["user_recording"]
        ev = wait_event(conn, "snapshot")
        check_snapshot(ev["path"])
        conn.close()
    finally:
        out = finish(p)
    assert "HISTORY_ON True" in out  # the program's own recording stays on


def _norm(text: str) -> str:
    # The OOM message's figures (free memory, NVML process usage) may move by a few MiB
    # between two runs; the traceback's shape and words must be identical.
    return re.sub(r"\d+(\.\d+)?", "#", text)


def run_oom(tmp_path, with_gpumon):
    work = tmp_path / ("with" if with_gpumon else "without")
    work.mkdir()
    env = dict(os.environ, WITH_GPUMON="1" if with_gpumon else "0")
    if with_gpumon:
        env["GPUMON_OOM_SNAPSHOT"] = "1"
    r = subprocess.run([sys.executable, "-c", OOM], cwd=work, env=env, capture_output=True,
                       text=True, timeout=300)
    return work, r


def test_oom_flight_recorder(tmp_path):
    work0, plain = run_oom(tmp_path, False)
    work1, gm = run_oom(tmp_path, True)
    assert plain.returncode == gm.returncode == 1
    tb0 = plain.stderr[plain.stderr.index("Traceback"):]
    tb1 = gm.stderr[gm.stderr.index("Traceback"):]
    print("traceback identical:", tb0 == tb1)
    assert _norm(tb0) == _norm(tb1)
    assert "gpumon" not in tb1
    allocated = int(re.search(r"ALLOCATED (\d+)", gm.stdout).group(1))
    files = sorted((work1 / "gpumon-snapshots").rglob("oom-*.pickle"))
    assert len(files) == 1, files
    data = check_snapshot(files[0])
    trace = data["device_traces"][0]
    assert trace[-1]["action"] == "oom" and trace[-1]["size"] == 10 << 40
    live = sum(b["size"] for s in data["segments"] for b in s["blocks"]
               if b["state"] == "active_allocated")
    print(f"OOM: allocated {allocated}, live in snapshot {live}, trace {len(trace)} entries")
    assert live == allocated
    assert sum(s["allocated_size"] for s in data["segments"]) == allocated
    meta = json.load(open(str(files[0]) + ".json"))
    assert meta["kind"] == "oom"
    assert meta["oom"]["requested"] == 10 << 40 and meta["oom"]["allocated"] == allocated
    assert meta["oom"]["device_total"] > meta["oom"]["device_free"] > 0
    # the parameters were allocated after the agent started: the flight recorder saw them
    assert any(e["action"] == "alloc" and e["size"] == 4096 * 4096 * 4 for e in trace)
    assert not list((work0).rglob("*.pickle"))
