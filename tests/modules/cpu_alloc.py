"""A CUDA-allocator stand-in for a CPU program, for the per-module measurement's tests: a
TorchDispatchMode that sees every storage the program's ops create (their real addresses and
byte sizes) and, through a weak reference, when each one dies, and keeps what torch's CUDA
caching allocator would show for them: the counters (``CudaMemory.read``'s tuple), the
segments, and the trace-only allocation history (``TorchHistory``'s methods). Blocks are the
request rounded up to 512 bytes (an allocator with expandable segments), so the measurement's
replay has the real program's tensors to find, and the test knows the truth after every event.

Enter it before the model is built: storages made before it are unknown to it.
"""
from __future__ import annotations

import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only


def r512(n: int) -> int:
    return 512 if n < 512 else (n + 511) // 512 * 512


class CpuAllocHistory(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}   # addr -> requested bytes
        self.cur = self.peak = self.n_alloc = self.n_free = self.acum = self.fcum = 0
        self.recording = False
        self.trace: list[dict] = []
        self.truth: list[int] = []      # allocated after every alloc/free
        self.starts = self.stops = 0
        self.tagger = None              # the test's oracle: called at every allocation
        self.tags: list = []            # its answer per recorded allocation

    # ---- the allocator, seen through the ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            return
        st = t.untyped_storage()
        addr, n = st.data_ptr(), st.nbytes()
        if n == 0 or addr in self.live:
            return
        self.live[addr] = n
        b = r512(n)
        self.cur += b
        self.peak = max(self.peak, self.cur)
        self.n_alloc += 1
        self.acum += b
        self._emit("alloc", addr, n)
        self.truth.append(self.cur)
        weakref.finalize(st, self._free, addr)

    def _free(self, addr: int) -> None:
        n = self.live.pop(addr, None)
        if n is None:
            return
        b = r512(n)
        self.cur -= b
        self.n_free += 1
        self.fcum += b
        self._emit("free_requested", addr, n)
        self._emit("free_completed", addr, n)
        self.truth.append(self.cur)

    def _emit(self, action: str, addr: int, size: int) -> None:
        if self.recording:  # torch's trace clock: unix microseconds
            self.trace.append({"action": action, "addr": addr, "size": size, "stream": 0,
                               "time_us": time.time_ns() // 1000, "frames": []})
            if action == "alloc":
                self.tags.append(self.tagger() if self.tagger is not None else None)

    # ---- CudaMemory's interface
    def read(self, dev):
        if dev != 0:
            return None
        return (self.cur, self.peak, self.cur, 0, self.n_alloc, self.n_free, self.acum,
                self.fcum)

    # ---- TorchHistory's interface
    def unavailable(self):
        return None

    def is_on(self) -> bool:
        return self.recording

    def start(self) -> None:
        self.recording, self.trace = True, []
        self.starts += 1

    def stop(self) -> None:
        self.recording, self.trace = False, []
        self.stops += 1

    def snapshot(self, traces: bool) -> dict:
        segs = [{"device": 0, "address": a, "total_size": r512(n), "segment_type": "small",
                 "blocks": [{"address": a, "size": r512(n), "requested_size": n,
                             "state": "active_allocated"}]} for a, n in self.live.items()]
        return {"segments": segs, "device_traces": [list(self.trace) if traces else []],
                "allocator_settings": {"expandable_segments": True}}
