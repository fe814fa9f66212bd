"""A fake CUDA caching allocator for the tracker's memory and history interfaces (the methods of
gpumon.agent.phases.memory.CudaMemory and TorchHistory), written apart from the tracker's
replay: it *allocates* (best fit over free blocks, splits, merges, 2 MiB small-pool segments,
large segments of 20 MiB or rounded to 2 MiB) the way torch's allocator does, keeps torch's
counters, and records the history torch records (requested sizes only). The replay must
recover what it knows (block sizes, the allocated figure after every event) from what it shows.

It also keeps torch's counters with torch's semantics (``stats()`` is what
``torch._C._cuda_memoryStats`` returns: every counter has current/peak/allocated/freed, per pool;
``reset_peak_stats()`` sets every peak to its current value, as ``resetPeakStats`` does), and
``C`` holds the two entry points under torch's names, so gpumon's counter path (counters.py)
and torch's own Python readers (``torch.cuda.max_memory_allocated``, ``memory_summary``, ...,
see ``as_torch_cuda``) run on it in CI.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import types

KMIN, SMALL, SMALL_BUF = 512, 1 << 20, 2 << 20
LARGE_BUF, MIN_LARGE, ROUND_LARGE = 20 << 20, 10 << 20, 2 << 20


def round_size(n: int) -> int:
    return KMIN if n < KMIN else (n + KMIN - 1) // KMIN * KMIN


def segment_size(size: int) -> int:
    if size <= SMALL:
        return SMALL_BUF
    if size < MIN_LARGE:
        return LARGE_BUF
    return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
              "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
POOLS = ("all", "large_pool", "small_pool")


class Stat:
    """c10's Stat: update_stat and reset_peak_stat."""
    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def update(self, amount: int) -> None:
        self.current += amount
        if amount > 0:
            self.allocated += amount
        else:
            self.freed -= amount
        self.peak = max(self.peak, self.current)

    def set(self, value: int) -> None:
        if value != self.current:
            self.update(value - self.current)

    def as_dict(self) -> dict:
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated,
                "freed": self.freed}


def _locked(fn):
    """Under the allocator's mutex, as torch's (another thread sees whole events only)."""
    @functools.wraps(fn)
    def inner(self, *a, **k):
        with self._mu:
            return fn(self, *a, **k)
    return inner


