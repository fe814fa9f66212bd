"""The steps and phases in snapshot sidecars (issue 17): the tracker's timeline, the sidecar the
snapshot part writes from it (torch and simulated sources), and the hand-over of the exact-peak
meter's history to a recording that starts on top of it."""
from __future__ import annotations

import json
import time

import torch

from gpumon.agent import history as H
from gpumon.agent import phases as P
from gpumon.agent import snapshot as snap
from gpumon.agent.phases.timeline import Timeline

from capture.fakes import Events, FakeMemoryAPI  # tests/capture (tests/ is on sys.path)
from .helpers import Net, steps, tracker


def test_timeline_steps_phases_overlap_and_bound():
    clock = [100.0]
    tl = Timeline(clock=lambda: clock[0], wall=lambda: clock[0] + 1_000_000.0)
    us = lambda t: int(round((t + 1_000_000.0) * 1e6))  # noqa: E731
    # step 1: forward 100.0, backward 100.2, other 100.5, optimizer 100.6, ends 100.7
    for t, p in ((100.0, "forward"), (100.2, "backward"), (100.5, "other"),
                 (100.6, "optimizer"), (100.7, "other")):
        tl.phase(t, p)
    tl.step_end(1, 100.7)
    for t, p in ((100.8, "forward"), (101.0, "backward")):
        tl.phase(t, p)
    clock[0] = 101.1
    out = tl.export()
    assert out["clock"] == "time_us"
    s1, s2 = out["steps"]
    assert (s1["step"], s1["start_us"], s1["end_us"]) == (1, us(100.0), us(100.7))
    assert [(p["phase"], p["start_us"], p["end_us"]) for p in s1["phases"]] == [
        ("forward", us(100.0), us(100.2)), ("backward", us(100.2), us(100.5)),
        ("other", us(100.5), us(100.6)), ("optimizer", us(100.6), us(100.7))]
    # the running step: it began with the "other" entered at the step's end; open ends
    assert (s2["step"], s2["start_us"], s2["end_us"]) == (2, us(100.7), None)
    assert [(p["phase"], p["end_us"]) for p in s2["phases"]] == [
        ("other", us(100.8)), ("forward", us(101.0)), ("backward", None)]
    # only the steps that overlap the window
    assert [s["step"] for s in tl.export(us(100.75), None)["steps"]] == [2]
    assert [s["step"] for s in tl.export(None, us(100.65))["steps"]] == [1]
    assert [s["step"] for s in tl.export(us(100.1), us(100.9))["steps"]] == [1, 2]
    # bounded: the latest steps that fit
    assert [s["step"] for s in tl.export(max_phases=4)["steps"]] == [2]


class UnixTimeAPI(FakeMemoryAPI):
    """The capture part's fake recording API with torch's clock: trace ``time_us`` is unix
    time in microseconds (measured on the H200: within 21 us of time.time())."""

    def alloc(self, size, frames=None):
        a = super().alloc(size, frames)
        if self.recording:
            self.trace[-1]["time_us"] = int(time.time() * 1e6)
        return a

    timeline = snap.TorchBackend.timeline


