"""Where the phase tracker's time goes INSIDE a real training loop (issue 35), not in a tight one:
timers around torch's counter read, the reset, PeakCounters.boundary and the tracker's _boundary,
on the blog loop or the Python-bound MLP (benchmarks/phases_overhead.py's workloads). Inside a
loop every call is 2-3x slower than in boundary_cost.py's tight loop (cold caches), so this is
the figure to cut. Prints medians, means and p90s a call and a step.

    python benchmarks/boundary_inloop.py [--workload mlp|blog] [--layers N] [--device cuda|cpu]
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("mlp", "blog"), default="blog")
    ap.add_argument("--layers", type=int, default=None, help="cut the blog model (a CPU try)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=None, help="default: 200 (mlp), 20 (blog)")
    ap.add_argument("--fake-counters", action="store_true",
                    help="on CPU: the counter path over boundary_cost.py's fake torch._C (a "
                         "nested dict of torch 2.11's 122 keys a read), so the tracker's Python "
                         "runs inside a real loop without a GPU")
    a = ap.parse_args(argv)
    import torch

    import phases_overhead as po
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if a.workload == "blog":
        model, opt, ids = po.build_blog(torch, device, 2, a.layers)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        model, opt = po.build(torch, device, 24, 256)
        x = torch.randn(32, 256, device=device)

        def step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    n = a.steps or (200 if a.workload == "mlp" else 20)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if a.fake_counters:
        from boundary_cost import FakeC

        from gpumon.agent.phases import PhaseTracker
        from gpumon.agent.phases.counters import PeakCounters
        from gpumon.agent.phases.tracker import PHASES_BUDGET
        memory = PeakCounters(FakeC())
        tracker = PhaseTracker(torch, lambda k, p: None, lambda: [0], memory,
                               budget=PHASES_BUDGET, history=None)
    else:
        tracker, _, memory, _ = po.make_tracker(torch, device, [])
    times: dict = collections.defaultdict(list)

    def timed(name, f):
        def w(*args, **kw):
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                times[name].append(time.perf_counter() - t0)
        return w

    if hasattr(memory, "_stats"):  # the counter path: its two C entry points
        memory._stats = timed("counters read", memory._stats)
        memory._reset = timed("counters reset", memory._reset)
        # the boundary calls them through this chain (timed, it is no longer one C chain)
        memory._seq = (memory._stats, memory._reset, memory._stats)
        memory.boundary = timed("PeakCounters.boundary", memory.boundary)
        if hasattr(memory, "take"):  # a forward's start takes the counters, settled after it
            memory.take = timed("PeakCounters.take", memory.take)
            memory.settle = timed("PeakCounters.settle", memory.settle)
    tracker._boundary = timed("tracker._boundary", tracker._boundary)
    # the root forward's pre-hook whole: what a loop that syncs every step waits for
    tracker.hooks._root_called = timed("root pre-hook", tracker.hooks._root_called)
    if hasattr(tracker, "_settle"):
        tracker._settle = timed("tracker._settle", tracker._settle)
    tracker._maybe_close_step = timed("tracker._maybe_close_step", tracker._maybe_close_step)
    if hasattr(tracker, "_report_closed"):  # the closed step's event, built after the forward
        tracker._report_closed = timed("tracker._report_closed", tracker._report_closed)
    def a_step(warm: int) -> tuple[float, float]:
        """Seconds a step over n steps after ``warm`` untimed ones, and the tracker's own."""
        for _ in range(warm):
            step()
        times.clear()
        c0 = tracker.cost_total
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        return (time.perf_counter() - t0) / n, (tracker.cost_total - c0) / n

    off, _ = a_step(3)
    tracker.install_hooks()
    on, own = a_step(5)
    tracker.close()
    print(f"{device} {a.workload}: step {1000 * off:.2f} ms without the tracker, {1000 * on:.2f} ms "
          f"with it; its own time {1e6 * own:.0f} us a step")
    for k, v in times.items():
        print(f"  {k:28s} {len(v) / n:5.1f} a step  median {1e6 * statistics.median(v):7.1f}  "
              f"mean {1e6 * statistics.mean(v):7.1f}  p90 {1e6 * sorted(v)[int(0.9 * len(v))]:7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
