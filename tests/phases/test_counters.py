"""Issue 35: every step's exact peak from torch's peak counters, reset at every phase boundary,
while the program's own view of the counters stays what it would be without gpumon.

Runs on the fake CUDA allocator (fake_cuda.py: torch's counter semantics, torch's own Python
readers on top with ``as_torch_cuda``); tests/gpu/test_counters_gpu.py runs a training program
and a Hugging Face Trainer through it on a GPU.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

from gpumon.agent.phases import PhaseTracker
from gpumon.agent.phases.counters import FIRST, RACE, UNSEEN_RESET, PeakCounters

from .fake_cuda import FakeCuda, as_torch_cuda
from .test_exact import Net, Opt, expected, plan, run, steps

MiB = 1 << 20


def peaks(stats: dict) -> dict:
    """Every counter's peak in a nested stats dict."""
    out = {}
    for k, v in stats.items():
        if isinstance(v, dict):
            if "peak" in v:
                out[k] = v["peak"]
            else:
                for k2, v2 in v.items():
                    out[(k, k2)] = v2["peak"]
    return out


@pytest.mark.parametrize("read_every", [1, 1000])
def test_random_boundaries_and_program_resets_leave_the_program_view_exact(read_every):
    """Twin allocators, one under gpumon's boundaries: every read the program makes (every
    counter's peak) equals the twin's, through gpumon's resets and the program's own. Read
    rarely (1000): more than FOLD_AT of gpumon's reads wait unfolded between two of the
    program's, and are folded at the cap and at the read."""
    rng = random.Random(7)
    a, b = FakeCuda(), FakeCuda()
    pc = PeakCounters(a.C)
    pc.install()
    stats = a.C._cuda_memoryStats
    assert stats is not a.stats  # wrapped
    live: list = []
    last_boundary = len(a.truth)
    phase_peaks = 0
    for i in range(3000):
        r = rng.random()
        if r < 0.45 or not live:
            n = rng.choice([100, 5000, 700_000, 3 * MiB, 12 * MiB + 7, 40 * MiB])
            live.append((a.malloc(n), b.malloc(n)))
        elif r < 0.85:
            pa, pb = live.pop(rng.randrange(len(live)))
            a.free(pa)
            b.free(pb)
        elif r < 0.93:
            reads, nxt, why = pc.boundary(0)
            # the ended phase's own peak: max of allocated over its events (and its start)
            start = a.truth[last_boundary - 1] if last_boundary else 0
            truth = max([start] + a.truth[last_boundary:])
            assert reads[1] == truth
            assert why in (None, FIRST)
            last_boundary = len(a.truth)
            phase_peaks += 1
        elif r < 0.96:
            a.C._cuda_resetPeakMemoryStats(0)  # the program's own reset
            b.reset_peak_stats(0)
        if i % read_every == read_every - 1 or r >= 0.96:
            assert peaks(stats(0)) == peaks(b.stats(0)), i
    assert peaks(stats(0)) == peaks(b.stats(0))
    assert phase_peaks > 100
    pc.boundary(0)  # a read kept unfolded when gpumon stops
    pc.uninstall()
    assert not pc.s.unfolded  # nothing of the reads stays in the program once gpumon stops
    assert peaks(stats(0)) == peaks(b.stats(0))


def test_reads_kept_unfolded_are_capped_and_the_view_stays_exact():
    """gpumon keeps each boundary's peaks (a tuple, not the read) until the program reads: at
    FOLD_AT of them they are folded, so a program that never reads holds at most FOLD_AT; the
    peaks it reads after thousands of boundaries are its twin's, every counter of them."""
    from gpumon.agent.phases.counters import FOLD_AT
    rng = random.Random(3)
    a, b = FakeCuda(), FakeCuda()
    pc = PeakCounters(a.C)
    pc.install()
    live: list = []
    for i in range(3 * FOLD_AT + 17):
        n = rng.choice([100, 5000, 700_000, 3 * MiB, 40 * MiB])
        live.append((a.malloc(n), b.malloc(n)))
        if len(live) > 6 or rng.random() < 0.3:
            pa, pb = live.pop(rng.randrange(len(live)))
            a.free(pa)
            b.free(pb)
        pc.boundary(0)
        kept = pc.s.unfolded.get(0, [])
        assert len(kept) < FOLD_AT
        assert all(isinstance(pk, tuple) for _, pk in kept)  # no read dict is kept
    assert peaks(a.C._cuda_memoryStats(0)) == peaks(b.stats(0))
    pc.uninstall()


