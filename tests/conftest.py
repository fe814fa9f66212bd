import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def gpumon_dir(tmp_path_factory, monkeypatch):
    """Every test gets its own socket directory, so agents of different tests never meet."""
    d = tmp_path_factory.mktemp("gpumon-sock")
    os.chmod(d, 0o700)
    monkeypatch.setenv("GPUMON_DIR", str(d))
    # The simulated source serves at once in tests, unless a test sets "torch": it then waits,
    # as the torch source waits for CUDA, until the program imports torch.
    monkeypatch.setenv("GPUMON_SIM_READY", "now")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return d


@pytest.fixture
def python():
    return sys.executable
