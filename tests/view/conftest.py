import pytest


@pytest.fixture(autouse=True)
def _colour_env(monkeypatch):
    """The SVG snapshots are taken in colour: another test module (or an app that sets NO_COLOR
    in os.environ) must not turn them monochrome."""
    monkeypatch.delenv("NO_COLOR", raising=False)


@pytest.fixture(autouse=True)
def _start_settled(monkeypatch, request):
    """A pilot's keys come after the view's start-up: the app holds keys typed before its tabs'
    first activation and presses them after it (tests/view/test_first_frame.py tests that), so a
    test pressing "2", "1" at once could assert between the two held keys on a loaded machine."""
    if request.module.__name__.endswith("test_first_frame"):
        return
    import asyncio
    import contextlib

    from gpumon.tui.view.app import ViewApp
    run_test = ViewApp.run_test

    @contextlib.asynccontextmanager
    async def settled_run_test(self, *args, **kwargs):
        async with run_test(self, *args, **kwargs) as pilot:
            await asyncio.wait_for(self.keys_released.wait(), 10)
            yield pilot

    monkeypatch.setattr(ViewApp, "run_test", settled_run_test)
