"""The tracker's cost budget: with short steps it replays one step in N, and what it reports
stays true (every step is reported, the run's peak is never lost, the step count is every
step)."""
from __future__ import annotations

import contextlib
import time

import torch

from .helpers import FakeMemory, Net, steps, tracker


class SlowMemory(FakeMemory):
    """A read that costs what a stats call costs on a busy device (~20 us), made 200 us so
    that it dominates a tiny CPU step whatever the machine."""

    def read(self, dev):
        end = time.perf_counter() + 200e-6
        while time.perf_counter() < end:
            pass
        return super().read(dev)


def _run(tr, net, opt, n, x):
    for _ in range(n):
        net(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _clocked_run(n: int, before=None):
    """``n`` steps of 0.1 s on the tracker's own clock (then a forward that reports the last),
    the tracker closed after the caller's checks; ``before(tr)`` runs ahead of the steps."""
    mem = SlowMemory()
    t = [0.0]
    tr, events, _ = tracker(memory=mem, budget=0.001, clock=lambda: t[0], breakdown_interval_s=1.0)
    try:
        if before is not None:
            before(tr)
        net = Net(mem, act=500)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x = torch.randn(4, 8)
        for _ in range(n):
            _run(tr, net, opt, 1, x)
            t[0] += 0.1
        net(x)
        yield tr, events
    finally:
        tr.close()


def test_short_steps_are_sampled_and_counted():
    mem = SlowMemory()
    tr, events, _ = tracker(memory=mem, budget=0.003)
    net = Net(mem, act=500)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    _run(tr, net, opt, 200, x)
    net(x)  # closes the last step
    got = steps(events)
    assert tr.every > 1
    assert tr.steps_done == 200
    assert [s["step"] for s in got] == list(range(1, 201))  # every step, replayed or not
    assert all(s["measured_every"] >= 1 for s in got)
    # the first step set the high-water mark in forward, exactly; later ones stay within it
    assert (got[0]["peak"], got[0]["peak_phase"], got[0]["peak_exact"]) == \
        (mem.peak, "forward", True)
    assert all(s["peak"] <= mem.peak for s in got)
    tr.close()


def test_peak_set_in_a_step_the_budget_skips_is_still_seen_with_its_phase():
    mem = SlowMemory()
    tr, events, _ = tracker(memory=mem, budget=0.003)
    net = Net(mem, act=500)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    _run(tr, net, opt, 60, x)
    assert tr.every > 1
    # find an unmeasured step and raise the high-water mark inside it
    while tr._step.measured:
        _run(tr, net, opt, 1, x)
    # the last step's optimizer step ended (it closes at the next forward); what follows is the
    # next step's first "other" (zero_grad's place)
    step = tr.steps_done + 2
    mem.bump(10**6)
    mem.bump(-10**6)
    _run(tr, net, opt, 3 * tr.every, x)
    b = tr.breakdown_now()["devices"][0]
    assert b["run_peak"] == mem.peak
    # every boundary of every step is read: the phase where the mark rose holds it
    assert (b["run_peak_phase"], b["run_peak_step"]) == ("other", step)
    got = [s for s in steps(events) if s["step"] == step][0]
    assert (got["peak"], got["peak_phase"], got["peak_exact"]) == (mem.peak, "other", True)
    tr.close()


def test_budget_zero_measures_every_step():
    mem = SlowMemory()
    tr, events, _ = tracker(memory=mem, budget=0)
    net = Net(mem, act=500)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    _run(tr, net, opt, 30, x)
    net(x)
    assert tr.every == 1
    assert [s["step"] for s in steps(events)] == list(range(1, 31))
    tr.close()


def test_breakdowns_keep_their_own_rate_when_steps_go_unmeasured(monkeypatch):
    """The breakdown has its own limit (breakdown_interval_s): on an H100 with one step in 280
    measured, the breakdown's roles were 140 steps (15 s) old, labelled "now". The share of
    wall time a walk may take is its other limit (the next test): out of the way here, so a
    slow walk on a loaded machine does not stretch the interval."""
    from gpumon.agent.phases import tracker as tracker_mod

    from .helpers import breakdowns
    monkeypatch.setattr(tracker_mod, "BREAKDOWN_SHARE", 1.0)
    with _clocked_run(200) as (tr, events):
        assert tr.every > 10
        measured = {s["step"] for s in steps(events)}
        late = [b["step"] for b in breakdowns(events) if b["step"] > 3]
        # about one a second over the 19.7 s after the warm-up steps, in unmeasured steps too
        assert 18 <= len(late) <= 21, (late, sorted(measured))
        assert max(b - a for a, b in zip(late, late[1:])) <= 11, late


def test_unasked_breakdowns_keep_to_their_share_of_wall_time(monkeypatch):
    """A walk that takes 5 ms (a big model's on a slow host) runs no more than BREAKDOWN_SHARE
    of the time: at 0.02%, once every 25 s of the program's clock, not once a second."""
    from .helpers import breakdowns

    def slow_walk(tr):
        real = tr.compute_persistent

        def walk(*a, **k):
            end = time.perf_counter() + 5e-3
            while time.perf_counter() < end:
                pass
            return real(*a, **k)
        monkeypatch.setattr(tr, "compute_persistent", walk)
    with _clocked_run(600, before=slow_walk) as (tr, events):  # 60 s of the tracker's clock
        late = [b for b in breakdowns(events) if b["step"] > 3]
        spacing = 5e-3 / 0.0002  # 25 s at 0.02% of wall time
        assert 1 <= len(late) <= 60 / spacing + 1, [b["step"] for b in late]
