import pytest

from .harness import Victim


@pytest.fixture
def victims(tmp_path):
    """victims(**kw) starts a Victim under tmp_path; every one left running is killed after."""
    made = []

    def make(name="victim", **kw):
        v = Victim(tmp_path / name, **kw)
        made.append(v)
        return v
    yield make
    for v in made:
        v.kill()
