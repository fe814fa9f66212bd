"""The phase detector and step accounting on real torch CPU models and optimizers."""
import torch
import torch.nn.modules.module as mm

from .helpers import FakeMemory, Net, breakdowns, steps, tracker


def train_step(model, opt, n_micro=1):
    for _ in range(n_micro):
        model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_forward_backward_optimizer_sequence_and_steps():
    tr, ev, labels = tracker()
    try:
        m = Net()
        opt = torch.optim.AdamW(m.parameters())
        for _ in range(3):
            train_step(m, opt)
        tr.mark("end")  # closes the pending third step
        assert labels == ["forward", "backward", "other", "optimizer", "other"] * 3 + ["end"]
        st = steps(ev)
        assert [s["step"] for s in st] == [1, 2, 3]
        for s in st:
            assert s["forwards"] == 1 and s["backwards"] == 1
            assert s["optimizers"] == ["AdamW"]
            assert set(s["phases"]) >= {"forward", "backward", "optimizer"}
            assert s["time_s"] > 0
        # steps run end to end: their times add up to first-forward .. last-step end
        assert tr.roots() == [m]
    finally:
        tr.close()


def test_a_closed_step_is_reported_after_the_next_forward_launched_not_before():
    """The step that ends at a forward's start is built and sent when that forward returns (its
    kernels queued): after a sync (loss.item()) the GPU would otherwise wait for the event's
    ~100 us at the step's start. Every step still arrives, in order, and no later than the
    forward's return; a forward-only call reports it too."""
    tr, ev, _ = tracker()
    seen_inside: list = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Net()

        def forward(self, x):
            seen_inside.append([s["step"] for s in steps(ev)])  # inside the root's forward
            return self.net(x)
    try:
        m = Probe()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i in range(3):
            train_step(m, opt)
            # the previous step closed at this forward's start, reported at its return
            assert [s["step"] for s in steps(ev)] == list(range(1, i + 1))
        assert seen_inside == [[], [], [1]]  # never built before the forward's own launches
        m(torch.randn(2, 8))  # a forward-only call closes and reports the third
        assert [s["step"] for s in steps(ev)] == [1, 2, 3]
        assert seen_inside[-1] == [1, 2]
    finally:
        tr.close()


def test_a_failing_step_report_costs_that_event_only():
    """The closed step's event is built inside the next forward's end hook: if building it
    fails, the hook still arms the backward (its phase is seen) and later steps are reported."""
    tr, ev, labels = tracker()
    try:
        m = Net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        train_step(m, opt)
        real, calls = tr._step_devices, []

        def broken(*a, **k):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("boom")
            return real(*a, **k)
        tr._step_devices = broken
        for _ in range(3):
            train_step(m, opt)
        tr.mark("end")
        assert [s["step"] for s in steps(ev)] == [2, 3, 4]  # step 1's event lost, nothing else
        assert labels == ["forward", "backward", "other", "optimizer", "other"] * 4 + ["end"]
        assert tr.steps_done == 4
    finally:
        tr.close()


def test_the_first_step_whose_forward_is_compiled_away_says_so():
    """A model trained plainly, then its step compiled (gpumon's hooks compiled away): the first
    step with no forward already says why, while the model gpumon saw is still alive."""
    tr, ev, labels = tracker()
    try:
        m = Net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        train_step(m, opt)
        compiled = torch.compile(lambda x: m(x).sum(), backend="eager")
        for _ in range(2):
            compiled(torch.randn(2, 8)).backward()
            opt.step()
            opt.zero_grad()
        tr.mark("end")
        st = steps(ev)
        assert [s["forwards"] for s in st] == [1, 0, 0]
        assert tr.roots() == [m]  # alive: the note can't come from an empty root list
        assert st[1]["phases_note"] and "compiled" in st[1]["phases_note"], st[1]
    finally:
        tr.close()


def test_gradient_accumulation_is_one_step():
    tr, ev, labels = tracker()
    try:
        m = Net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            train_step(m, opt, n_micro=4)
        tr.mark("end")
        st = steps(ev)
        assert len(st) == 2
        assert all(s["forwards"] == 4 and s["backwards"] == 4 for s in st)
        assert st[0]["phases"]["forward"]["count"] == 4
        assert st[0]["phases"]["backward"]["count"] == 4
        assert st[0]["phases"]["optimizer"]["count"] == 1
    finally:
        tr.close()


