"""The client's side of every step (issue 35): a long run stays bounded (a ring of steps, the
run's worst steps kept), the spikes are listed with their phase in the breakdown view."""
from __future__ import annotations

from textual.app import App, ComposeResult
from textual.widgets import Static

from gpumon.model.breakdown import TOP_STEPS, BreakdownModel
from gpumon.model.spikes import describe
from gpumon.tui.widgets.breakdown import BreakdownView

G = 1 << 30


def step(n, peak, phase="backward", exact=True, spike=None, tags=()):
    return {"type": "event", "kind": "step", "step": n, "time_s": 0.2, "peak": peak,
            "peak_phase": phase if exact else None, "peak_exact": exact, "peak_device": 0,
            "phases": {}, "boundaries": [], "replayed": False, "tags": list(tags),
            "exact_note": None if exact else "allocations on another thread at a phase boundary",
            "measured_every": 300, "spike": spike}


def spike(n, peak, above, phase="forward", tags=("eval",)):
    return {"step": n, "peak": peak, "above": above, "steady": peak - above, "phase": phase,
            "exact": True, "tags": list(tags), "t": 1.0}


def test_ten_thousand_steps_stay_bounded_and_keep_the_worst():
    m = BreakdownModel()
    big = {137: 30 * G, 4102: 33 * G, 9999: 31 * G}
    for n in range(1, 10_001):
        p = big.get(n, 28 * G + (n % 7) * 1000)
        m.feed(step(n, p, spike=spike(n, p, p - 28 * G) if n in big else None))
    assert len(m.steps) == m.steps.maxlen == 200 and m.steps[-1].step == 10_000
    worst = m.worst_steps()
    assert len(worst) == TOP_STEPS
    assert [w["step"] for w in worst[:3]] == [4102, 9999, 137]
    assert [s["step"] for s in m.spikes()] == [137, 4102, 9999]


def test_a_late_client_gets_the_runs_worst_steps_from_the_breakdown_event():
    m = BreakdownModel()
    m.feed(step(5000, 28 * G))
    m.feed({"type": "event", "kind": "breakdown", "step": 5001, "phase": "forward",
            "devices": [], "worst_steps": [spike(4102, 33 * G, 5 * G)],
            "spikes": [spike(4102, 33 * G, 5 * G), {"step": "bad"}]})
    assert m.worst_steps()[0]["step"] == 4102
    assert [s["step"] for s in m.spikes()] == [4102]


def test_describe_says_phase_only_when_exact():
    e = spike(4102, 33 * G, int(3.1 * G))
    assert describe(e) == "step 4,102 (eval) peaked at +3.1 GiB in forward"
    assert describe(dict(e, exact=False, phase=None, tags=[])) == \
        "step 4,102 peaked at >= +3.1 GiB, phase unknown"


class One(App):
    def compose(self) -> ComposeResult:
        yield BreakdownView()


async def test_the_view_lists_spikes_and_worst_steps_and_says_why_a_step_is_a_bound():
    app = One()
    async with app.run_test(size=(100, 40)) as pilot:
        v = app.query_one(BreakdownView)
        m = BreakdownModel()
        m.feed(step(4101, 28 * G))
        m.feed(step(4102, 31 * G, phase="forward", spike=spike(4102, 31 * G, int(3.1 * G)),
                    tags=["eval"]))
        m.feed(step(4103, 29 * G, exact=False))
        v.update_model(m)
        await pilot.pause()
        adv = " ".join(str(app.query_one("#bd-advice", Static).render()).split())
        assert "spike: step 4,102 (eval) peaked at +3.1 GiB in forward" in adv
        assert "worst steps: 4,102 31.00 GiB in forward; 4,103 29.00 GiB (>=); 4,101" in adv
        assert "steps: lower bounds (allocations on another thread" in adv
        assert "or fewer measured" not in adv  # every step is reported: no cadence line