def test_a_read_of_another_scheme_is_kept_by_its_own_keys():
    """The peaks are taken from each read by the first read's keys; a read without one of them
    is taken by its own keys, and the program still reads every counter's highest peak since its
    last reset."""
    class C:
        def __init__(self):
            self.cur = {"allocated_bytes": 5, "reserved_bytes": 8, "requested_bytes": 3}
            self.peak = dict(self.cur)
            self.names = list(self.cur)

        def _cuda_memoryStats(self, dev):
            return {n: {"all": {"current": self.cur[n], "peak": self.peak[n], "allocated": 9,
                                "freed": 4}} for n in self.names}

        def _cuda_resetPeakMemoryStats(self, dev):
            self.peak = dict(self.cur)
    c = C()
    pc = PeakCounters(c)
    pc.install()
    c.peak = {"allocated_bytes": 100, "reserved_bytes": 8, "requested_bytes": 90}
    pc.boundary(0)
    c.names = ["allocated_bytes", "reserved_bytes"]  # a read without requested_bytes
    c.peak["allocated_bytes"] = 60
    reads, _, _ = pc.boundary(0)
    assert reads[1] == 60
    c.names = list(c.cur)
    st = c._cuda_memoryStats(0)  # through gpumon's wrapper: the program's view
    assert st["allocated_bytes"]["all"]["peak"] == 100
    assert st["requested_bytes"]["all"]["peak"] == 90
    pc.uninstall()


def test_a_program_read_between_take_and_settle_sees_the_peaks_of_before_the_reset():
    """A forward's start takes the counters (read, reset, read) and settles later: a program
    that reads in between (inside that forward) gets the taken read's peaks folded in whole,
    a transient of the ended phase included, which only that read holds."""
    a, b = FakeCuda(), FakeCuda()
    pc = PeakCounters(a.C)
    pc.install()
    stats = a.C._cuda_memoryStats
    keep = [(a.malloc(3 * MiB), b.malloc(3 * MiB))]
    pc.boundary(0)
    for m in (a, b):  # the ended phase's transient: above anything folded so far
        m.free(m.malloc(40 * MiB))
    taken = pc.take(0)
    assert stats(0)["allocated_bytes"]["all"]["peak"] == 40 * MiB + 3 * MiB
    assert peaks(stats(0)) == peaks(b.stats(0))
    reads, nxt, why = pc.settle(0, taken)
    assert reads[1] == 43 * MiB and why is None
    assert peaks(stats(0)) == peaks(b.stats(0))
    for pa, pb in keep:
        a.free(pa)
        b.free(pb)
    pc.uninstall()


def test_a_program_reset_mid_phase_costs_gpumon_nothing():
    m = FakeCuda()
    pc = PeakCounters(m.C)
    pc.install()
    pc.boundary(0)
    p = m.malloc(50 * MiB)
    m.free(p)                             # the phase's peak: 50 MiB, before the reset
    m.C._cuda_resetPeakMemoryStats(0)     # the program resets mid-phase
    q = m.malloc(10 * MiB)
    assert m.C._cuda_memoryStats(0)["allocated_bytes"]["all"]["peak"] == 10 * MiB  # its view
    reads, _, why = pc.boundary(0)
    assert (reads[1], why) == (50 * MiB, None)
    m.free(q)
    pc.uninstall()


