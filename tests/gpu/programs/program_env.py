"""What the programs of this folder share (imported as a sibling: a script's folder is first on
sys.path): the tests' helpers they use, found by path ("tests" is a namespace package, which a
regular package of that name in site-packages would shadow), and the fake CUDA device of their
CPU mode. Imports nothing of gpumon."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[2]
for _d in ("compat", "phases"):
    if str(TESTS / _d) not in sys.path:
        sys.path.insert(0, str(TESTS / _d))

from harness import start_if_asked, wait_if_asked  # noqa: E402,F401  (tests/compat: no gpumon)


def fake_cuda(torch: Any) -> tuple[Any, Any]:
    """CPU mode: torch's own readers (memory_stats, memory_summary, reset_peak_memory_stats...)
    on tests/phases/fake_cuda.py's caching allocator, which keeps torch's counters, and CUDA
    "initialised" with one device, so gpumon's torch source follows it as it follows a GPU (its
    counter path wraps torch._C's entry points). Install after torch's own set-up (seeding, the
    optimizer, which would use real CUDA). Returns (the allocator, the context to __exit__
    before shutdown)."""
    from fake_cuda import FakeCuda, as_torch_cuda  # tests/phases: standard library only
    mem = FakeCuda()
    ctx = as_torch_cuda(torch, mem)
    ctx.__enter__()
    torch._C._cuda_getDeviceCount = lambda: 1
    torch._C._cuda_hasPrimaryContext = lambda i: i == 0
    # torch.accelerator as on the CPU build: none. On a CUDA build (a plain pip install on
    # Linux) the fake's device count makes torch.cuda.is_available() true, and Optimizer.step's
    # graph-capture check then asks the real CUDA runtime for its current stream ("CUDA driver
    # version is insufficient" on a machine without a driver).
    if hasattr(torch._C, "_accelerator_getAccelerator"):
        torch._C._accelerator_getAccelerator = lambda: None
    return mem, ctx