class FakeCuda:
    def __init__(self, device: int = 0, max_entries: int = 1 << 20) -> None:
        self._mu = threading.RLock()
        self.device = device
        self.segments: list[dict] = []  # {"address", "size", "small", "blocks": [[addr, size, req, state]]}
        self.next_addr = 0x7F0000000000
        self.acum = self.fcum = self.n_alloc = self.n_free = 0
        self.st = {n: {p: Stat() for p in POOLS} for n in STAT_NAMES}
        self.oversize = {"oversize_allocations": Stat(), "oversize_segments": Stat()}
        self.C = types.SimpleNamespace(_cuda_memoryStats=self.stats,
                                       _cuda_resetPeakMemoryStats=self.reset_peak_stats)
        self.seq = 0                 # events so far
        self.truth: list[int] = []   # allocated after every event (what torch's counter said)
        self.recording = False
        self.context = False         # stacks (the program's own recording)
        self.max_entries = max_entries
        self.trace: list[dict] = []
        self.time_us = 1_700_000_000_000_000
        self.starts = self.stops = self.clears = 0
        self.snapshots = 0
        self.lose_entries = False    # a broken history: drops every other entry

    # ---- torch's counters -------------------------------------------------------------------
    @property
    def cur(self) -> int:
        return self.st["allocated_bytes"]["all"].current

    @property
    def peak(self) -> int:
        return self.st["allocated_bytes"]["all"].peak

    @property
    def reserved(self) -> int:
        return self.st["reserved_bytes"]["all"].current

    def _upd(self, name: str, small: bool, amount: int) -> None:
        self.st[name]["all"].update(amount)
        self.st[name]["small_pool" if small else "large_pool"].update(amount)

    def _splits(self) -> None:
        """inactive_split(_bytes): inactive blocks of segments split in several blocks."""
        for small in (False, True):
            n = b = 0
            for seg in self.segments:
                if seg["small"] == small and len(seg["blocks"]) > 1:
                    for blk in seg["blocks"]:
                        if blk[3] == "inactive":
                            n += 1
                            b += blk[1]
            pool = "small_pool" if small else "large_pool"
            self.st["inactive_split"][pool].set(n)
            self.st["inactive_split_bytes"][pool].set(b)
        for name in ("inactive_split", "inactive_split_bytes"):
            self.st[name]["all"].set(self.st[name]["large_pool"].current
                                     + self.st[name]["small_pool"].current)

    @_locked
    def stats(self, device) -> dict:
        """torch._C._cuda_memoryStats(device): the nested dict."""
        if not isinstance(device, int):
            raise TypeError("invalid argument to memoryStats")
        if device != self.device:
            raise RuntimeError(f"Invalid device argument {device}")
        out: dict = {"num_alloc_retries": 0, "num_ooms": 0, "max_split_size": -1,
                     "num_sync_all_streams": 0, "num_device_alloc": len(self.segments),
                     "num_device_free": 0}
        for n in STAT_NAMES:
            out[n] = {p: s.as_dict() for p, s in self.st[n].items()}
        for n, s in self.oversize.items():
            out[n] = s.as_dict()
        return out

    @_locked
    def reset_peak_stats(self, device) -> None:
        """torch._C._cuda_resetPeakMemoryStats(device)."""
        if not isinstance(device, int):
            raise TypeError("invalid argument to resetPeakMemoryStats")
        if device != self.device:
            raise RuntimeError(f"Invalid device argument {device}")
        for pools in self.st.values():
            for s in pools.values():
                s.peak = s.current
        for s in self.oversize.values():
            s.peak = s.current

    # ---- the allocator --------------------------------------------------------------------
    def _emit(self, action: str, addr: int, size: int) -> None:
        self.time_us += 3
        if not self.recording:
            return
        if self.lose_entries and self.seq % 2:
            return
        e = {"action": action, "addr": addr, "size": size, "stream": 0,
             "time_us": self.time_us, "frames": [{"filename": "train.py", "line": 1,
                                                  "name": "f"}] if self.context else [],
             "compile_context": "N/A", "user_metadata": ""}
        self.trace.append(e)
        if len(self.trace) > self.max_entries:
            del self.trace[0]

    @_locked
    def malloc(self, req: int) -> int:
        size = round_size(req)
        small = size <= SMALL
        best = None
        for seg in self.segments:
            if seg["small"] != small:
                continue
            for b in seg["blocks"]:
                if b[3] == "inactive" and b[1] >= size and (best is None or b[1] < best[1][1]
                                                            or (b[1] == best[1][1]
                                                                and b[0] < best[1][0])):
                    best = (seg, b)
        if best is None:
            ss = segment_size(size)
            seg = {"address": self.next_addr, "size": ss, "small": small,
                   "blocks": [[self.next_addr, ss, 0, "inactive"]]}
            self.next_addr += ss + (1 << 21)
            self.segments.append(seg)
            self._upd("reserved_bytes", small, ss)
            self._upd("segment", small, 1)
            self._emit("segment_alloc", seg["address"], ss)
            best = (seg, seg["blocks"][0])
        seg, b = best
        rem = b[1] - size
        split = rem >= KMIN if small else rem > SMALL
        if split:
            i = seg["blocks"].index(b)
            seg["blocks"].insert(i + 1, [b[0] + size, rem, 0, "inactive"])
            b[1] = size
        b[2], b[3] = req, "active_allocated"
        for name, amount in (("allocated_bytes", b[1]), ("active_bytes", b[1]),
                             ("requested_bytes", req), ("allocation", 1), ("active", 1)):
            self._upd(name, small, amount)
        self._splits()
        self.acum += b[1]
        self.n_alloc += 1
        self._emit("alloc", b[0], req)
        self.seq += 1
        self.truth.append(self.cur)
        return b[0]

    @_locked
    def free(self, addr: int) -> None:
        for seg in self.segments:
            for i, b in enumerate(seg["blocks"]):
                if b[0] == addr and b[3] == "active_allocated":
                    small = seg["small"]
                    for name, amount in (("allocated_bytes", b[1]), ("active_bytes", b[1]),
                                         ("requested_bytes", b[2]), ("allocation", 1),
                                         ("active", 1)):
                        self._upd(name, small, -amount)
                    self.fcum += b[1]
                    self.n_free += 1
                    self._emit("free_requested", addr, b[2])
                    b[3] = "inactive"
                    self._emit("free_completed", addr, b[2])
                    blocks = seg["blocks"]
                    if i + 1 < len(blocks) and blocks[i + 1][3] == "inactive":
                        b[1] += blocks.pop(i + 1)[1]
                    if i > 0 and blocks[i - 1][3] == "inactive":
                        blocks[i - 1][1] += blocks.pop(i)[1]
                    self._splits()
                    self.seq += 1
                    self.truth.append(self.cur)
                    return
        raise KeyError(hex(addr))

    @_locked
    def empty_cache(self) -> None:
        for seg in list(self.segments):
            if len(seg["blocks"]) == 1 and seg["blocks"][0][3] == "inactive":
                self.segments.remove(seg)
                self._upd("reserved_bytes", seg["small"], -seg["size"])
                self._upd("segment", seg["small"], -1)
                self._emit("segment_free", seg["address"], seg["size"])

    # ---- CudaMemory's interface ------------------------------------------------------------
    def read(self, dev):
        if dev != self.device:
            return None
        return (self.cur, self.peak, self.reserved, 0, self.n_alloc, self.n_free, self.acum,
                self.fcum)

    def reset_peak(self) -> None:
        self.reset_peak_stats(self.device)

    # ---- TorchHistory's interface ----------------------------------------------------------
    def unavailable(self):
        return None

    def is_on(self) -> bool:
        return self.recording

    def start(self) -> None:
        self.recording, self.context = True, False
        self.trace = []
        self.starts += 1

    def clear(self) -> None:
        self.trace = []
        self.clears += 1

    def stop(self) -> None:
        self.recording = False
        self.trace = []
        self.stops += 1

    def record(self, context: bool = True, max_entries: int = 100_000) -> None:
        """The program's own ``_record_memory_history`` (stacks on, its ring size)."""
        self.recording, self.context, self.max_entries = True, context, max_entries

    def snapshot(self, traces: bool) -> dict:
        self.snapshots += 1
        segs = []
        for seg in self.segments:
            segs.append({"device": self.device, "address": seg["address"],
                         "total_size": seg["size"],
                         "segment_type": "small" if seg["small"] else "large",
                         "is_expandable": False,
                         "blocks": [{"address": b[0], "size": b[1], "requested_size": b[2],
                                     "state": b[3], "frames": []} for b in seg["blocks"]]})
        out = {"segments": segs, "device_traces": [[]] * self.device + [
            [dict(e) for e in self.trace] if traces else []],
            "allocator_settings": {"max_split_size": -1, "expandable_segments": False,
                                   "roundup_power2_divisions": {}}}
        if self.recording:
            self._emit("snapshot", 0, 0)  # torch adds one after each snapshot it records
        return out