def test_a_reset_gpumon_cannot_see_marks_the_phase():
    """A reset through a reference to the original entry point (C++ code, a reference taken
    before gpumon started) lowers the peak under the phase's start: not exact, said why."""
    m = FakeCuda()
    keep = m.malloc(30 * MiB)
    pc = PeakCounters(m.C)
    pc.install()
    pc.boundary(0)
    m.free(keep)
    m.reset_peak_stats(0)                 # the original, unseen by the wrappers
    reads, _, why = pc.boundary(0)
    assert why == UNSEEN_RESET and reads[1] < 30 * MiB
    pc.uninstall()


def test_allocations_on_another_thread_at_a_boundary_mark_the_phase():
    m = FakeCuda()
    orig_reset = m.C._cuda_resetPeakMemoryStats
    window = []

    def reset_with_a_neighbour(dev):
        if window:  # another thread allocates between gpumon's read and its reset
            window.append(m.malloc(window.pop()))
        return orig_reset(dev)
    m.C._cuda_resetPeakMemoryStats = reset_with_a_neighbour
    pc = PeakCounters(m.C)
    pc.install()
    pc.boundary(0)
    p = m.malloc(MiB)
    window.append(80 * MiB)
    reads, _, why = pc.boundary(0)
    assert why == RACE and pc.races == 1
    assert pc.status()["program_view_may_be_low_by"]
    # a window whose events cannot exceed the phase's peak is fine
    m.free(window.pop())
    m.free(p)
    q = m.malloc(200 * MiB)
    m.free(q)
    window.append(MiB)
    _, _, why = pc.boundary(0)
    assert why is None
    pc.uninstall()


def test_the_wrappers_stay_until_the_program_resets_then_are_gone():
    m = FakeCuda()
    orig = (m.C._cuda_memoryStats, m.C._cuda_resetPeakMemoryStats)
    pc = PeakCounters(m.C)
    pc.install()
    p = m.malloc(64 * MiB)
    m.free(p)
    pc.boundary(0)                         # the real peak is reset to 0 here
    pc.uninstall()                         # the agent stops
    assert m.C._cuda_memoryStats is not orig[0]
    assert m.C._cuda_memoryStats(0)["allocated_bytes"]["all"]["peak"] == 64 * MiB
    m.C._cuda_resetPeakMemoryStats(0)
    assert (m.C._cuda_memoryStats, m.C._cuda_resetPeakMemoryStats) == orig
    # never reset by gpumon: removed at once
    m2 = FakeCuda()
    orig2 = m2.C._cuda_memoryStats
    pc2 = PeakCounters(m2.C)
    pc2.install()
    pc2.uninstall()
    assert m2.C._cuda_memoryStats is orig2


def test_wrappers_keep_the_originals_errors_and_names():
    m = FakeCuda()
    pc = PeakCounters(m.C)
    name = m.C._cuda_memoryStats.__name__
    pc.install()
    assert m.C._cuda_memoryStats.__name__ == name
    with pytest.raises(RuntimeError, match="Invalid device"):
        m.C._cuda_memoryStats(3)
    with pytest.raises(RuntimeError, match="Invalid device"):
        m.C._cuda_resetPeakMemoryStats(3)
    with pytest.raises(TypeError):
        m.C._cuda_memoryStats("x")
    pc.uninstall()


def test_a_reader_thread_always_sees_the_true_peak():
    """The program reads on another thread while gpumon resets at boundaries: every read's
    peak is the true maximum of allocated up to the events it counts."""
    m = FakeCuda()
    pc = PeakCounters(m.C)
    pc.install()
    stop = threading.Event()
    bad: list = []
    reads = [0]

    def reader():
        while not stop.is_set():
            s = m.C._cuda_memoryStats(0)
            n = s["allocation"]["all"]["allocated"] + s["allocation"]["all"]["freed"]
            truth = max(m.truth[:n], default=0)
            if s["allocated_bytes"]["all"]["peak"] != truth:
                bad.append((n, s["allocated_bytes"]["all"]["peak"], truth))
            reads[0] += 1
    t = threading.Thread(target=reader)
    t.start()
    rng = random.Random(3)
    live = []
    try:
        for i in range(4000):
            if rng.random() < 0.5 or not live:
                live.append(m.malloc(rng.choice([1000, 2 * MiB, 30 * MiB])))
            else:
                m.free(live.pop(rng.randrange(len(live))))
            if i % 7 == 0:
                pc.boundary(0)
    finally:
        stop.set()
        t.join()
        pc.uninstall()
    assert reads[0] > 50 and not bad, bad[:3]


