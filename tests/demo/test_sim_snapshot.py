"""The demo's snapshot tells the story of the live view it was taken from: `gpumon demo`, s, 5 s,
s wrote a file with a 2.65 GiB peak over "0.017 s, 6 steps" (synth.py's own clock and a guessed
scale) while the live view showed 4.18 GiB over 5 s. The simulated source now makes its snapshot
from its own script (agent/sim_snapshot.py): the recording's time span, its steps, and the
script's bytes per role.

Tolerance: SLACK (4 KiB) per role, the script's int() roundings; in practice the peak agrees to
the byte. The samples are taken on a fine grid (1/400 of a step), which hits the script's peaks
(the forward's end) to within that rounding.
"""
import types

import pytest

from gpumon.agent import snapshot_backends
from gpumon.agent.sim_snapshot import SLACK
from gpumon.agent.sources import MiB, SimulatedSource
from gpumon.snapshot import Snapshot, report
from gpumon.snapshot.analysis import NO_STACK

WALL0 = 1_800_000_000.0
GRID = 400  # samples per step


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def wall(self):
        return WALL0 + self.t


def source(clock, **kw):
    kw.setdefault("params", 500 * MiB)
    kw.setdefault("activations", 2600 * MiB)
    return SimulatedSource(devices=[0], step_s=kw.pop("step_s", 1.0), clock=clock,
                           wall=clock.wall, ready=lambda: True, retry_every=25, **kw)


def drive(src, clock, until_s, record_from=None):
    """Samples the source on a fine grid up to until_s; the samples from record_from on."""
    kept = []
    k = int(round(clock.t * GRID / src.step_s))
    while clock.t < until_s:
        d = src.read()[0]
        if record_from is not None and clock.t >= record_from:
            kept.append((clock.t, d["allocated"]))
        k += 1
        clock.t = k * src.step_s / GRID
    return kept


def by_function(tr, i):
    """Bytes live at event i by function (the key without its file: "model.py __init__")."""
    return {g.key.split(".py ", 1)[-1]: g.bytes for g in tr.groups_at(i, by="function")}


@pytest.mark.parametrize("n_steps,step_s", [(5, 1.0), (7, 0.25)])
def test_snapshot_window_matches_the_samples_it_was_taken_from(n_steps, step_s):
    clock = Clock()
    src = source(clock, step_s=step_s)
    drive(src, clock, 12.3 * step_s)  # training for a while before the recording starts
    since_t = clock.t
    samples = drive(src, clock, since_t + n_steps * step_s, record_from=since_t)
    until_t = clock.t
    snap = src.memory_snapshot(WALL0 + since_t, WALL0 + until_t, 100_000)
    s = Snapshot(snap, "sim.pickle")
    tr = s.trace(0)
    # the trace spans the recording, in unix microseconds (the sidecar timeline's clock)
    first, last = tr.time_us[0] / 1e6, tr.time_us[tr.n - 1] / 1e6
    assert WALL0 + since_t <= first < WALL0 + since_t + 0.05 * step_s
    assert WALL0 + until_t - 0.05 * step_s < last <= WALL0 + until_t
    summ = report.summary(s, 0)
    assert summ["duration_s"] == pytest.approx(n_steps * step_s, abs=0.1 * step_s)
    # as many optimizer steps as passed (the window starts at 0.3 of a step: n_steps of them)
    assert summ["steps"] == n_steps
    # the peak: the samples' max allocated (the script's peak, which the fine grid hits)
    top = max(a for _, a in samples)
    assert abs(tr.peak - top) <= SLACK, (tr.peak, top)
    # the roles at the peak: params and AdamW state predate the recording (no stack, as torch
    # shows them), the activations are the forward's, the data batch is live
    t_peak = tr.time_us[tr.peak_index] / 1e6 - WALL0
    step = int(t_peak / step_s + 1e-9)
    roles = src._st[0].roles(step, "backward", 0.0)  # the forward's end: the step's peak
    assert tr.peak == pytest.approx(sum(roles.values()), abs=SLACK)
    g = by_function(tr, tr.peak_index)
    assert g[NO_STACK] == pytest.approx(roles["parameters"] + roles["optimizer_state"], abs=SLACK)
    act = sum(v for k, v in g.items() if k.startswith("Block"))
    assert sorted(k for k in g if k.startswith("Block")) == [f"Block{k}.forward" for k in range(6)]
    assert act + g["main"] == pytest.approx(roles["activations"], abs=SLACK)
    # live when the recording started: the sample then, to within one grid step of the forward
    assert abs(tr.base - samples[0][1]) <= 2600 * 1.05 * MiB / 12


def test_a_recording_from_the_start_names_parameters_and_optimizer_state():
    clock = Clock()
    src = source(clock)
    samples = drive(src, clock, 3.0, record_from=0.0)
    tr = Snapshot(src.memory_snapshot(WALL0, WALL0 + clock.t, 100_000), "sim").trace(0)
    assert abs(tr.peak - max(a for _, a in samples)) <= SLACK
    g = by_function(tr, tr.n - 1)
    assert g["__init__"] == 500 * MiB and g["step"] == 2 * 500 * MiB
    assert NO_STACK not in g


def test_the_ring_keeps_the_last_entries_of_a_long_recording():
    clock = Clock()
    src = source(clock, step_s=0.1)
    drive(src, clock, 200 * 0.1)
    snap = src.memory_snapshot(WALL0, WALL0 + clock.t, 500)
    tr = Snapshot(snap, "sim").trace(0)
    assert tr.n == 500 and tr.time_us[tr.n - 1] / 1e6 > WALL0 + clock.t - 0.1


def test_the_backend_writes_it_labelled_with_a_timeline_that_lines_up(monkeypatch):
    clock = Clock()
    src = source(clock)
    monkeypatch.setattr(snapshot_backends, "time", types.SimpleNamespace(time=clock.wall))
    be = snapshot_backends.SimulatedBackend(src)
    drive(src, clock, 4.5)
    be.start("python", 100_000)
    drive(src, clock, 9.6)
    snap = be.snapshot()
    trace = snap["device_traces"][0]
    assert all(f["filename"].startswith("<simulated>/") for e in trace for f in e["frames"])
    tl = be.timeline(trace[0]["time_us"], trace[-1]["time_us"])
    assert tl["clock"] == "time_us" and [st["step"] for st in tl["steps"]] == [5, 6, 7, 8, 9, 10]
    ann = [a["time_us"] for a in snap["external_annotations"]
           if a["name"].startswith("Optimizer.step")]
    opt = [(p["start_us"], p["end_us"]) for st in tl["steps"] for p in st["phases"]
           if p["phase"] == "optimizer" and p["start_us"] >= trace[0]["time_us"]
           and p["end_us"] is not None]
    assert opt == list(zip(ann[::2], ann[1::2])) and len(opt) == 5
    s = Snapshot(snap, "sim", sidecar={"timeline": tl})
    assert report.summary(s, 0)["steps"] == 5
