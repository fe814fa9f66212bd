import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def gpumon_dir(tmp_path_factory, monkeypatch):
    """Every test gets its own socket directory, so agents of different tests never meet: the
    directory where the sockets are (``$GPUMON_DIR/gpumon-<uid>``, made here as gpumon would)."""
    base = tmp_path_factory.mktemp("gpumon-sock")
    monkeypatch.setenv("GPUMON_DIR", str(base))
    d = base / f"gpumon-{os.getuid()}"
    d.mkdir(mode=0o700)
    # The simulated source serves at once in tests, unless a test sets "torch": it then waits,
    # as the torch source waits for CUDA, until the program imports torch.
    monkeypatch.setenv("GPUMON_SIM_READY", "now")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return d


@pytest.fixture
def python():
    return sys.executable
