"""The breakdown widget in a tiny app: renders a model, updates in place."""
from textual.app import App, ComposeResult
from textual.widgets import DataTable, Static

from gpumon.model.breakdown import BreakdownModel
from gpumon.tui.widgets.breakdown import BreakdownView

from .test_model_advice import ACT_PEAK, bd, step_ev


class One(App):
    def compose(self) -> ComposeResult:
        yield BreakdownView()


def feed():
    m = BreakdownModel()
    for x in (step_ev(1), step_ev(2), bd("forward", ACT_PEAK)):
        m.feed(x)
    return m


async def test_widget_renders_roles_steps_and_advice():
    app = One()
    async with app.run_test(size=(100, 40)) as pilot:
        v = app.query_one(BreakdownView)
        m = feed()
        v.update_model(m)
        await pilot.pause()
        roles = app.query_one("#bd-roles", DataTable)
        assert roles.row_count == 6
        assert "30.00 GiB" in str(roles.get_row("activations"))
        assert app.query_one("#bd-steps", DataTable).row_count == 2
        adv = str(app.query_one("#bd-advice", Static).render())
        assert "activations dominate" in adv
        m.feed(step_ev(3))
        v.update_model(m)  # in place: rows added, not rebuilt
        await pilot.pause()
        assert app.query_one("#bd-steps", DataTable).row_count == 3
        assert roles.row_count == 6


def test_snapshot(snap_compare):
    class Fed(One):
        def on_mount(self):
            self.query_one(BreakdownView).update_model(feed())
    assert snap_compare(Fed(), terminal_size=(100, 32))
