"""`m` in the live view: asks the agent for a per-module measurement of the next step; the
result (a ``modules`` event) shows in the breakdown: the module at the peak and the top ones."""
from fakes import FakeConnection, hello, history

from test_app import make_app, notes, pane, until
from tests.modules.test_report import _result

CMDS = ("ping", "reset_peaks", "set_rate", "status", "modules_measure", "modules_result")


async def test_m_measures_and_the_breakdown_shows_the_top_modules():
    def measure(args):
        assert args == {"steps": 1, "wait": 0}
        c.feed({"type": "event", "kind": "modules", **_result()})
        return {"state": "waiting", "steps": 1, "steps_done": 0}

    c = FakeConnection(hello(commands=CMDS), history(40), handlers={"modules_measure": measure})
    app = make_app(c)
    async with app.run_test(size=(100, 40)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 40)
        await pilot.press("m")
        await until(pilot, lambda: pane(app).proc.breakdown.modules is not None)
        await until(pilot, lambda: any("running lm_head" in m for m in notes(app)))
        assert app.show_breakdown
        box = pane(app).breakdown.query_one("#bd-modules")
        await until(pilot, lambda: "model.layers.2.mlp" in box.render().plain)
        text = box.render().plain
        assert "modules at the peak" in text and "running lm_head" in text
        assert [r[0] for r in c.requests if r[0].startswith("modules")] == ["modules_measure"]


async def test_m_on_an_agent_without_the_command_says_so():
    c = FakeConnection(hello(), history(10))
    app = make_app(c)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 10)
        await pilot.press("m")
        await until(pilot, lambda: any("cannot measure per module" in m for m in notes(app)))
        assert not [r for r in c.requests if r[0].startswith("modules")]


async def test_m_where_the_agent_refuses_says_what_failed_in_words():
    """A new user's demo without torch read "modules_measure failed: modules_measure: torch is
    not imported in this process": the command's name, twice."""
    from gpumon.client import AgentError

    def measure(args):
        raise AgentError("modules_measure: torch is not imported in this process")

    c = FakeConnection(hello(commands=CMDS), history(10), handlers={"modules_measure": measure})
    app = make_app(c)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.panes and pane(app).proc.samples == 10)
        await pilot.press("m")
        await until(pilot, lambda: any("failed" in m for m in notes(app)))
        said = [m for m in notes(app) if "failed" in m]
        assert len(said) == 1 and "modules_measure" not in said[0], said
        assert said[0].endswith(": the per-module measurement failed: torch is not imported in "
                                "this process"), said


def test_the_modules_rows_have_a_header_and_a_cpu_measurement_says_where_it_ran():
    """A new user's demo: three bare numbers a row, real CPU-model figures under scripted GPU
    ones with nothing to tell them apart."""
    from gpumon.model.modules import ModuleReport
    from gpumon.tui.widgets.modules import modules_text
    gpu = modules_text(ModuleReport.from_result(_result()), None, False, 100).plain
    lines = gpu.splitlines()
    head = next(i for i, x in enumerate(lines) if x.lstrip().startswith("module "))
    assert "holds" in lines[head] and "P params+buffers" in lines[head] \
        and "A activations" in lines[head]
    assert " P " in lines[head + 1] and " A " in lines[head + 1]  # a row follows it
    assert "measured on the CPU" not in gpu
    cpu = modules_text(ModuleReport.from_result(_result(device="cpu")), None, False, 100).plain
    assert "measured on the CPU: the program's own model" in cpu
