"""What the tracker reads of the CUDA caching allocator: its counters (at every phase boundary
of a measured step) and its allocation history (for the exact peaks). Both are C++ reads under
the allocator's own lock: no CUDA call, no tensor of the program. Tests give fakes with the
same methods.
"""
from __future__ import annotations

from typing import Any

# What ``read`` returns, by index. The counters after RETRIES are what the exact-peak meter
# needs (a reader without them gives the first four only, and steps are then not replayed).
ALLOCATED, PEAK, RESERVED, RETRIES, N_ALLOC, N_FREE, BYTES_ALLOC, BYTES_FREED = range(8)

# The trace-only ring the meter turns on: more than any one step makes (the blog's 1.5B model
# makes 11-12k entries a step); torch grows it as needed, so a short step costs little.
TRACE_MAX_ENTRIES = 500_000


class CudaMemory:
    """One ``torch._C._cuda_memoryStats`` call per device per read (no flatten): allocated,
    peak, reserved, retries, and the cumulative counters (allocations and frees, and their
    bytes) that pin a phase boundary to a place in the allocation history."""

    def __init__(self, torch_mod: Any) -> None:
        self._stats = torch_mod._C._cuda_memoryStats

    def read(self, dev: Any) -> tuple | None:
        if not isinstance(dev, int):
            return None
        s = self._stats(dev)
        if not s:
            return None
        a = s["allocated_bytes"]["all"]
        n = s.get("allocation", {}).get("all")
        if n is None:
            return (int(a["current"]), int(a["peak"]), int(s["reserved_bytes"]["all"]["current"]),
                    int(s.get("num_alloc_retries", 0)))
        return (int(a["current"]), int(a["peak"]), int(s["reserved_bytes"]["all"]["current"]),
                int(s.get("num_alloc_retries", 0)), int(n["allocated"]), int(n["freed"]),
                int(a["allocated"]), int(a["freed"]))


class NoMemory:
    def read(self, dev: Any) -> None:
        return None


class TorchHistory:
    """The meter's access to torch's allocation history (gpumon/agent/history.py says who may
    turn it on and off)."""

    def __init__(self, torch_mod: Any) -> None:
        self.torch = torch_mod
        self._snap_form = 0  # 0: (pool, pool, include_traces) (torch >= 2.9); 1: None; 2: ()

    def unavailable(self) -> str | None:
        t = self.torch
        C = t._C
        if not hasattr(C, "_cuda_memorySnapshot") or not hasattr(C, "_cuda_isHistoryEnabled"):
            return f"torch {t.__version__} has no allocation history to replay"
        mem = getattr(getattr(t, "cuda", None), "memory", None)
        if mem is None or not hasattr(mem, "_record_memory_history"):
            return f"torch {t.__version__} has no allocation history to replay"
        try:
            backend = t.cuda.get_allocator_backend()
        except Exception:
            backend = "native"
        if backend != "native":
            return f"the {backend} allocator keeps no allocation history"
        return None

    def is_on(self) -> bool:
        return bool(self.torch._C._cuda_isHistoryEnabled())

    def start(self) -> None:
        """Trace only: no stacks, no context (the cheapest history torch has)."""
        rec = self.torch.cuda.memory._record_memory_history
        try:
            rec(enabled="all", context=None, stacks="python", max_entries=TRACE_MAX_ENTRIES,
                clear_history=True)
        except TypeError:  # torch < 2.8: no clear_history (turning it off clears it)
            rec(enabled="all", context=None, stacks="python", max_entries=TRACE_MAX_ENTRIES)

    def clear(self) -> None:
        """Keep the trace-only history on, without its entries (ours only)."""
        try:
            self.torch.cuda.memory._record_memory_history(
                enabled="all", context=None, stacks="python", max_entries=TRACE_MAX_ENTRIES,
                clear_history=True)
        except TypeError:
            self.stop()
            self.start()

    def stop(self) -> None:
        self.torch.cuda.memory._record_memory_history(enabled=None)

    def snapshot(self, traces: bool) -> dict:
        """The allocator's segments and, with ``traces`` (or on a torch that cannot leave them
        out), its history, as ``torch.cuda.memory._snapshot()`` gives them."""
        snap = self.torch._C._cuda_memorySnapshot
        while True:
            form = self._snap_form
            try:
                if form == 0:
                    return snap((0, 0, bool(traces)))
                return snap(None) if form == 1 else snap()
            except (TypeError, RuntimeError):
                if form >= 2:
                    raise
                self._snap_form = form + 1
