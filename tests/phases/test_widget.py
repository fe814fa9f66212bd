"""The breakdown widget in a tiny app: renders a model, updates in place, shows an estimate."""
from textual.app import App, ComposeResult
from textual.widgets import DataTable, Static

from gpumon.estimate import Setup, estimate
from gpumon.model.breakdown import BreakdownModel
from gpumon.tui.widgets.breakdown import BreakdownView, phase_colour

from .test_model_advice import ACT_PEAK, G, OPT_PEAK, bd, step_ev


class One(App):
    def compose(self) -> ComposeResult:
        yield BreakdownView()


def feed(*extra):
    m = BreakdownModel()
    steps = [dict(step_ev(i), peak=48 * G, peak_phase="forward", peak_exact=i == 1,
                  phases={"forward": {"time_s": 0.3, "count": 1},
                          "backward": {"time_s": 0.5, "count": 1},
                          "optimizer": {"time_s": 0.05, "count": 1}}) for i in (1, 2)]
    for x in (*steps, bd("forward", ACT_PEAK), *extra):
        m.feed(x)
    return m


def blog_estimate(batch=2):
    """A real estimate (the estimator is pure Python): 1.5e9 parameters, fp32 AdamW."""
    # the workspace pinned to one 32 MiB cuBLAS workspace, as when the snapshot was taken
    return estimate(Setup(n_params=1_500_000_000, batch=batch, seq=256, workspace_bytes=32 * 2**20)).to_dict()


def opt_model():
    """Measured like the blog's batch-2 run: 6 GiB parameters, 12 GiB state, peak in the step."""
    m = BreakdownModel()
    e = bd("optimizer", OPT_PEAK, allocated=24 * G, reserved=31 * G)
    e["devices"][0]["run_peak_step"] = 2
    for x in (dict(step_ev(1), peak=29 * G), dict(step_ev(2), peak=30 * G), e):
        m.feed(x)
    return m


def cell(table, row, col):
    return str(table.get_cell(row, col))


async def test_widget_renders_roles_steps_and_advice():
    app = One()
    async with app.run_test(size=(100, 40)) as pilot:
        v = app.query_one(BreakdownView)
        m = feed()
        v.update_model(m)
        await pilot.pause()
        roles = app.query_one("#bd-roles", DataTable)
        assert roles.row_count == 7  # six roles and the peak
        assert "30.00 GiB" in str(roles.get_row("activations"))
        assert len(roles.columns) == 3  # no estimate: no estimate columns
        steps_t = app.query_one("#bd-steps", DataTable)
        assert steps_t.row_count == 2
        # step 1 exact: its figure and phase; step 2 a lower bound: ">=" and no phase
        rows = {str(steps_t.get_row_at(i)[0]): steps_t.get_row_at(i)
                for i in range(steps_t.row_count)}
        assert str(rows["1"][2]) == "48.00 GiB" and str(rows["1"][3]) == "forward"
        assert str(rows["2"][2]) == ">= 48.00 GiB" and str(rows["2"][3]) == "-"
        adv = str(app.query_one("#bd-advice", Static).render())
        assert "activations dominate" in adv
        m.feed(step_ev(3))
        v.update_model(m)  # in place: rows added, not rebuilt
        await pilot.pause()
        assert app.query_one("#bd-steps", DataTable).row_count == 3
        assert roles.row_count == 7


async def test_estimate_column_and_error_per_term():
    app = One()
    async with app.run_test(size=(110, 40)) as pilot:
        v = app.query_one(BreakdownView)
        m = opt_model()
        v.update_model(m)
        await pilot.pause()
        roles = app.query_one("#bd-roles", DataTable)
        assert len(roles.columns) == 3
        est = blog_estimate()
        m.set_estimate(est)
        v.update_model(m)
        await pilot.pause()
        assert [str(c.label) for c in roles.columns.values()] == [
            "role", "at end", "at peak", "estimate", "error"]
        # the "at end" roles are the last breakdown's, taken at a phase boundary: it is named
        ended, step = m.breakdown_at
        assert ended and f"at end of {ended} (step {step})" in str(app.query_one("#bd-bars", Static).render())
        assert roles.row_count == 7
        # parameters: 1.5e9 x 4 B estimated = 5.59 GiB vs 6 GiB measured: -6.9%
        want = 100 * (6_000_000_000 - 6 * G) / (6 * G)
        assert cell(roles, "parameters", "estimate") == "5.59 GiB"
        assert cell(roles, "parameters", "error") == f"{want:+.1f}%"
        # optimizer step phase: the estimate of that phase's roles, compared at the run's peak
        c = m.estimate_comparison()
        assert c.phase == "optimizer"
        rows = {r.role: r for r in c.rows}
        assert rows["gradients"].estimate == est["live_phases"]["optimizer"]["gradients"]
        assert rows["gradients"].measured == 6 * G
        assert rows["peak"].measured == 30 * G
        # the two roles outside allocated are a range, said as in/out of range
        assert ".." in cell(roles, "allocator_cache", "estimate")
        assert cell(roles, "allocator_cache", "error") in ("in range", "below range",
                                                           "above range")
        assert "predicted" in str(app.query_one("#bd-advice", Static).render())
        m.set_estimate(None)  # removed in place
        v.update_model(m)
        await pilot.pause()
        assert len(roles.columns) == 3 and roles.row_count == 7


async def test_malformed_estimate_is_a_one_line_note():
    app = One()
    async with app.run_test(size=(100, 40)) as pilot:
        v = app.query_one(BreakdownView)
        m = opt_model()
        m.set_estimate({"peak_bytes": 1})
        v.update_model(m)
        await pilot.pause()
        assert len(app.query_one("#bd-roles", DataTable).columns) == 3
        assert "not a gpumon estimate" in str(
            app.query_one("#bd-advice", Static).render())


def test_phase_colours_are_stable():
    assert phase_colour("forward") != phase_colour("backward")
    assert phase_colour("checkpoint") == phase_colour("checkpoint")
    assert phase_colour(None) == "grey50"


def test_snapshot(snap_compare):
    class Fed(One):
        def on_mount(self):
            self.query_one(BreakdownView).update_model(feed())
    assert snap_compare(Fed(), terminal_size=(100, 32))


def test_snapshot_with_estimate(snap_compare):
    class Fed(One):
        def on_mount(self):
            m = opt_model()
            m.set_estimate(blog_estimate())
            self.query_one(BreakdownView).update_model(m)
    assert snap_compare(Fed(), terminal_size=(110, 34))


async def test_measured_cadence_names_the_last_measured_step():
    """'1 in 55 measured' was the last measured step's cadence; on the H100 the tracker then
    measured none of the next 150 steps: the line says which step was measured last."""
    app = One()
    async with app.run_test(size=(100, 40)) as pilot:
        v = app.query_one(BreakdownView)
        m = BreakdownModel()
        m.feed({**step_ev(56), "measured_every": 55})
        m.feed({"type": "sample", "t": 1.0, "phase": "backward", "step": 209, "devices": []})
        v.update_model(m)
        await pilot.pause()
        adv = " ".join(str(app.query_one("#bd-advice", Static).render()).split())
        assert "1 in 55 or fewer measured; the last measured: step 56 of 209" in adv
