"""Issue 35, end to end on CPU: tests/gpu/programs/counters_view.py (reads torch's peak counters
at many points through torch's own API and resets them itself) prints the same plainly, under
``gpumon run`` and with ``gpumon.start()``, on the fake CUDA allocator of fake_cuda.py, which
gpumon's torch source follows as it follows a GPU (so the counter path wraps torch._C's entry
points and resets the real counters at every phase boundary); and gpumon reports every step
exact, equal to torch's own peak of the step (a plain run resetting at every probe), in its
phase. tests/gpu/test_counters_gpu.py runs the same on a GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu" / "programs"))
import plain_vs_gpumon as runs  # noqa: E402

STEPS = 12  # the program's own resets are in steps 3, 5, 6 and 9; an eval pass in step 10


def test_counters_view_program_same_with_and_without_gpumon_every_step_exact(tmp_path):
    runs.check_counters_view(["--device", "fake", "--steps", str(STEPS)], tmp_path, STEPS,
                              again=False)
