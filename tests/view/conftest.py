import pytest


@pytest.fixture(autouse=True)
def _colour_env(monkeypatch):
    """The SVG snapshots are taken in colour: another test module (or an app that sets NO_COLOR
    in os.environ) must not turn them monochrome."""
    monkeypatch.delenv("NO_COLOR", raising=False)
