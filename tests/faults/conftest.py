import pytest

from .harness import Victim


@pytest.fixture
def victims(tmp_path):
    """victims(**kw) starts a Victim under tmp_path; every one left running is killed after."""
    made = []

    def make(name="victim", wait=True, timeout=60.0, **kw):
        # registered before waiting for its socket: one that never serves is still killed
        v = Victim(tmp_path / name, wait=False, **kw)
        made.append(v)
        if wait and (v.env.get("T_AGENT") == "1" or v.via == "run"):
            v.sock = v.wait_socket(timeout)
        return v
    yield make
    for v in made:
        v.kill()
