"""`gpumon demo` starts clean (issue 32 item 6): where there is no NVIDIA driver its waiting
screen says the GPU is simulated instead of NVML's exception, the top bar names no "nvml"
source, and once the workload serves, its own line (what trains, what is scripted) stays
above the panes. A program (not the demo) waiting for CUDA gets what that means and what to try."""
from fakes import CLIENT_ID, T0, FakeConnection, FakeTarget, hello, history

from gpumon.tui.attach_app import DEMO_STARTING, NO_CUDA_YET, AttachApp, TopBar

from .test_interrupt_screens import until

NO_DRIVER = "no NVIDIA driver here (NVML's library is not found)"


def _waiting(target, pid="777"):
    target.state(pid, "waiting", f"pid {pid}: gpumon's agent is loaded, waiting for the "
                 "program's first CUDA call")
    target.publish({"type": "hello", "key": pid, "pid": int(pid), "source": "nvml",
                    "nvml": NO_DRIVER, "gpus": [], "devices": []})


async def test_the_demo_waits_without_an_nvml_error_then_says_what_it_runs():
    target = FakeTarget()
    app = AttachApp(target, clock=lambda: T0 + 40, client_id=CLIENT_ID, fps=20, demo=True)
    async with app.run_test(size=(80, 24)) as pilot:
        _waiting(target)
        box = app.query_one("#waiting")
        await until(pilot, lambda: "simulated" in str(box.render()))
        text = str(box.render())
        assert DEMO_STARTING.split(";")[0] in text.replace("\n", " ")
        assert "no NVIDIA driver: the demo's GPU is simulated" in text
        assert "NVML" not in text and "Error" not in text
        # not the advice for a program that waits for CUDA ("... try `gpumon demo`"): a new
        # user read the demo telling them to run the demo
        assert "has not used CUDA yet" not in text and "gpumon demo`" not in text
        assert "nvml" not in app.query_one(TopBar).render().plain
        h = dict(hello(pid=778), demo="torch is not installed: nothing trains, every "
                 "figure is scripted (pip install torch for a real model)")
        target.add(FakeConnection(h, history(20)))
        target.state("777", "exited", "pid 777 ended", status=0, signal=None, how="exit")
        await until(pilot, lambda: app.panes)
        notice = app.query_one("#notice")
        await until(pilot, lambda: "every figure is scripted" in str(notice.render()))
        assert not notice.has_class("hidden")


async def test_a_program_waiting_for_cuda_is_told_what_that_means():
    target = FakeTarget()
    app = AttachApp(target, clock=lambda: T0 + 40, client_id=CLIENT_ID, fps=20)
    async with app.run_test(size=(80, 24)) as pilot:
        _waiting(target)
        box = app.query_one("#waiting")
        await until(pilot, lambda: "has not used CUDA yet" in str(box.render()))
        text = " ".join(str(box.render()).split())
        assert " ".join(NO_CUDA_YET.split()) in text and "gpumon demo" in text
        assert f"NVML: {NO_DRIVER}" in text  # a program's screen says NVML's state as it is
        await pilot.press("b")  # it did nothing, without a word
        assert any("no breakdown yet: this program has not used CUDA yet" in n.message
                   for n in app._notifications)


async def test_s_on_a_waiting_agent_arms_and_the_recording_starts_when_it_serves():
    """Issue 32 item 2: `s` said "the snapshot feature is missing or the agent is older"."""
    from fakes import FakeConnection, hello, history
    cmds = ("ping", "reset_peaks", "set_rate", "status", "snapshot_start", "snapshot_stop",
            "snapshot_status")
    target = FakeTarget()
    app = AttachApp(target, clock=lambda: T0 + 40, client_id=CLIENT_ID, fps=20)
    async with app.run_test(size=(80, 24)) as pilot:
        _waiting(target)
        box = app.query_one("#waiting")
        await until(pilot, lambda: "has not used CUDA yet" in str(box.render()))
        await pilot.press("s")
        await until(pilot, lambda: "SNAPSHOT ARMED" in str(box.render()))
        assert not any("missing" in n.message for n in app._notifications)
        assert any("armed" in n.message for n in app._notifications)
        conn = FakeConnection(hello(pid=777, commands=cmds), history(20), handlers={
            "snapshot_start": lambda a: {"recording": True, "since": T0 + 41}})
        target.add(conn, key="777")  # the agent serves: its first CUDA call came
        await until(pilot, lambda: [r[0] for r in conn.requests] == ["snapshot_start"])
        await until(pilot, lambda: app.panes and "REC" in next(
            iter(app.panes.values())).header.render().plain)
        assert not app.armed
