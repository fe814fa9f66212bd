"""SVG snapshots of the attach screen with a frozen clock and a scripted source, at 80x24 and
200x60 (update with: pytest tests/tui/test_snapshots.py --snapshot-update)."""
import asyncio

import pytest
from fakes import CLIENT_ID, T0, FakeConnection, FakeTarget, hello, history

from gpumon.tui.attach_app import AttachApp


@pytest.fixture(autouse=True)
def _colour(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)


def _app(conns):
    return AttachApp(FakeTarget(*conns), fps=20, clock=lambda: T0 + 40,
                     client_id=CLIENT_ID)


def _ready(app, n_panes, n_samples):
    async def run_before(pilot):
        loop = asyncio.get_running_loop()
        end = loop.time() + 20
        while not (len(app.panes) == n_panes and
                   all(p.proc.samples == n_samples for p in app.panes.values())):
            if loop.time() > end:
                raise AssertionError("scripted samples not shown in time")
            await pilot.pause(0.02)
        await pilot.pause(0.3)
    return run_before


@pytest.mark.parametrize("size", [(80, 24), (200, 60)])
def test_one_process(snap_compare, size):
    app = _app([FakeConnection(hello(), history(300))])
    assert snap_compare(app, terminal_size=size, run_before=_ready(app, 1, 300))


@pytest.mark.parametrize("size", [(80, 24), (200, 60)])
def test_overview_two_ranks(snap_compare, size):
    conns = [FakeConnection(hello(pid=1000 + r, rank=r, world=2), history(200, scale=1 + r / 4))
             for r in range(2)]
    app = _app(conns)
    assert snap_compare(app, terminal_size=size, run_before=_ready(app, 2, 200))