# ---- the tracker on a real CPU training loop, the fake allocator underneath -------------------
def make(mem: FakeCuda, counters: PeakCounters, budget=0.001, **kw):
    events: list = []
    kw.setdefault("history", mem)
    tr = PhaseTracker(torch, lambda k, p: events.append((k, p)), lambda: [0], counters,
                      budget=budget, **kw)
    tr.install_hooks()
    return tr, events


def assert_exact_in_phase(got: list, mem: FakeCuda, spans: list) -> None:
    """Every step's peak exact, equal to the truth and in its phase, and each phase's own
    peak (but the step's trailing "other") exact and equal to the truth."""
    for s, (peak, phases, ph) in zip(got, expected(mem, spans)):
        assert s["peak_exact"] and s["peak"] == peak and s["peak_phase"] in phases, s
        d = s["devices"][0]
        for name, v in ph.items():
            if name != "other":
                assert d["phase_peaks"][name] == v and d["phase_peaks_exact"][name], name


def test_every_step_exact_and_in_its_phase_whatever_the_replay_budget():
    mem = FakeCuda()
    pc = PeakCounters(mem.C)
    tr, ev = make(mem, pc, budget=0.001)
    tr.every, tr._budget, tr._warm_steps = 4, None, 1   # the replay: one step in four
    try:
        net = Net(mem, plan)
        opt = Opt(net, plan)
        spans = run(mem, net, opt, 12)
        tr.mark("end")
        got = steps(ev)
        assert [s["step"] for s in got] == list(range(1, 13))
        assert [s["step"] for s in got if s["replayed"]] == [1, 5, 9]
        assert_exact_in_phase(got, mem, spans)
        # steps 2.. peak below step 1's warm-up spike, alternately in forward and optimizer
        assert {s["peak_phase"] for s in got[1:]} == {"forward", "optimizer"}
        assert all(s["peak"] < got[0]["peak"] for s in got[1:])
        # the forwards the replay does not follow (it follows a replayed step and the forward
        # that closes it: steps 1-2, 5-6, 9-10) began with only the counters' read-reset-read
        # (the rest settled after it): both paths, the same figures
        assert tr.early_starts == 6
    finally:
        tr.close()


def test_a_forward_start_resets_the_counters_and_leaves_the_rest_for_after_its_launches():
    """At a root forward's start (the GPU idle after a sync in many loops) only the counters'
    read-reset-read runs: inside the forward the counters are already reset (the forward's
    peak starts there), the step that ended is not closed or reported yet, and a sample says
    forward and the new step; when the forward returns the step arrives, exact, and each
    phase's peak is the truth."""
    mem = FakeCuda()
    pc = PeakCounters(mem.C)
    tr, ev = make(mem, pc, budget=None, history=None)
    seen: list = []

    class Probe(Net):
        def forward(self, x):
            y = super().forward(x)
            seen.append({"pending": tr._early is not None, "done": tr.steps_done,
                         "reported": len(steps(ev)), "sample": tr.sample_extra(),
                         "segment_closed_for": tr._label})
            return y
    try:
        net = Probe(mem, plan)
        opt = Opt(net, plan)
        spans = run(mem, net, opt, 6)
        tr.mark("end")
        got = steps(ev)
        assert [s["step"] for s in got] == [1, 2, 3, 4, 5, 6]
        for k, s in enumerate(seen[1:], start=1):
            # step k+1's forward: taken early, step k not closed, not reported
            assert s["pending"] and s["done"] == k - 1 and s["reported"] == k - 1, s
            assert s["segment_closed_for"] == "other"  # the ended segment not settled yet
            assert s["sample"] == {"phase": "forward", "step": k + 1}, s
        assert not seen[0]["pending"]  # the run's first forward: nothing to take early
        assert tr.early_starts == 5
        assert_exact_in_phase(got, mem, spans)
    finally:
        tr.close()