@contextlib.contextmanager
def as_torch_cuda(torch, mem: "FakeCuda"):
    """torch's own Python readers (torch.cuda.memory_stats, max_memory_allocated,
    memory_summary, reset_peak_memory_stats, ...) on the fake: CUDA "initialised", device 0
    current, and torch._C's two entry points the fake's (gpumon's counter path then wraps
    torch._C's, as on a GPU: ``PeakCounters(torch._C)``). Restores everything after."""
    import torch.cuda.memory as tcm
    saved = [(tcm, "is_initialized", tcm.is_initialized),
             (tcm, "_get_device_index", tcm._get_device_index),
             (torch.cuda, "is_initialized", torch.cuda.is_initialized)]
    names = {"_cuda_memoryStats": mem.stats, "_cuda_resetPeakMemoryStats": mem.reset_peak_stats}
    had = {n: getattr(torch._C, n) for n in names if hasattr(torch._C, n)}

    def device_index(device=None, optional=False, allow_cpu=False):
        return 0 if device is None else int(getattr(device, "index", device) or 0)
    tcm.is_initialized = lambda: True
    torch.cuda.is_initialized = lambda: True
    tcm._get_device_index = device_index
    for n, f in names.items():
        setattr(torch._C, n, f)
    try:
        yield
    finally:
        for mod, name, v in saved:
            setattr(mod, name, v)
        for n in names:
            if n in had:
                setattr(torch._C, n, had[n])
            else:
                delattr(torch._C, n)
