"""The simulated source scripts what the phase tracker sends (events=True, as the demo uses it):
step events with exact peaks, breakdown events by role, from the same script as its memory, so
the demo's breakdown, step table and advice have figures without CUDA or torch."""
import pytest

from gpumon.agent import core
from gpumon.agent.sources import MiB, SimulatedSource
from gpumon.model.advice import advise
from gpumon.model.breakdown import BreakdownModel


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def run(monkeypatch):
    """Samples the source at 20 Hz of its clock for `steps` steps; returns (samples, events)."""
    events = []
    monkeypatch.setattr(core, "queue_event", lambda kind, payload: events.append((kind, payload)))

    def go(src, clock, steps):
        samples = []
        while clock.t < steps * src.step_s:
            devs = src.read()
            phase, step = src.phase_step()
            samples.append({"type": "sample", "t": clock.t, "phase": phase, "step": step,
                            "devices": devs})
            clock.t += 0.05
        return samples, events
    return go


def source(clock, **kw):
    kw.setdefault("params", 500 * MiB)
    kw.setdefault("activations", 2600 * MiB)
    return SimulatedSource(devices=[0], step_s=1.0, clock=clock, ready=lambda: True,
                           events=True, output_bytes=600 * MiB, **kw)


def test_each_step_event_has_the_scripts_exact_peak_and_its_phase(run):
    clock = Clock()
    src = source(clock)
    samples, events = run(src, clock, 4)
    steps = [p for k, p in events if k == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    dev = src._st[0]
    for s in steps:
        # brute force over the script: the event's peak is the true maximum of that step
        truth = max((dev.allocated(s["step"] - 1, ph, k / 400), ph)
                    for ph in SimulatedSource.PHASES for k in range(401))
        assert s["peak"] == truth[0] and s["peak_phase"] == truth[1] == "forward"
        assert s["peak_exact"] and s["devices"][0]["peak"] == s["peak"]
        at = s["devices"][0]["at_peak"]
        assert sum(at.values()) == s["peak"]
        assert at["parameters"] == 500 * MiB
        assert at["optimizer_state"] == (0 if s["step"] == 1 else 1000 * MiB)
        # the samples of that step never saw more than the exact peak (they are a lower bound)
        seen = max(x["devices"][0]["allocated"] for x in samples if x["step"] == s["step"])
        assert seen <= s["peak"] and seen > 0.9 * s["peak"]
    # samples count steps from 1, as the step events do
    assert samples[0]["step"] == 1 and samples[-1]["step"] == 4


def test_breakdown_events_split_allocated_by_role_and_feed_the_advice(run):
    clock = Clock()
    src = source(clock)
    samples, events = run(src, clock, 3)
    bds = [p for k, p in events if k == "breakdown"]
    assert 5 <= len(bds) <= 3 * 2 + 3  # phase boundaries: at most two a second, and each new step
    for b in bds:
        d = b["devices"][0]
        now = d["now"]
        assert now["parameters"] + now["gradients"] + now["optimizer_state"] \
            + now["activations"] == d["allocated"]
        assert now["allocator_cache"] == d["reserved"] - d["allocated"]
    m = BreakdownModel()
    for s in samples:
        m.feed(s)
    for kind, p in events:
        m.feed({"type": "event", "kind": kind, **p})
    d = m.main_device()
    assert d.run_peak_phase == "forward" and d.peak_exact and d.at_run_peak
    assert [r.step for r in m.steps] == [1, 2] and all(r.peak_exact for r in m.steps)
    titles = [a.title for a in advise(m)]
    assert any(t.startswith("activations dominate") for t in titles), titles
    assert any(t.startswith("large logits") for t in titles), titles


def test_without_events_the_source_sends_none_and_counts_from_zero(run):
    clock = Clock()
    src = SimulatedSource(devices=[0], step_s=1.0, clock=clock, ready=lambda: True)
    samples, events = run(src, clock, 2)
    assert events == [] and samples[0]["step"] == 0


def test_the_demo_workload_ends_when_its_parent_is_killed(tmp_path):
    """`gpumon demo` starts the workload in a session of its own; a terminal closed under the
    UI (SIGHUP, SIGKILL) must not leave it training."""
    import os
    import signal
    import subprocess
    import sys
    import time
    prog = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-m', 'gpumon.demo', '--build', '0', "
            "'--parent', str(__import__('os').getpid())], start_new_session=True, "
            "stdin=subprocess.DEVNULL)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(60)\n")
    env = {**os.environ, "GPUMON_SOURCE": "simulated"}
    parent = subprocess.Popen([sys.executable, "-c", prog], stdout=subprocess.PIPE, text=True,
                              env=env)
    child = int(parent.stdout.readline())
    try:
        time.sleep(1.0)
        assert os.path.exists(f"/proc/{child}")
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        end = time.monotonic() + 15
        while time.monotonic() < end:
            try:
                with open(f"/proc/{child}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break  # exited (a zombie until init reaps it)
            except FileNotFoundError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the demo workload outlived its parent")
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sampled_peak_is_the_scripts_peak_as_torchs_counter_is(monkeypatch):
    """torch's peak_allocated is its max_memory_allocated, which no sample misses: the demo's
    panel said "peak 4.08 GiB" beside its breakdown's "peak 4.18 GiB in forward" (10 Hz samples
    between the forward's peak moments). Reserved holds what the peak used."""
    monkeypatch.setattr(core, "queue_event", lambda kind, payload: None)
    clock = Clock()
    src = source(clock)
    clock.t = 0.033                       # 10 Hz, off the script's phase boundaries
    samples = []
    while clock.t < 4:
        samples.append(src.read()[0])
        clock.t += 0.1
    dev = src._st[0]
    script = lambda steps: max(dev.allocated(s, ph, k / 400) for s in range(steps)  # noqa: E731
                               for ph in SimulatedSource.PHASES for k in range(401))
    truth = script(3)
    assert max(s["allocated"] for s in samples) < truth - 50 * MiB   # no sample sat on the peak
    assert truth <= samples[-1]["peak_allocated"] <= script(4)
    assert all(s["peak_reserved"] >= s["peak_active"] >= s["peak_allocated"] for s in samples)