def program(mem: FakeCuda, out: list) -> None:
    """A training program that reads torch's counters at many points through torch's own API
    and resets them itself now and then (what a user's logging does)."""
    cuda = torch.cuda

    def say(where):
        s = cuda.memory_stats()
        out.append((where, cuda.max_memory_allocated(), cuda.max_memory_reserved(),
                    cuda.memory_allocated(), {k: v for k, v in s.items() if ".peak" in k},
                    cuda.memory_summary()))
        out.append((where, torch.cuda.memory.max_memory_allocated(0),
                    cuda.memory_stats_as_nested_dict(0)["active_bytes"]["all"]["peak"]))

    class Logged(Net):
        def forward(self, x):
            y = super().forward(x)
            say("inside forward")
            return y
    net = Logged(mem, plan)
    opt = Opt(net, plan)
    x = torch.randn(4, 8)
    for k in range(8):
        y = net(x).sum()
        say("after forward")
        y.backward()
        say("after backward")
        if k == 3:
            cuda.reset_peak_memory_stats()
            say("after reset")
        opt.step()
        say("after step")
        opt.zero_grad()
        if k == 5:
            with pytest.warns(FutureWarning):
                cuda.reset_max_memory_allocated()
        say("end of step")


@pytest.mark.parametrize("replay", [True, False])
def test_the_programs_view_is_the_same_with_and_without_gpumon(replay):
    """``replay`` off: every forward's start taken early, so the program's reads inside the
    forward come between gpumon's reset and its bookkeeping of it."""
    plain: list = []
    mem = FakeCuda()
    with as_torch_cuda(torch, mem):
        program(mem, plain)
    watched: list = []
    mem2 = FakeCuda()
    with as_torch_cuda(torch, mem2):
        pc = PeakCounters(torch._C)     # as on a GPU: torch._C's entry points wrapped
        tr, ev = make(mem2, pc, budget=0, **({} if replay else {"history": None}))
        try:
            program(mem2, watched)
            tr.mark("end")
        finally:
            tr.close()
        assert pc.boundaries > 30       # gpumon did reset the real counters, many times
        assert (tr.early_starts == 0) == replay
        got = steps(ev)
        assert len(got) == 8 and all(s["peak_exact"] for s in got)
    assert len(plain) == len(watched) > 50
    for p, w in zip(plain, watched):
        assert p == w


def test_no_cuda_device_no_counters_steps_still_reported_with_the_reason():
    from .helpers import Net as CpuNet
    events: list = []
    tr = PhaseTracker(torch, lambda k, p: events.append((k, p)), lambda: ["cpu"], None)
    tr.counters_note = "no CUDA allocator counters (a CPU device or a simulated source)"
    tr.install_hooks()
    try:
        net = CpuNet()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x = torch.randn(4, 8)
        for _ in range(3):
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()
        net(x)
        got = steps(events)
        assert [s["step"] for s in got] == [1, 2, 3]
        for s in got:
            assert s["peak_exact"] is False and s["peak_phase"] is None
            assert "CPU device" in s["exact_note"]
    finally:
        tr.close()


def test_another_allocator_backend_leaves_the_counters_alone_and_says_so():
    class FakeTorch:
        __version__ = "2.11.0"

        class cuda:
            @staticmethod
            def get_allocator_backend():
                return "cudaMallocAsync"
    mem = FakeCuda()
    orig = mem.C._cuda_memoryStats
    pc = PeakCounters(mem.C, torch_mod=FakeTorch)
    events: list = []
    tr = PhaseTracker(torch, lambda k, p: events.append((k, p)), lambda: [0], pc)
    tr.install_hooks()
    try:
        net = Net(mem, plan)
        opt = Opt(net, plan)
        run(mem, net, opt, 4)
        tr.mark("end")
        assert mem.C._cuda_memoryStats is orig   # never wrapped, never reset
        got = steps(events)
        assert [s["step"] for s in got] == [1, 2, 3, 4]
        for s in got[1:]:  # below the first step's mark: lower bounds, no phase, the reason
            assert s["peak_exact"] is False and s["peak_phase"] is None
            assert "cudaMallocAsync" in s["exact_note"]
        assert mem.peak == max(mem.truth)       # the program's peak: untouched
    finally:
        tr.close()


