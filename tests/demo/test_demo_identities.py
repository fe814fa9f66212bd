"""The identities a user checks on the demo's screen (issue 32 item 7), over a scripted run long
enough for two cache flushes (alloc retries): every figure agrees with the others.

- cudaMalloc and free are counted in one unit (segments): frees <= mallocs, and the live
  segments are mallocs - frees (the demo showed `cudaMalloc 430` beside `free 2,037`);
- the breakdown at the end of a phase holds what that phase left: gradients exist after the
  optimizer step (it showed `gradients 0 B` "at end of optimizer");
- one step counter: a sample's step is the step in progress, one past the last step event."""
from gpumon.agent.sources import MiB

from .test_scripted_events import Clock, run, source  # noqa: F401 (run is a fixture)


def test_malloc_free_and_segments_are_one_unit_and_add_up(run):
    clock = Clock()
    src = source(clock, retry_every=3)
    samples, _ = run(src, clock, 10)
    retries = 0
    for s in samples:
        d = s["devices"][0]
        assert d["device_free"] <= d["device_alloc"], d
        assert d["segments"] == d["device_alloc"] - d["device_free"], d
        assert d["reserved"] >= d["allocated"]
        retries = d["alloc_retries"]
    assert retries >= 2 and samples[-1]["devices"][0]["device_free"] > 0  # flushes happened


def test_the_breakdown_at_a_phase_end_is_what_that_phase_left(monkeypatch):
    """At the agent's 10 Hz, the 50 ms zero_grad falls between two samples: the breakdown sent
    as the optimizer phase ends was read in the next step's data phase, gradients 0 B."""
    from gpumon.agent import core
    events = []
    monkeypatch.setattr(core, "queue_event", lambda kind, payload: events.append((kind, payload)))
    clock = Clock()
    src = source(clock)
    while clock.t < 8.0:
        src.read()
        clock.t += 0.1
    ends = [p for k, p in events if k == "breakdown"]
    after_opt = [p["devices"][0]["now"] for p in ends if p["phase"] == "optimizer"]
    assert after_opt
    for roles in after_opt:  # the optimizer step leaves the gradients (zero_grad frees them)
        assert roles["gradients"] == 500 * MiB, roles
        assert roles["optimizer_state"] == 2 * 500 * MiB
    for p in ends:  # and each end's roles add up to its allocated bytes
        d = p["devices"][0]
        assert d["allocated"] == sum(d["now"][r] for r in ("parameters", "gradients",
                                                           "optimizer_state", "activations"))


def test_one_step_counter_for_samples_and_step_events(run):
    clock = Clock()
    src = source(clock)
    samples, events = run(src, clock, 5)
    ends = {}
    for k, p in events:
        if k == "step":
            ends[p["step"]] = p
    assert sorted(ends) == [1, 2, 3, 4]
    # each sample's step: in progress, i.e. after step N's event the samples say N + 1
    by_step = {}
    for s in samples:
        by_step.setdefault(s["step"], []).append(s["t"])
    assert sorted(by_step) == [1, 2, 3, 4, 5]
    for n in (1, 2, 3, 4):
        assert max(by_step[n]) < min(by_step[n + 1])