def train(m, opt, n):
    for _ in range(n):
        m(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_sidecar_has_the_steps_and_phases_of_the_recording(tmp_path):
    tr, ev, _ = tracker()
    old = P._tracker
    P._tracker = tr
    api = UnixTimeAPI()
    rec = snap.Recorder(None, backend=api, broadcast=Events(), pid=1, cwd=str(tmp_path))
    try:
        m = Net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        train(m, opt, 2)                # before the recording: not in it
        rec.start({}, "pid:1")
        api.alloc(512)
        train(m, opt, 3)                # steps 3, 4, 5 (the first of them began at 2's end)
        api.alloc(512)
        first, last = api.trace[0]["time_us"], api.trace[-1]["time_us"]
        facts = rec.stop({}, "pid:1")
        meta = json.loads(open(facts["sidecar"]).read())
        tl = meta["timeline"]
        assert tl["clock"] == "time_us"
        got = [s["step"] for s in tl["steps"]]
        assert got == [3, 4, 5, 6], got   # 6: running at the dump (zero_grad, then idle)
        events = {s["step"]: s for s in steps(ev)}
        for s in tl["steps"][:-1]:
            assert s["end_us"] is not None and s["start_us"] < s["end_us"]
            names = [p["phase"] for p in s["phases"]]
            assert names == ["other", "forward", "backward", "other", "optimizer"], names
            # contiguous, inside the step, and the step ends where torch's clock says
            assert s["phases"][0]["start_us"] == s["start_us"]
            assert s["phases"][-1]["end_us"] == s["end_us"]
            for a, b in zip(s["phases"], s["phases"][1:]):
                assert a["end_us"] == b["start_us"]
            if s["step"] in events:
                assert abs(s["end_us"] - events[s["step"]]["t"] * 1e6) < 50_000
        assert tl["steps"][0]["end_us"] >= first and tl["steps"][-1]["start_us"] <= last
        assert tl["steps"][-1]["end_us"] is None
    finally:
        P._tracker = old
        tr.close()


def test_simulated_snapshot_sidecar_has_its_scripted_steps(tmp_path):
    rec = snap.Recorder(None, backend=snap.SimulatedBackend(None), broadcast=Events(), pid=1,
                        cwd=str(tmp_path))
    rec.start({}, "pid:1")
    facts = rec.stop({}, "pid:1")
    meta = json.loads(open(facts["sidecar"]).read())
    tl = meta["timeline"]
    assert tl["clock"] == "time_us" and tl["steps"]
    with open(facts["path"], "rb") as f:
        data = snap_load(f)
    trace = data["device_traces"][0]
    first, last = trace[0]["time_us"], trace[-1]["time_us"]
    ann = [(a["stage"], a["time_us"]) for a in data["external_annotations"]
           if a["name"].startswith("Optimizer.step")]
    opt = [p for s in tl["steps"] for p in s["phases"] if p["phase"] == "optimizer"]
    # the scripted loop's optimizer phases are torch's Optimizer.step annotations
    assert [(p["start_us"], p["end_us"]) for p in opt] == [
        (a[1], b[1]) for a, b in zip(ann[::2], ann[1::2])]
    for s in tl["steps"]:
        assert s["start_us"] <= last and (s["end_us"] is None or s["end_us"] >= first)
        assert {p["phase"] for p in s["phases"]} <= {"other", "forward", "backward",
                                                     "optimizer"}


def snap_load(f):
    import pickle
    return pickle.load(f)


def test_a_recording_takes_over_the_meters_history():
    class Meter:
        handed = False

        def handed_over(self):
            self.handed = True

    api = FakeMemoryAPI()
    api.recording = True             # the meter's trace-only history, on for a measured step
    m = Meter()
    with H.LOCK:
        H.set_temporary(m)
    try:
        rec = snap.Recorder(None, backend=api, broadcast=Events(), pid=1, cwd="/tmp")
        r = rec.start({"stacks": "python", "max_entries": 777}, "pid:1")
        # not mistaken for the program's own: restarted with the client's settings, and the
        # recording is the client's (stopped at its end), the meter's no more
        assert r["user_recording"] is False and r["note"] is None
        assert ("start", "python", 777) in api.calls
        assert m.handed and not H.temporary()
        assert rec.session.ours
    finally:
        with H.LOCK:
            H.set_temporary(None)


def test_a_recording_that_took_over_leaves_the_meters_entries_out_of_its_file(tmp_path):
    """On the H100 a snapshot started during a measured step held the meter's trace-only
    entries from before it (no "frames": the capture test's frame check raised KeyError, and
    the view showed them as allocations without a stack)."""
    class Meter:
        def handed_over(self):
            pass

    class RestartingAPI(FakeMemoryAPI):
        def start(self, stacks, max_entries):
            # the meter's history records up to the restart (the H100 run's one stackless
            # alloc came after the recording's start time and before its restart)
            self.trace.append({"action": "alloc", "addr": 3, "size": 512, "stream": 0,
                               "time_us": int(time.time() * 1e6)})
            super().start(stacks, max_entries)

    api = RestartingAPI()
    api.recording = True
    before = int((time.time() - 5) * 1e6)
    api.trace.append({"action": "alloc", "addr": 1, "size": 512, "stream": 0,
                      "time_us": before})  # the meter's: no stack
    with H.LOCK:
        H.set_temporary(Meter())
    try:
        rec = snap.Recorder(None, backend=api, broadcast=Events(), pid=1, cwd=str(tmp_path))
        rec.start({"stacks": "python", "out": str(tmp_path / "s.pickle")}, "pid:1")
        frames = [{"filename": "train.py", "line": 7, "name": "main"}]
        api.trace.append({"action": "alloc", "addr": 2, "size": 1024, "stream": 0,
                          "time_us": int(time.time() * 1e6), "frames": frames})
        facts = rec.stop({}, "pid:1")
    finally:
        with H.LOCK:
            H.set_temporary(None)
    with open(facts["path"], "rb") as f:
        trace = snap_load(f)["device_traces"][0]
    assert [e["addr"] for e in trace] == [2] and facts["entries"] == 1