def test_the_spike_finder_names_the_step_its_tags_and_phase():
    """A step that runs an eval pass and makes a large temporary in its training forward
    stands out: its step event carries the spike (tags, phase, bytes above the steady state)
    and the breakdown events the run's worst steps."""
    from gpumon.model.spikes import describe

    def spiky(k):
        # calls 0-5: steps 1-6; then two calls a step: an eval pass (even), the training
        # forward (odd): call 9 is step 8's
        p = plan(k)
        if k >= 6 and k % 2 == 0:
            return dict(p, acts=[], fwd_tmp=[2 * MiB])  # eval: no activations kept
        if k == 9:
            p = dict(p, fwd_tmp=[300 * MiB])
        return p
    mem = FakeCuda()
    tr, ev = make(mem, PeakCounters(mem.C), budget=0)
    try:
        net = Net(mem, spiky)
        opt = Opt(net, plan)
        x = torch.randn(4, 8)
        for k in range(12):
            if k >= 6:
                with torch.no_grad():
                    net(x)              # an eval pass each step from step 7 on
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()
        tr.mark("end")
        got = steps(ev)
        flagged = [s for s in got if s["spike"]]
        assert [s["step"] for s in flagged] == [8]
        sp = flagged[0]["spike"]
        assert sp["phase"] == "forward" and sp["exact"] and sp["tags"] == ["eval"]
        assert sp["peak"] == flagged[0]["peak"] and sp["above"] > 200 * MiB
        assert describe(sp).startswith("step 8 (eval) peaked at +")
        assert describe(sp).endswith(" in forward")
        worst = tr.status()["worst_steps"]
        assert worst[0]["step"] == 1 and worst[1]["step"] == 8  # step 1: the warm-up spike
        assert [e["step"] for e in tr.status()["spikes"]] == [8]
        # breakdown events (about once a second, what a late client reads) carry both lists
        tr._force_breakdown, tr._next_forced_t = True, 0.0
        net(x)
        bd = [p for k, p in ev if k == "breakdown"][-1]
        assert [e["step"] for e in bd["spikes"]] == [8] and bd["worst_steps"][1]["step"] == 8
    finally:
        tr.close()


def test_an_agent_thread_inside_a_forward_taken_early_closes_the_step_and_walks_no_tensor():
    """The agent's status command (its own thread) during a forward taken early: the step
    that ended is closed and reported, the phase in progress is forward, and the boundary's
    part that may walk the roles' tensors (a breakdown at the first steps' boundaries) is left
    to the training thread."""
    mem = FakeCuda()
    pc = PeakCounters(mem.C)
    tr, ev = make(mem, pc, budget=None, history=None)
    walkers: list = []
    walk = tr.compute_persistent

    def recorded(*a, **kw):
        walkers.append(threading.get_ident())
        return walk(*a, **kw)
    tr.compute_persistent = recorded
    seen: list = []

    class Probe(Net):
        def forward(self, x):
            y = super().forward(x)
            if tr._early is not None:
                t = threading.Thread(target=lambda: seen.append(tr.status()))
                t.start()
                t.join()
            return y
    try:
        net = Probe(mem, plan)
        opt = Opt(net, plan)
        run(mem, net, opt, 4)
        tr.mark("end")
        assert len(seen) == 3
        for k, st in enumerate(seen, start=1):  # inside step k+1's forward
            assert [s["step"] for s in st["recent_steps"]][-1] == k
            assert st["phase"] == "forward" and st["step"] == k + 1, st
        assert walkers and set(walkers) == {threading.get_ident()}
        assert [s["step"] for s in steps(ev)] == [1, 2, 3, 4]
        assert all(s["peak_exact"] for s in steps(ev))
    finally:
        tr.close()
