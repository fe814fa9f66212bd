"""Exact per-step peaks (issue 17) on a real CPU training loop whose allocations go through a
fake CUDA caching allocator (fake_cuda.py, written apart from the replay): every measured step
exact, equal to the allocator's own figure, in the right phase, even when the step's peak stays
below an earlier high-water mark; steps that cannot be replayed say so and name no phase; a
history the program or a snapshot turned on is read and never turned off or cleared."""
from __future__ import annotations

import torch

from gpumon.agent import history as H
from gpumon.agent.phases import PhaseTracker

from .fake_cuda import FakeCuda

MiB = 1 << 20
KiB = 1 << 10


class Acts(torch.autograd.Function):
    """Identity whose forward allocates activations (kept for backward) and whose backward
    frees them and allocates the gradients (kept until zero_grad)."""

    @staticmethod
    def forward(ctx, x, net, sizes):
        ctx.net = net
        ctx.ptrs = [net.mem.malloc(s) for s in sizes]
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        net = ctx.net
        if not net.grads:
            net.grads = [net.mem.malloc(s) for s in net.grad_sizes]
        for p in reversed(ctx.ptrs):
            net.mem.free(p)
        return g, None, None


class Net(torch.nn.Module):
    def __init__(self, mem: FakeCuda, plan) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.mem, self.plan, self.calls = mem, plan, 0
        self.grad_sizes = [3 * MiB, 2 * MiB + 300, 8 * KiB]
        self.grads: list = []
        self.params = [mem.malloc(s) for s in (3 * MiB, 2 * MiB + 300, 8 * KiB)]

    def forward(self, x):
        p = self.plan(self.calls)
        self.calls += 1
        h = Acts.apply(torch.relu(self.a(x)), self, p["acts"])
        tmp = [self.mem.malloc(s) for s in p["fwd_tmp"]]  # gone before forward returns
        for q in reversed(tmp):
            self.mem.free(q)
        return self.b(h)


class Opt(torch.optim.SGD):
    """SGD whose step makes foreach-like temporaries (and state at the first step), and whose
    zero_grad frees the fake gradients."""

    def __init__(self, net: Net, plan) -> None:
        super().__init__(net.parameters(), lr=0.01)
        self.net, self.plan_, self.state_ptrs, self.n = net, plan, [], 0

    def step(self, closure=None):
        p = self.plan_(self.n)
        self.n += 1
        mem = self.net.mem
        if not self.state_ptrs:
            self.state_ptrs = [mem.malloc(s) for s in (6 * MiB, 4 * MiB + 600)]
        tmp = [mem.malloc(s) for s in p["opt_tmp"]]
        for q in reversed(tmp):
            mem.free(q)
        return super().step(closure)

    def zero_grad(self, set_to_none=True):
        for q in self.net.grads:
            self.net.mem.free(q)
        self.net.grads = []
        return super().zero_grad(set_to_none)


def plan(k: int) -> dict:
    """Step 1 has a warm-up spike far above anything later (the run's high-water mark). Later
    steps peak below it, alternately in forward and in the optimizer step; the optimizer's
    temporaries shrink a little each step, so they land in the free block the previous step
    left and keep an unsplit remainder (block size != the rounded request)."""
    if k == 0:
        return {"acts": [40 * MiB, 30 * MiB], "fwd_tmp": [400 * MiB], "opt_tmp": [50 * MiB]}
    fwd_heavy = k % 2 == 1
    return {"acts": [40 * MiB + k * 1000, (60 if fwd_heavy else 20) * MiB + 7],
            "fwd_tmp": [(30 if fwd_heavy else 2) * MiB],
            "opt_tmp": [50 * MiB - k * 200 * KiB, 24 * MiB + 3 * k]}


def make(mem: FakeCuda, budget=0, **kw):
    events: list = []
    tr = PhaseTracker(torch, lambda k, p: events.append((k, p)), lambda: [0], mem,
                      history=mem, budget=budget, **kw)
    tr.install_hooks()
    return tr, events


def run(mem: FakeCuda, net: Net, opt: Opt, n: int) -> list:
    """n training steps; returns the fake allocator's event count at the tracker's phase
    boundaries of each step: (step start, forward, backward, optimizer start, step end)."""
    x = torch.randn(4, 8)
    out = []
    start = mem.seq
    for _ in range(n):
        f0 = mem.seq
        y = net(x).sum()
        b0 = mem.seq
        y.backward()
        o0 = mem.seq
        opt.step()
        o1 = mem.seq
        out.append((start, f0, b0, o0, o1))
        opt.zero_grad()
        start = o1
    return out


