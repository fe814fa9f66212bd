"""CPU micro-benchmark: the phase tracker's own time per phase boundary (issue 35's 0.1%).

A fake ``torch._C`` whose ``_cuda_memoryStats`` returns a fresh nested dict of torch 2.11's
scheme (122 keys, as the C++ call builds one per call) drives PeakCounters and PhaseTracker
through the blog loop's boundaries (forward, backward, other, optimizer, other: 5 a step).
Prints us per boundary: the whole tracker, and the fake stats call alone (what the real C++
call replaces). ``--profile`` adds a cProfile listing.

    python benchmarks/boundary_cost.py [--steps 3000] [--profile] [--device cuda]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
import types

import torch

from gpumon.agent.phases import PhaseTracker
from gpumon.agent.phases.counters import PeakCounters

NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
         "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
POOLS = ("all", "large_pool", "small_pool")


class FakeC:
    """torch._C's two counter entry points over a nested dict of 122 keys (torch 2.11)."""

    def __init__(self) -> None:
        self.n = 0
        self.cur = 1 << 30

    def _cuda_memoryStats(self, device):
        self.n += 1
        c = self.cur + (self.n % 7) * 4096
        st = {n: {p: {"current": c, "peak": c + 512, "allocated": 10 * self.n + 3,
                      "freed": 10 * self.n} for p in POOLS} for n in NAMES}
        st["oversize_allocations"] = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
        st["oversize_segments"] = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
        st.update(num_alloc_retries=0, num_ooms=0, max_split_size=-1, num_sync_all_streams=0,
                  num_device_alloc=12, num_device_free=0)
        return st

    def _cuda_resetPeakMemoryStats(self, device):
        pass


def run(steps: int, C=None) -> tuple[float, int, float]:
    C = C if C is not None else FakeC()
    pc = PeakCounters(C)
    pc.install()
    tr = PhaseTracker(torch, lambda k, p: None, lambda: [0], pc, budget=0.001)
    opt = object()
    t0 = time.perf_counter()
    for _ in range(steps):
        tr.forward_started(True)
        tr.backward_started()
        tr.backward_ended()
        tr.optimizer_started(opt)
        tr.optimizer_ended(opt)
    dt = time.perf_counter() - t0
    n = pc.boundaries
    tr.close()  # uninstalls the counters; the wrappers stay until the program resets:
    if not isinstance(C, FakeC):
        torch.cuda.reset_peak_memory_stats(0)  # ... done here, so they go
    return dt, n, tr.cost_total


def stats_alone(n: int, C=None) -> tuple[float, float]:
    """Seconds a call of the stats read and of the peak reset."""
    C = C if C is not None else FakeC()
    t0 = time.perf_counter()
    for _ in range(n):
        C._cuda_memoryStats(0)
    t1 = time.perf_counter()
    for _ in range(n):
        C._cuda_resetPeakMemoryStats(0)
    return (t1 - t0) / n, (time.perf_counter() - t1) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--device", choices=("fake", "cuda"), default="fake",
                    help="cuda: torch._C's real entry points on device 0 (with live tensors)")
    a = ap.parse_args()
    C = None
    if a.device == "cuda":
        C = torch._C
        keep = [torch.empty(1 << 16, device="cuda") for _ in range(2000)]  # live blocks
        keep.append(torch.ones(1, device="cuda"))
    run(200, C)  # warm
    best = None
    for _ in range(5):
        dt, n, cost = run(a.steps, C)
        us = 1e6 * dt / n
        best = us if best is None or us < best[0] else best
        best = (min(us, best[0] if isinstance(best, tuple) else us), n, 1e6 * cost / n)
    s, r = (1e6 * x for x in stats_alone(20000, C))
    print(f"{a.device}: boundaries: {best[1]}; wall per boundary {best[0]:.1f} us (best of 5); "
          f"tracker's own accounting {best[2]:.1f} us; the stats call alone {s:.1f} us (x2 per "
          f"boundary), the reset {r:.1f} us; wall minus those {best[0] - 2 * s - r:.1f} us")
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        run(a.steps, C)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