def test_eval_under_no_grad_and_inference_mode_is_not_forward():
    tr, ev, labels = tracker()
    try:
        m = Net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        train_step(m, opt)
        with torch.no_grad():
            m(torch.randn(2, 8))
        with torch.inference_mode():
            m(torch.randn(2, 8))
        train_step(m, opt)
        tr.mark("end")
        assert "eval" in labels
        st = steps(ev)
        assert [s["forwards"] for s in st] == [1, 1]  # eval forwards are not training forwards
        assert st[1]["phases"]["eval"]["count"] == 2
    finally:
        tr.close()


def test_two_optimizers_back_to_back_are_one_step():
    tr, ev, labels = tracker()
    try:
        m = Net()
        o1 = torch.optim.AdamW(m.a.parameters())
        o2 = torch.optim.SGD(m.b.parameters(), lr=0.1)
        for _ in range(3):
            m(torch.randn(2, 8)).sum().backward()
            o1.step()
            o2.step()
            o1.zero_grad()
            o2.zero_grad()
        tr.mark("end")
        st = steps(ev)
        assert len(st) == 3
        assert st[0]["optimizers"] == ["AdamW", "SGD"]
        assert st[0]["phases"]["optimizer"]["count"] == 2
    finally:
        tr.close()


def test_gan_style_alternating_models():
    """Two models, two optimizers, each with its own forward/backward: each step is counted."""
    tr, ev, labels = tracker()
    try:
        g, d = Net(), Net()
        og, od = torch.optim.Adam(g.parameters()), torch.optim.Adam(d.parameters())
        for _ in range(2):
            train_step(d, od)
            train_step(g, og)
        tr.mark("end")
        st = steps(ev)
        assert len(st) == 4
        assert set(map(id, tr.roots())) == {id(g), id(d)}
    finally:
        tr.close()


def _hook_state(m):
    """gpumon's entries: in the global pre-hooks, on the model, on its submodules."""
    from gpumon.agent.phases.hooks import _KEY
    return (_KEY in mm._global_forward_pre_hooks, _KEY in m._forward_hooks,
            any(_KEY in s._forward_hooks for s in m.modules() if s is not m))


def test_hook_is_armed_only_between_root_calls_and_nothing_stays_on_the_model():
    from torch.utils.hooks import RemovableHandle
    tr, ev, labels = tracker()
    try:
        m = Net()
        inside = []
        # what a submodule's forward sees: no global hook (the fast path), the end hook on root
        m.a.register_forward_pre_hook(
            lambda mod, a: inside.append((len(mm._global_forward_pre_hooks),) + _hook_state(m)))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        assert _hook_state(m) == (True, False, False)
        n0 = RemovableHandle.next_id
        for _ in range(3):
            train_step(m, opt)
            assert _hook_state(m) == (True, False, False)
        assert inside == [(0, False, True, False)] * 3
        assert RemovableHandle.next_id == n0  # gpumon took no handle number of the program's
        # a forward that raises: torch runs the end hook anyway (always_call), nothing stays
        m.a.register_forward_hook(lambda *a: 1 / 0)
        try:
            m(torch.randn(2, 8))
        except ZeroDivisionError:
            pass
        assert _hook_state(m) == (True, False, False)
    finally:
        tr.close()
    assert _hook_state(m) == (False, False, False)