def truth_span(mem: FakeCuda, a: int, b: int) -> int:
    """max_memory_allocated over events [a, b) after a reset at a."""
    first = mem.truth[a - 1] if a > 0 else 0
    return max([first] + mem.truth[a:b])


def expected(mem: FakeCuda, spans) -> list:
    out = []
    for k, (s, f0, b0, o0, o1) in enumerate(spans):
        ph = {"forward": truth_span(mem, f0, b0), "backward": truth_span(mem, b0, o0),
              "optimizer": truth_span(mem, o0, o1),
              # between backward's end and the optimizer step (nothing happens there), and
              # zero_grad with the rest before the next forward
              "other": truth_span(mem, o0, o0)}
        if k:
            ph["other"] = max(ph["other"], truth_span(mem, s, f0))
        peak = max(ph.values())
        out.append((peak, {p for p, v in ph.items() if v == peak}, ph))
    return out


def steps(events):
    return [p for k, p in events if k == "step"]


def test_every_step_exact_in_its_phase_below_an_earlier_high_water_mark():
    mem = FakeCuda()
    tr, ev = make(mem)
    try:
        net = Net(mem, plan)
        opt = Opt(net, plan)
        spans = run(mem, net, opt, 8)
        tr.mark("end")  # closes the last step
        got = steps(ev)
        want = expected(mem, spans)
        assert [s["step"] for s in got] == list(range(1, 9))
        # the step-1 spike set a high-water mark no later step reaches
        assert all(w[0] < want[0][0] for w in want[1:])
        assert {next(iter(w[1])) for w in want[1:]} == {"forward", "optimizer"}
        for s, (peak, phases, ph) in zip(got, want):
            assert s["peak_exact"] is True and s["exact_note"] is None, s
            assert s["peak"] == peak, (s["step"], s["peak"], peak)
            assert s["peak_phase"] in phases, (s["step"], s["peak_phase"], phases)
            d = s["devices"][0]
            for p, v in ph.items():
                assert d["phase_peaks"][p] == v and d["phase_peaks_exact"][p] is True
        # unsplit remainders happened (the replay had to find them), and the history stays off
        blocks = [b for seg in mem.segments for b in seg["blocks"]]
        assert any(b[1] - ((b[2] + 511) // 512 * 512) > 0 for b in blocks if b[2])
        assert mem.recording  # ours: on for the next step, which is measured too
    finally:
        tr.close()
    assert not mem.recording and mem.starts == mem.stops == 1  # one history for all 8 steps


def test_the_peak_is_never_reset_and_the_history_is_off_between_measured_steps():
    mem = FakeCuda()
    tr, ev = make(mem, budget=0.003)
    tr.every = 4
    tr._budget = None  # keep one in four: the test sets the rate
    tr._warm_steps = 1
    try:
        net = Net(mem, plan)
        opt = Opt(net, plan)
        on_during = []
        x = torch.randn(4, 8)
        for _ in range(12):
            net(x).sum().backward()
            opt.step()
            on_during.append(mem.recording)
            opt.zero_grad()
        tr.mark("end")
        got = steps(ev)
        # every step reported; replayed: step 1, then 1 in 4; each exact; the history was on
        # only around them
        assert [s["step"] for s in got] == list(range(1, 13))
        assert [s["step"] for s in got if s["replayed"]] == [1, 5, 9]
        assert all(s["peak_exact"] for s in got if s["replayed"])
        # on from the end of the step before a measured one to that step's end only
        assert [k for k, on in enumerate(on_during, 1) if on] == [1, 4, 5, 8, 9, 12]
        assert mem.peak == max(mem.truth)  # torch's own peak: the program's, untouched
    finally:
        tr.close()
    assert not mem.recording and mem.starts == mem.stops == 4


def test_a_history_that_loses_entries_gives_no_phase_and_says_why():
    mem = FakeCuda()
    tr, ev = make(mem)
    try:
        net = Net(mem, plan)
        opt = Opt(net, plan)
        run(mem, net, opt, 2)
        mem.lose_entries = True
        run(mem, net, opt, 3)
        tr.mark("end")
        got = steps(ev)
        assert got[0]["peak_exact"] and got[1]["peak_exact"]
        for s in got[3:]:  # step 3 may still have been read before the loss
            assert s["peak_exact"] is False and s["peak_phase"] is None
            assert s["devices"][0]["peak_phase"] is None
            assert s["exact_note"], s
            assert s["peak"] is not None  # a lower bound: the boundary figures
    finally:
        tr.close()


def test_the_programs_own_history_is_read_not_changed():
    mem = FakeCuda()
    mem.record(context=True, max_entries=100_000)
    tr, ev = make(mem)
    try:
        net = Net(mem, plan)
        opt = Opt(net, plan)
        before = len(mem.trace)
        spans = run(mem, net, opt, 5)
        tr.mark("end")
        got = steps(ev)
        want = expected(mem, spans)
        assert all(s["peak_exact"] for s in got)
        assert [s["peak"] for s in got] == [w[0] for w in want]
        assert mem.recording and mem.context and mem.max_entries == 100_000
        assert mem.starts == mem.stops == mem.clears == 0
        assert len(mem.trace) > before and mem.trace[0]["frames"]  # nothing cleared
    finally:
        tr.close()
    assert mem.recording  # not ours: closing the tracker leaves it on


def test_a_snapshot_recording_taking_over_mid_step_is_left_on():
    mem = FakeCuda()
    tr, ev = make(mem)
    try:
        net = Net(mem, plan)
        opt = Opt(net, plan)
        run(mem, net, opt, 2)
        assert mem.recording  # ours, for the next measured step
        with H.LOCK:  # what the snapshot part does when a client starts a recording
            assert H.take_over()
            mem.record(context=True, max_entries=100_000)
        run(mem, net, opt, 3)
        tr.mark("end")
        assert mem.recording and mem.context  # theirs now: never stopped or cleared by us
        assert all(s["peak_exact"] for s in steps(ev))
    finally:
        tr.close()
    assert mem.recording


def test_roles_at_the_peak_count_what_lives_at_that_moment():
    """The role walk sees the real (CPU) tensors; map the fake gradient blocks to them so the
    replay can tell which gradients existed at the peak."""
    mem = FakeCuda()
    tr, ev = make(mem)
    try:
        net = Net(mem, plan)
        opt = Opt(net, plan)
        walked = []

        def fake_walk(pointers=None):
            # two persistent roles at fake addresses: the parameters (alive all along) and
            # the gradients (allocated during backward, freed at zero_grad)
            per = {0: {"parameters": 123, "gradients": 0, "optimizer_state": 0}}
            if pointers is not None:
                pointers[0] = {net.params[0]: ("parameters", 123)}
                for q in net.grads:
                    pointers[0][q] = ("gradients", 7)
                walked.append(len(net.grads))
            return per, 1
        tr.compute_persistent = fake_walk
        run(mem, net, opt, 4)
        tr.mark("end")
        got = steps(ev)
        for s in got:
            at = s["devices"][0]["at_peak"]
            assert at is not None and at["parameters"] == 123
            # gradients exist in the optimizer step (3 fake tensors) but not in forward
            assert at["gradients"] == (21 if s["peak_phase"] == "optimizer" else 0), s
            assert at["activations"] == s["peak"] - at["parameters"] - at["gradients"]
        assert walked and all(n == 3 for n in walked)  # walked where the step ends
    finally:
        tr.close()


def test_the_last_step_of_a_run_is_measured_when_the_tracker_closes():
    """On the H100 the run's last step (its optimizer step done, the program then exiting)
    was reported after the meter had been released: not exact, and with no note saying why."""
    mem = FakeCuda()
    tr, ev = make(mem)
    try:
        net = Net(mem, plan)
        opt = Opt(net, plan)
        spans = run(mem, net, opt, 3)
    finally:
        tr.close()  # no mark after the last step: close() reports it
    got = steps(ev)
    want = expected(mem, spans)
    assert [s["step"] for s in got] == [1, 2, 3]
    last = got[-1]
    assert last["peak_exact"] is True and last["exact_note"] is None, last
    assert last["peak"] == want[-1][0] and last["peak_phase"] in want[-1][1]
    assert not mem.recording
