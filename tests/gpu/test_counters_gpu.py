"""Issue 35 on a GPU: the program's own view of torch's peak counters is what it would be
without gpumon, while gpumon reads and resets the real counters at every phase boundary.

1. tests/gpu/programs/counters_view.py (a deterministic small training loop on CUDA that reads
   max_memory_allocated, memory_stats() peaks, memory_summary(), torch.cuda.memory.* and
   torch.accelerator.* at many points, in the middle of phases too, and calls
   reset_peak_memory_stats / reset_max_memory_allocated itself, mid-phase too) prints the same
   lines plainly, under ``gpumon run`` and with ``gpumon.start()``, apart from lines that differ
   between two plain runs already (printed; at most 5% of them). gpumon reported every step,
   exact, equal to torch's own peak of that step (a plain run resetting at every probe), in
   the phase torch's per-span peaks put it.
2. tests/gpu/programs/trainer_steps.py: a Hugging Face Trainer run (a tiny Llama from config)
   under ``gpumon run``: every step reported, exact, with its phase, equal to torch's own
   per-step and per-phase peaks, which a callback of the program reads (and resets) at every
   phase boundary the Trainer offers: under gpumon it reads the virtual view, which must be
   what the plain run read, number for number.

Both also run under ``gpumon run`` at the agent's own replay budget ("sampled"; the others at
budget 0, every step replayed): the steps the replay does not follow take their forward's start
early (the counters' read-reset-read there, the rest after the forward's launches), and must
pass the same checks.

The same machinery runs on CPU on the fake CUDA allocator: tests/phases/test_counters_program.py
(in CI) and, by hand (a minute on 2 cores), python tests/gpu/programs/plain_vs_gpumon.py trainer.
Run on the GPU machine:  python -m pytest tests/gpu/test_counters_gpu.py -v -s   (~1 min)
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent / "programs"))
import plain_vs_gpumon as runs  # noqa: E402

STEPS = 12  # the program's own resets are in steps 3, 5, 6 and 9; an eval pass in step 10


def test_counters_view_program_same_with_and_without_gpumon_every_step_exact(tmp_path):
    runs.check_counters_view(["--device", "cuda", "--steps", str(STEPS)], tmp_path, STEPS)


def test_trainer_every_step_exact_in_its_phase(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the Trainer needs it
    runs.check_trainer(["--device", "cuda", "--steps", "30"], tmp_path, 30)
