"""A fake CUDA caching allocator for the tracker's memory and history interfaces (the methods of
gpumon.agent.phases.memory.CudaMemory and TorchHistory), written apart from the tracker's
replay: it *allocates* (best fit over free blocks, splits, merges, 2 MiB small-pool segments,
large segments of 20 MiB or rounded to 2 MiB) the way torch's allocator does, keeps torch's
counters, and records the history torch records (requested sizes only). The replay must
recover what it knows (block sizes, the allocated figure after every event) from what it shows.
"""
from __future__ import annotations

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


class FakeCuda:
    def __init__(self, device: int = 0, max_entries: int = 1 << 20) -> None:
        self.device = device
        self.segments: list[dict] = []  # {"address", "size", "small", "blocks": [[addr, size, req, state]]}
        self.next_addr = 0x7F0000000000
        self.cur = self.peak = self.acum = self.fcum = self.n_alloc = self.n_free = 0
        self.reserved = 0
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
            self.reserved += ss
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
        self.cur += b[1]
        self.peak = max(self.peak, self.cur)
        self.acum += b[1]
        self.n_alloc += 1
        self._emit("alloc", b[0], req)
        self.seq += 1
        self.truth.append(self.cur)
        return b[0]

    def free(self, addr: int) -> None:
        for seg in self.segments:
            for i, b in enumerate(seg["blocks"]):
                if b[0] == addr and b[3] == "active_allocated":
                    self.cur -= b[1]
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
                    self.seq += 1
                    self.truth.append(self.cur)
                    return
        raise KeyError(hex(addr))

    def empty_cache(self) -> None:
        for seg in list(self.segments):
            if len(seg["blocks"]) == 1 and seg["blocks"][0][3] == "inactive":
                self.segments.remove(seg)
                self.reserved -= seg["size"]
                self._emit("segment_free", seg["address"], seg["size"])

    # ---- CudaMemory's interface ------------------------------------------------------------
    def read(self, dev):
        if dev != self.device:
            return None
        return (self.cur, self.peak, self.reserved, 0, self.n_alloc, self.n_free, self.acum,
                self.fcum)

    def reset_peak(self) -> None:
        self.peak = self.cur

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