def test_forward_interrupted_by_keyboardinterrupt_recovers_at_the_next_step():
    tr, ev, labels = tracker()
    try:
        m = Net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        h = m.a.register_forward_hook(lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
        try:
            m(torch.randn(2, 8))  # torch runs always_call hooks for Exception only
        except KeyboardInterrupt:
            pass
        h.remove()
        assert _hook_state(m) == (False, True, False)  # left by the interrupted call
        opt.step()  # the next optimizer step finds the call gone: cleans up and re-arms
        assert _hook_state(m) == (True, False, False)
        for _ in range(3):
            train_step(m, opt)
        tr.mark("end")
        assert [s["forwards"] for s in steps(ev)][-3:] == [1, 1, 1]
    finally:
        tr.close()


def test_recursive_call_of_the_root_ends_with_the_outer_call():
    class Tree(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.seen = []

        def forward(self, x, depth=2):
            if depth:
                x = self(x, depth - 1)  # the same module inside its own call
                self.seen.append(_hook_state(self)[:2])
            return self.fc(x)

    tr, ev, labels = tracker()
    try:
        t = Tree()
        opt = torch.optim.SGD(t.parameters(), lr=0.1)
        for _ in range(2):
            train_step(t, opt)
        tr.mark("end")
        # the end hook stays through the inner calls, gone after the outer one
        assert t.seen == [(False, True)] * 4
        assert _hook_state(t) == (True, False, False)
        assert [(s["forwards"], s["backwards"]) for s in steps(ev)] == [(1, 1), (1, 1)]
    finally:
        tr.close()


def test_submodule_calls_inside_forward_are_not_roots():
    tr, ev, labels = tracker()
    try:
        m = Net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        train_step(m, opt)
        assert tr.roots() == [m]
    finally:
        tr.close()


def test_loss_outside_the_model_belongs_to_forward():
    tr, ev, labels = tracker()
    try:
        m = Net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        out = m(torch.randn(2, 8))
        assert tr.current_label() == "forward"  # still forward: the loss is not computed yet
        loss = torch.nn.functional.cross_entropy(out, torch.tensor([0, 1]))
        loss.backward()
        assert tr.current_label() == "other"
        assert labels == ["forward", "backward", "other"]
        opt.step()
    finally:
        tr.close()


def test_activation_checkpointing_recompute_stays_in_backward():
    from torch.utils.checkpoint import checkpoint

    class Ckpt(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Net()

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    tr, ev, labels = tracker()
    try:
        m = Ckpt()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            train_step(m, opt)
        tr.mark("end")
        assert labels == ["forward", "backward", "other", "optimizer", "other"] * 2 + ["end"]
        assert tr.roots() == [m]
    finally:
        tr.close()


def test_forward_that_raises_does_not_wedge_the_tracker():
    class Boom(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    tr, ev, labels = tracker()
    try:
        b = Boom()
        try:
            b(torch.randn(1))
        except RuntimeError:
            pass
        m = Net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        train_step(m, opt)
        assert labels[-4:] == ["forward", "backward", "other", "optimizer"] or \
            labels[-5:] == ["forward", "backward", "other", "optimizer", "other"]
    finally:
        tr.close()


def test_user_marks_and_phase_blocks():
    tr, ev, labels = tracker()
    try:
        m = Net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        tr.mark("data")
        train_step(m, opt)
        tr.push("checkpoint")
        m(torch.randn(2, 8)).sum().backward()  # inside a user block the label is the user's
        assert tr.current_label() == "checkpoint"
        tr.pop()
        assert tr.current_label() == "other"
        assert labels == ["data", "forward", "backward", "other", "optimizer", "other",
                          "checkpoint", "other"]
        st = steps(ev)
        assert len(st) == 1 and "checkpoint" in st[0]["phases"] or len(st) == 1
    finally:
        tr.close()


def test_optimizer_steps_without_forward_are_reported_not_guessed():
    tr, ev, labels = tracker()
    try:
        w = torch.nn.Parameter(torch.randn(4))
        opt = torch.optim.SGD([w], lr=0.1)
        for _ in range(3):
            (w * 2).sum().backward()  # no module forward at all
            opt.step()
        tr.mark("end")
        st = steps(ev)
        assert len(st) == 3
        assert st[-1]["phases_note"] and "unavailable" in st[-1]["phases_note"]
        assert "forward" not in st[-1]["phases"]
    finally:
        tr.close()


def test_torch_compile_eager_backend_keeps_root_phases():
    tr, ev, labels = tracker()
    try:
        m = Net()
        cm = torch.compile(m, backend="eager")
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            train_step(cm, opt)
        tr.mark("end")
        st = steps(ev)
        assert len(st) == 3
        assert all(s["forwards"] == 1 and s["backwards"] == 1 for s in st)
        assert st[-1]["phases_note"] is None
    finally:
        tr.close()


def test_sample_extra_labels_and_closes_a_quiet_step():
    clock = [0.0]
    tr, ev, labels = tracker(clock=lambda: clock[0])
    try:
        assert tr.sample_extra() == {}
        m = Net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(torch.randn(2, 8)).sum().backward()
        clock[0] = 0.5
        opt.step()
        assert tr.sample_extra() == {"phase": "other", "step": 1}
        clock[0] = 2.0  # the program went quiet after its step: the step is reported
        assert tr.sample_extra() == {"phase": "other", "step": 2}
        assert len(steps(ev)) == 1 and steps(ev)[0]["time_s"] == 0.5
    finally:
        tr.close()


def test_peak_in_optimizer_step_is_exact_and_attributed():
    mem = FakeMemory()

    class TempOpt(torch.optim.SGD):
        def step(self, closure=None):
            mem.bump(5000)  # a foreach temporary: gone before the step returns
            mem.bump(-5000)
            return super().step(closure)

    tr, ev, labels = tracker(devices=(0,), memory=mem)
    try:
        m = Net(mem, act=1000, temp=500)
        opt = TempOpt(m.parameters(), lr=0.1)
        for _ in range(3):
            train_step(m, opt)
        tr.mark("end")
        st = steps(ev)
        s1 = st[0]
        assert s1["peak_phase"] == "optimizer" and s1["peak_exact"]
        assert s1["peak"] == 1000 + 5000
        d = s1["devices"][0]
        assert d["phase_peaks"]["forward"] == 1000 + 1000 + 500 and d["phase_peaks_exact"]["forward"]
        # later steps set no new high-water mark: lower bounds from boundary reads, not exact
        assert st[1]["peak_exact"] is False
        assert st[1]["devices"][0]["phase_peaks"]["forward"] == 2000
        bd = breakdowns(ev)[-1]["devices"][0]
        assert bd["run_peak"] == 6000 and bd["run_peak_phase"] == "optimizer"
        assert bd["run_peak_step"] == 1
    finally:
        tr.close()


def test_peak_in_forward_when_activations_dominate():
    mem = FakeMemory()
    tr, ev, labels = tracker(devices=(0,), memory=mem)
    try:
        m = Net(mem, act=50_000, temp=0)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            train_step(m, opt)
        tr.mark("end")
        s1 = steps(ev)[0]
        assert s1["peak_phase"] == "forward" and s1["peak_exact"] and s1["peak"] == 51_000
        assert [b["phase"] for b in s1["boundaries"]][:3] == ["forward", "backward", "other"]
        assert s1["boundaries"][1]["allocated"] == [51_000]  # memory at the backward boundary
    finally:
        tr.close()


def test_user_reset_of_peak_stats_is_seen_and_not_exact():
    mem = FakeMemory()

    class ResettingNet(Net):
        def forward(self, x):
            out = super().forward(x)
            mem.reset_peak()  # the user's own torch.cuda.reset_peak_memory_stats()
            return out

    mem.peak = 50_000  # an earlier high-water mark, then reset inside the forward
    tr, ev, labels = tracker(devices=(0,), memory=mem)
    try:
        m = ResettingNet(mem, act=100, temp=10_000)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        train_step(m, opt)
        tr.mark("end")
        d = steps(ev)[0]["devices"][0]
        assert d["phase_peaks_exact"]["forward"] is False
        assert d["phase_peaks"]["forward"] == 1100
    finally:
        tr.close()


def test_breakdown_rate_limited_after_warm_steps():
    clock = [0.0]

    def tick():
        clock[0] += 0.001
        return clock[0]
    tr, ev, labels = tracker(clock=tick)
    try:
        m = Net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            train_step(m, opt)
        n_warm = len(breakdowns(ev))
        assert n_warm >= 12  # every boundary of the first steps
        for _ in range(20):  # ~20 ms of fake time: at most one more breakdown
            train_step(m, opt)
        assert len(breakdowns(ev)) - n_warm <= 1
    finally:
        tr.close()


def test_tracker_never_raises_into_training():
    tr, ev, labels = tracker()

    def bad_emit(kind, payload):
        raise RuntimeError("emit broken")
    tr._emit = bad_emit
    try:
        m = Net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            train_step(m, opt)
        tr.memory = None  # reading memory now raises inside the hooks
        train_step(m, opt)
    finally:
        tr.close()


def test_run_peak_roles_optimizer_impl_and_output_bytes():
    mem = FakeMemory()

    class TempOpt(torch.optim.SGD):
        def step(self, closure=None):
            mem.bump(5000)  # a temporary alive only inside the step
            mem.bump(-5000)
            return super().step(closure)

    tr, ev, labels = tracker(devices=(0,), memory=mem)
    try:
        m = Net(mem, act=1000, temp=0)
        opt = TempOpt(m.parameters(), lr=0.1, momentum=0.9, foreach=True)
        for _ in range(3):
            train_step(m, opt)
        tr.mark("end")
        st = steps(ev)
        assert st[0]["optimizer_impl"] == ["foreach"]
        assert st[0]["output_bytes"] == 2 * 4 * 4  # Net returns a (2, 4) fp32 tensor
        assert st[0]["autocast"] is False
        d = breakdowns(ev)[-1]["devices"][0]
        at = d["at_run_peak"]
        assert d["run_peak_phase"] == "optimizer" and d["run_peak"] == 6000
        # the fake allocator holds none of the real (CPU) tensors: all of the peak is "activations"
        assert at["activations"] == 6000 and at["parameters"] == 0
        assert tr.breakdown_now()["devices"][0]["at_run_peak"] == at
    finally:
        tr.close()


def test_optimizer_impl_flags():
    from gpumon.agent.phases import optimizer_impl
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_impl(torch.optim.AdamW(p)) == "for-loop"  # CPU default
    assert optimizer_impl(torch.optim.AdamW(p, foreach=True)) == "foreach"
    assert optimizer_impl(torch.optim.AdamW(p, foreach=False)) == "for-loop"
    assert optimizer_impl(torch.optim.AdamW(p, fused=True)) == "fused"
    assert optimizer_impl(object()) is None


def test_in_place_compile_reports_phases_unavailable_not_guessed():
    tr, ev, labels = tracker()
    try:
        m = Net()
        m.compile(backend="eager")  # in place: module hooks run inside the compiled frame
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            train_step(m, opt)
        tr.mark("end")
        st = steps(ev)
        assert len(st) == 3
        # dynamo traces the module's hooks away (they return at once while compiling): the
        # forward is invisible, and gpumon says so instead of inventing phases
        for s in st[1:]:
            assert s["forwards"] == 0 and s["backwards"] == 0
            assert s["phases_note"] and "unavailable" in s["phases_note"]
            assert "forward" not in s["phases"] and "backward" not in s["phases"]
            assert s["optimizers"] == ["SGD"]
    finally:
        tr.close()


def test_public_mark_and_phase_reach_the_tracker_and_never_raise():
    import gpumon
    from gpumon.agent import phases as P
    gpumon.mark("x")  # no agent: a no-op
    with gpumon.phase("y"):
        pass
    tr, ev, labels = tracker()
    old = P._tracker
    P._tracker = tr
    try:
        gpumon.mark("data")
        with gpumon.phase("checkpoint"):
            assert tr.current_label() == "checkpoint"
        assert labels == ["data", "checkpoint", "other"]
    finally:
        P._tracker = old
        tr.close()


def test_autocast_of_the_forward_is_reported():
    mem = FakeMemory()
    tr, ev, labels = tracker(devices=(0,), memory=mem)
    try:
        m = Net(mem, act=1000, temp=0)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                train_step(m, opt)
        tr.mark("end")
        assert [s["autocast"] for s in steps(ev)][:2] == ["bfloat16", "bfloat16"]
    finally:
        tr.close()


def test_compiled_module_call_warns_for_the_programs_global_hooks_only():
    """OptimizedModule.__call__ warns when a global module hook exists; gpumon's (out of the
    dict inside the root, so never firing twice) must not make it warn, the program's must."""
    import warnings
    tr, ev, labels = tracker()
    try:
        cm = torch.compile(Net(), backend="eager")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            cm(torch.randn(2, 8))
        assert not [x for x in w if "global hooks" in str(x.message)]
        h = mm.register_module_forward_pre_hook(lambda m, a: None)
        try:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                cm(torch.randn(2, 8))
            assert [x for x in w if "global hooks" in str(x.message)]
        finally:
            h.remove()
    finally:
        tr.close()
    assert mm._has_any_global_hook.__module__ == "torch.nn.modules.module"  # put back


def test_a_forked_child_calling_modules_leaves_gpumon_alone():
    """A DataLoader worker (fork) that calls a module: the hook it inherited takes itself out,
    the child's copy of the tracker counts nothing (its lock may have been held at the fork)."""
    import os
    from gpumon.agent.phases.hooks import _KEY
    tr, ev, labels = tracker()
    try:
        m = Net()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            try:
                before = tr._auto
                m(torch.randn(2, 8))
                ok = _KEY not in mm._global_forward_pre_hooks and tr._auto == before
                os.write(w, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(w)
        got = os.read(r, 1)
        os.waitpid(pid, 0)
        os.close(r)
        assert got == b"1"
        assert _KEY in mm._global_forward_pre_hooks  # the parent's is still armed
    finally:
        tr.close()


def test_strict_export_between_steps_exports_as_without_gpumon_and_phases_go_on():
    """torch 2.11-2.13's strict export fails while any global forward hook exists: gpumon's
    armed one steps aside while export's wrapper lives, and is back for the next step."""
    from gpumon.agent.phases.hooks import _KEY
    m = Net()
    x = torch.randn(2, 8)
    plain = torch.export.export(m, (x,), strict=True).graph_module.code
    tr, ev, labels = tracker()
    try:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        train_step(m, opt)
        assert _KEY in mm._global_forward_pre_hooks  # armed between steps
        ep = torch.export.export(m, (x,), strict=True)
        assert ep.graph_module.code == plain
        assert _KEY in mm._global_forward_pre_hooks  # re-armed as export returned
        del labels[:]
        train_step(m, opt)
        tr.mark("end")
        assert labels == ["forward", "backward", "other", "optimizer", "other", "end"]
        # an export that raises (here: the program's own global hook, torch's limit) raises
        # as without gpumon; torch keeps its wrapper alive with the error, so gpumon comes
        # back at the next optimizer step (that step's forward is not seen), then as before
        mm._global_forward_pre_hooks[-1] = lambda mod, a: None
        try:
            try:
                torch.export.export(m, (x,), strict=True)
                raised = ""
            except Exception as e:  # noqa: BLE001 (whatever torch raises without gpumon)
                raised = type(e).__name__
        finally:
            del mm._global_forward_pre_hooks[-1]
        assert raised == "Unsupported"
        train_step(m, opt)
        assert _KEY in mm._global_forward_pre_hooks
        del labels[:]
        train_step(m, opt)
        tr.mark("end")
        assert labels == ["forward", "backward", "other", "optimizer", "other", "end"]
    finally:
        tr.close()
    assert _KEY not in mm._global_module_registration_hooks  # nothing left after close


def test_a_ctrl_c_caught_in_backward_costs_one_step_of_phases_not_the_run():
    """A Ctrl-C in backward() is raised at gpumon's backward-end callback before its body runs
    (docs/phases.md); a program that catches it and trains on (a notebook's interrupted cell,
    run again) gets every phase back by its next optimizer step."""
    tr, ev, labels = tracker()
    try:
        m = Net()
        opt = torch.optim.AdamW(m.parameters())
        for _ in range(2):
            train_step(m, opt)
        real = tr.hooks._bwd_end

        def interrupted():  # what Python does when the signal is pending at its first line
            tr.hooks._bwd_end = real
            raise KeyboardInterrupt
        tr.hooks._bwd_end = interrupted
        try:
            m(torch.randn(2, 8)).sum().backward()
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the callback did not run")
        opt.zero_grad()
        for _ in range(3):  # the cell run again
            train_step(m, opt)
        tr.mark("end")
        st = steps(ev)
        assert [s["step"] for s in st] == [1, 2, 3, 4, 5]
        # step 3: the interrupted backward never ended, so the cell's first forward went unseen
        # (in backward) until the optimizer step put the hooks back
        assert labels[10:14] == ["forward", "backward", "optimizer", "other"], labels
        for s in st[-2:]:  # the steps after the one that recovered: whole again
            assert s["forwards"] == 1 and s["backwards"] == 1, s
            assert set(s["phases"]) >= {"forward", "backward", "optimizer"}, s
        assert labels[-6:] == ["forward", "backward", "other", "optimizer", "other", "end"]
    finally:
        tr.close()
