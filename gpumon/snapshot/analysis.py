"""Analysis of a loaded memory snapshot: the active-memory timeline, the peak, what is live at
any event, segments and fragmentation, step annotations and the OOM.

The timeline follows torch's own MemoryViz.js (`process_alloc_data`): an `alloc` adds its size, a
`free_completed` (or a `free_requested` immediately followed by its `free_completed`, which
MemoryViz merges into one `free`) subtracts it; `free_requested` alone frees nothing. The trace is
a ring that starts mid-run, so memory already live when it starts is counted from the start: a
free of an address never allocated in the trace is a block that was live from the beginning, and
every `active_allocated` block in `segments` not allocated in the trace was live throughout.
That makes the timeline absolute (what `torch.cuda.memory_allocated()` would say, in requested
bytes, as MemoryViz plots it).

Each device's trace is held in compact arrays (packed.PackedTrace: no per-event dicts; the
loader packs them while it reads the file); stacks are interned (torch shares identical frame
lists, so interning by identity is cheap).
"""
from __future__ import annotations

import bisect
import itertools
import os
from array import array

from .frames import (  # noqa: F401  (fmt_frame, is_user_frame: re-exported, named here)
    GLUE_FUNCTIONS, cpp_caller, fmt_frame, frame_tuple, is_shown_frame, is_user_frame,
    library_of, python_first, short_path)
from .load import SnapshotError, gc_paused, int_field as _i
from .packed import (  # noqa: F401  (re-exported: the action codes live with the columns)
    A_ALLOC, A_FREE_DONE, A_FREE_REQ, A_OOM, A_OTHER, A_SEG_ALLOC, A_SEG_FREE, A_SEG_MAP,
    A_SEG_UNMAP, A_SNAPSHOT, ACTIONS, PackedTrace)

NO_STACK = "<allocated before recording started>"
# An allocation inside the window whose event carries no frame at all. Which code made it is not
# in the file (stacks='python' records nothing for C++ code with no Python caller, such as
# autograd's backward thread; context=None records no stack at all): say only what is known.
NO_PY_STACK = "<no stack recorded>"
NO_PY_STACK_HELP = ("the trace holds no frame for this allocation: C++ code with no Python "
                    "caller made it while stacks='python' (autograd's backward thread, for "
                    "one), or the recording kept no stacks; record with stacks='all' to see "
                    "the C++ caller")

def _blocks(seg: dict) -> list:
    b = seg.get("blocks")
    return b if type(b) is list else []


def segment_blocks(seg: dict):
    """(block, address, size) for each block of a segment at the dump, in order; a block
    without an address starts where the one before it ends (old dumps)."""
    base = _i(seg.get("address", 0))
    for b in _blocks(seg):
        if isinstance(b, dict):
            bsize = _i(b.get("size", 0))
            baddr = _i(b["address"]) if "address" in b else base
            base = baddr + bsize
            yield b, baddr, bsize


def live_blocks(segments, device: int | None = None):
    """The allocations the segments at the dump hold (active_allocated blocks), as
    (address, requested bytes, frames or None, block size); `device` keeps one device's
    segments. The one walk the replay (DeviceTrace) and a window's seed (window.Seeder) share:
    the requested size and the stack come from the block, else from its first history entry."""
    for seg in segments:
        if device is not None and _i(seg.get("device", device)) != device:
            continue
        for b, baddr, bsize in segment_blocks(seg):
            if b.get("state") != "active_allocated":
                continue
            req = b.get("requested_size")
            fr = b.get("frames")
            if fr is None and isinstance(b.get("history"), list) and b["history"]:
                h = b["history"][0]
                fr = h.get("frames") if isinstance(h, dict) else None
                if req is None and isinstance(h, dict):
                    req = h.get("real_size")
            yield (baddr, _i(req) if req is not None else bsize,
                   fr if type(fr) is list else None, bsize)


# The largest size a segment, a block or an event may have (2**56 bytes, 64 PiB: no device
# comes near; sums of such sizes stay inside the 64-bit columns).
MAX_SIZE = 1 << 56

GROUP_BY = ("line", "function", "file", "library", "category", "module")
# The profiler's categories (torch.profiler._memory_profiler.Category, lower-cased as
# torch.cuda._memory_viz writes them into a snapshot's alloc events), in the order the chart
# stacks them from the bottom: what lives longest first.
CATEGORIES = ("parameter", "optimizer_state", "input", "gradient", "activation",
              "autograd_detail", "temporary", "unknown")
NO_CATEGORY = "<no category>"


def fmt_bytes(n: float) -> str:
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} PiB"


class _Record:
    """A small record class (what a dataclass gives, without importing dataclasses: the view's
    first screen counts every millisecond of import)."""
    __slots__ = ()

    def __eq__(self, other):
        return type(other) is type(self) and all(
            getattr(self, k) == getattr(other, k) for k in self.__slots__)

    def __repr__(self):
        return f"{type(self).__name__}(" + ", ".join(
            f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


class Group(_Record):
    """Live allocations that share the first user frame of their stack: key "file.py:12 fn"
    (basename), NO_STACK, NO_PY_STACK or "<no user frame>"; frame (filename, line, name) of
    that frame or None; elements: element ids, largest first."""
    __slots__ = ("key", "frame", "bytes", "count", "elements")

    def __init__(self, key: str, frame: tuple | None, bytes: int = 0, count: int = 0,
                 elements: list | None = None):
        self.key, self.frame, self.bytes, self.count = key, frame, bytes, count
        self.elements = [] if elements is None else elements


class SegmentInfo(_Record):
    """One segment: allocated = bytes of active_allocated blocks (rounded block sizes),
    requested = bytes the program asked for in those blocks, pending_free =
    active_pending_free (freed, waiting on another stream), free = inactive blocks (cached,
    reusable), pool "large" / "small" / "?"."""
    __slots__ = ("address", "total", "allocated", "requested", "pending_free", "free",
                 "largest_free", "blocks", "stream", "pool", "expandable")

    def __init__(self, address: int, total: int, allocated: int, requested: int,
                 pending_free: int, free: int, largest_free: int, blocks: int, stream: int,
                 pool: str, expandable: bool):
        self.address, self.total, self.allocated, self.requested = \
            address, total, allocated, requested
        self.pending_free, self.free, self.largest_free, self.blocks = \
            pending_free, free, largest_free, blocks
        self.stream, self.pool, self.expandable = stream, pool, expandable


class DeviceTrace:
    """One device's trace in arrays plus the allocation elements replayed from it."""

    def __init__(self, snap: dict, device: int, replayed: tuple | None = None):
        """`replayed`: (allocated, base, peak, peak_index, reserved) kept from an earlier replay
        of the same file (cache.replay_get): the first screen needs only these, and the rest
        of the replay (the allocation elements) is made when first asked for."""
        self.device = device
        traces = snap["device_traces"]
        events = traces[device] if 0 <= device < len(traces) else []
        # the streaming loader packs the events while it reads them; a dict built in memory
        # (tests, old callers) still holds lists of event dicts
        packed = events if isinstance(events, PackedTrace) else PackedTrace(events)
        self.packed = packed
        self.frames_table: list = packed.frames_table
        self._intern = packed.intern
        self.action, self.addr, self.size = packed.action, packed.addr, packed.size
        self.time_us, self.fid = packed.time_us, packed.fid
        self.skipped = packed.skipped
        self.n = len(self.action)
        self.segments = [s for s in snap["segments"] if _i(s.get("device", device)) == device]
        st = snap.get("allocator_settings")
        self._settings = st if isinstance(st, dict) else {}
        # a time window of a longer trace (load.py window=): events [lo, hi) of n_total
        win = snap.get("_gpumon_window")
        self.window = win.get(device) if isinstance(win, dict) else None
        self.window_offset = self.window["lo"] if self.window else 0
        self.n_total = self.window["n"] if self.window else self.n
        self._seg_events: list[int] | None = None
        self._check_sizes()
        reserved = None
        if replayed is not None and not self.window and len(replayed[0]) == self.n:
            self.allocated, self.base, self.peak, self.peak_index, reserved = replayed
        else:
            self._replay_now()
        self._seg_infos: list[SegmentInfo] | None = None
        self._resolved: dict[int, tuple] = {}
        self._shown: dict[int, tuple] = {}
        self._where: dict[int, tuple] = {}
        self._reserved: array | None = reserved if reserved is not None and \
            len(reserved) == self.n else None
        self._categories: list[str] | None = None
        self._cat_series: dict[str, array] = {}
        # names what has no Python frame from the sidecar (naming.py); set by Snapshot.trace
        self.namer_factory = None
        self._namer = None

    def _check_sizes(self):
        """Refuse sizes no allocator makes (a hostile or broken file), in one line, before any
        sum of them overflows a 64-bit column: a negative size, a segment or block larger than
        MAX_SIZE, or segments whose sizes add up past it. An OOM event's size (what was asked)
        may be anything up to 2**63: it is only printed."""
        where = f"device {self.device}"
        total = 0
        for s in self.segments:
            ts = _i(s.get("total_size", 0))
            if not 0 <= ts <= MAX_SIZE:
                raise SnapshotError(f"{where}: a segment of {ts:,} bytes; this is not a real "
                                    "memory snapshot")
            total += ts
            for _b, _ba, bs in segment_blocks(s):
                if not 0 <= bs <= MAX_SIZE:
                    raise SnapshotError(f"{where}: a block of {bs:,} bytes; this is not a real "
                                        "memory snapshot")
        if total > MAX_SIZE:
            raise SnapshotError(f"{where}: the segments add up to {total:,} bytes; this is not "
                                "a real memory snapshot")
        size = self.size
        if self.n and (min(size) < 0 or max(size) > MAX_SIZE):
            act = self.action
            bad = next((i for i in range(self.n) if size[i] < 0 or
                        size[i] > MAX_SIZE and act[i] != A_OOM), None)
            if bad is not None:
                raise SnapshotError(f"{where}: event {bad + self.window_offset:,} "
                                    f"({ACTIONS[act[bad]]}) has a size of {size[bad]:,} bytes; "
                                    "this is not a real memory snapshot")
        seg = self._segment_events()
        tail = self.window["tail_seg"] if self.window else ()
        if sum(size[k] for k in seg) + sum(abs(_i(t[2])) for t in tail) + total > MAX_SIZE:
            raise SnapshotError(f"{where}: the segment events add up to more than "
                                f"{MAX_SIZE:,} bytes; this is not a real memory snapshot")

    # -- replay (MemoryViz semantics) ------------------------------------------------------
    _REPLAYED = ("el_addr", "el_size", "el_fid", "el_start", "el_end", "n_allocs",
                 "n_freed_only", "seeded", "_seed_freed")

    def _replay_now(self):
        try:
            self._replay(self.window["seed"] if self.window else None)
        except OverflowError:  # sums past 2**63 bytes: no allocator ever made this trace
            raise SnapshotError(f"device {self.device}: the trace's sizes add up to more than "
                                "8 EiB; this is not a real memory snapshot") from None

    def _replay(self, seed=None):
        """The allocation elements and the allocated bytes after each event. `seed` (a time
        window of a longer trace, see load.py): the allocations live when the window starts, as
        (addr, size, frames, freed_only) — the segments at the dump then say nothing about the
        window, and their blocks are not added."""
        n = self.n
        act, addr, size, fid = self.action, self.addr, self.size, self.fid
        live: dict[int, int] = {}
        starts: list[int] = []     # the alloc event of each element made in the trace
        ends: list[int] = []
        free_ev: list[int] = []    # frees of blocks allocated before the trace's window began
        free_at: list[int] = []
        windowed = seed is not None
        seed = seed or []
        seed_end = [n] * len(seed)
        for k, sd in enumerate(seed):
            live[sd[0]] = -1 - k
        prev_a = prev_ad = -1
        for i, a, ad in zip(range(n), act, addr):
            if a == A_ALLOC:
                live[ad] = len(starts)
                starts.append(i)
                ends.append(n)
            elif a == A_FREE_DONE:
                # MemoryViz merges free_requested + free_completed into one free at the former
                at = i - 1 if (prev_a == A_FREE_REQ and prev_ad == ad) else i
                j = live.pop(ad, None)
                if j is None:
                    free_ev.append(i)
                    free_at.append(at)
                elif j >= 0:
                    ends[j] = at
                else:
                    seed_end[-1 - j] = at
            prev_a, prev_ad = a, ad
        el_addr = array("q", [addr[i] for i in starts] + [addr[i] for i in free_ev])
        el_size = array("q", [size[i] for i in starts] + [size[i] for i in free_ev])
        el_fid = array("l", [fid[i] for i in starts] + [fid[i] for i in free_ev])
        el_start = array("l", starts)
        el_start.extend(array("l", [-1]) * len(free_ev))
        el_end = array("l", ends)
        el_end.extend(array("l", free_at))
        # elements [n_allocs, n_freed_only) carry the stack of their free, not their alloc
        self.n_allocs = len(starts)
        self.n_freed_only = len(el_addr)
        self.seeded = len(seed)
        for k, (sa, ss, sfr, _freed) in enumerate(seed):
            el_addr.append(sa); el_size.append(ss)
            el_fid.append(self._intern(sfr) if type(sfr) is list else 0)
            el_start.append(-1); el_end.append(seed_end[k])
        self._seed_freed = [self.n_freed_only + k for k, sd in enumerate(seed) if sd[3]]
        for baddr, req, fr, _bsize in live_blocks(self.segments if not windowed else ()):
            if baddr not in live:
                el_addr.append(baddr); el_size.append(req)
                el_fid.append(self._intern(fr) if fr is not None else 0)
                el_start.append(-1); el_end.append(n)
        self.el_addr, self.el_size, self.el_fid = el_addr, el_size, el_fid
        self.el_start, self.el_end = el_start, el_end
        delta = array("q", [0]) * n
        base = 0
        for s, e, sz in zip(el_start, el_end, el_size):
            if s < 0:
                base += sz
            else:
                delta[s] += sz
            if e < n:
                delta[e] -= sz
        self.base = base  # bytes live when the trace window starts
        if n:
            delta[0] += base
            self.allocated = array("q", itertools.accumulate(delta))
        else:
            self.allocated = array("q")
        del delta
        if n:
            self.peak = max(self.allocated)
            self.peak_index = self.allocated.index(self.peak)
        else:
            self.peak, self.peak_index = base, -1

    # -- the profiler's categories -----------------------------------------------------------
    @property
    def categories(self) -> list[str]:
        """The categories the trace's allocations carry (a snapshot made from the profiler's
        memory timeline has them), in stacking order; [] for a plain snapshot."""
        if self._categories is None:
            cat = self.packed.category
            if not cat:
                self._categories = []
            else:
                names = {str(v).lower() for v in cat.values()}
                self._categories = [c for c in CATEGORIES if c in names] + \
                    sorted(names - set(CATEGORIES))
        return self._categories

    def el_category(self, j: int) -> str | None:
        """The category of element j (from its alloc event), or None."""
        cat = self.packed.category
        if not cat:
            return None
        s = self.el_start[j]
        v = cat.get(s) if s >= 0 else None
        return str(v).lower() if v is not None else None

    def category_series(self, name: str) -> array:
        """Bytes allocated by elements of one category after each event (the trace's share
        of allocated; elements with no category are not in any series)."""
        r = self._cat_series.get(name)
        if r is None:
            n = self.n
            delta = array("q", [0]) * n
            for j in range(len(self.el_start)):
                if self.el_category(j) != name:
                    continue
                st, en, sz = self.el_start[j], self.el_end[j], self.el_size[j]
                delta[max(0, st)] += sz
                if en < n:
                    delta[en] -= sz
            r = self._cat_series[name] = array("q", itertools.accumulate(delta)) if n \
                else array("q")
        return r

    def freed_only(self, j: int) -> bool:
        """Whether element j's alloc is not in the trace and its stack is its free's."""
        return self.n_allocs <= j < self.n_freed_only or j in self._seed_freed

    # -- allocated as torch counts it: blocks -------------------------------------------------
    def _dump_block_size(self) -> dict[int, int]:
        """Block size by address of the active_allocated blocks at the dump (for a window:
        only those whose allocation live at the window's end is still live at the dump)."""
        out = {}
        keep = self.window["dump_live"] if self.window else None
        for s in self.segments:
            for b, ba, bs in segment_blocks(s):
                if b.get("state") == "active_allocated" and (keep is None or ba in keep):
                    out[ba] = bs
        return out

    def _block_replay(self):
        """What `torch.cuda.memory_allocated()` counted after each event: the sizes of the
        allocator's blocks, not the bytes requested. A block is the request rounded up to
        512 B, or, in the large pool (rounded requests over 1 MiB), the whole free block it
        was cut from when what would remain is 1 MiB or less (the allocator does not split
        it; nor a block of max_split_size or more). The free block an allocation is cut from
        runs from its address to the next large block in use (allocated, or freed but not yet
        completed: small blocks live in segments of their own) or the end of its segment: the
        replay follows the segments (forward from the start, rebuilt back from the dump) and
        the large blocks in use. A block still there at the dump has the dump's size. torch
        counts a block out at its free_requested (the block stays in use until
        free_completed). Sets allocated_blocks, peak_blocks, peak_blocks_index, blocks_exact
        (False where the file leaves a block's size open: a large block made before the
        recording and freed in it, expandable segments or rounding to powers of two),
        block_rule_misses (blocks at the dump whose size the rule got wrong: 0 on every file
        checked) and el_block (each element's block size)."""
        n = self.n
        act, addr = self.action, self.addr
        el_addr, el_size, el_start, el_end = self.el_addr, self.el_size, self.el_start, \
            self.el_end
        settings = self._settings
        mss = _i(settings.get("max_split_size", -1))
        div = settings.get("roundup_power2_divisions")
        seg_ev = self._segment_events()
        expandable = bool(settings.get("expandable_segments"))
        exact = not expandable and not (
            isinstance(div, dict) and any(_i(v) > 1 for v in div.values())) \
            and not any(act[k] in (A_SEG_MAP, A_SEG_UNMAP) for k in seg_ev)
        dump = self._dump_block_size()
        big = 1 << 20
        n_el = len(el_addr)
        bsize = [(z + 511) // 512 * 512 if z > 512 else 512 for z in el_size]
        # where each block stops being in use: free_completed (el_end is memory_viz's free,
        # at the free_requested just before it when there is one)
        done = [e if e >= n or act[e] == A_FREE_DONE and addr[e] == el_addr[j] else e + 1
                for j, e in enumerate(el_end)]
        # the large blocks, in time order with the segment events: the gap rule's sweep
        ops = []
        used: list[int] = []
        for j in range(n_el):
            if bsize[j] > big:
                s0 = el_start[j]
                if s0 < 0:
                    used.append(el_addr[j])
                    if el_end[j] < n:
                        exact = False   # made before the recording, freed in it: size open
                else:
                    ops.append((s0, 1, j))
                if done[j] < n:
                    ops.append((done[j], 0, j))
        ops += [(k, 2, k) for k in seg_ev]
        ops.sort()
        used.sort()
        if n:   # the segments before the first event (segments_at(-1)'s, without its blocks)
            segs = {a: v[0] for a, v in self._segments_after(-1, blocks=False)[0].items()}
        else:
            segs = {s.address: s.total for s in self.segments_at(-1)}
        seg_starts = sorted(segs)
        misses = 0
        size = self.size
        for _i_ev, kind, j in ops:
            if kind == 1:     # a large alloc
                ad, r = el_addr[j], bsize[j]
                k = bisect.bisect_right(seg_starts, ad) - 1
                end = seg_starts[k] + segs[seg_starts[k]] if k >= 0 else ad + r
                if end < ad + r:
                    end = ad + r
                u = bisect.bisect_right(used, ad)
                if u < len(used) and used[u] < end:
                    end = used[u]
                # with expandable segments the allocator splits any remainder of 512 B or more
                b = end - ad if not expandable and (end - ad - r <= big or 0 < mss <= r) else r
                if el_end[j] >= n and ad in dump:
                    if dump[ad] != b:
                        misses += 1
                    b = dump[ad]
                bsize[j] = b
                bisect.insort(used, ad)
            elif kind == 0:   # its free_completed
                ad = el_addr[j]
                u = bisect.bisect_left(used, ad)
                if u < len(used) and used[u] == ad:
                    del used[u]
            else:             # a segment event
                a, ad, sz = act[j], addr[j], size[j]
                cur = segs.get(ad)
                if a == A_SEG_ALLOC or a == A_SEG_MAP:
                    if cur is not None:
                        segs[ad] = cur + sz
                    else:
                        segs[ad] = sz
                        bisect.insort(seg_starts, ad)
                elif cur is not None:
                    if cur > sz:
                        segs[ad] = cur - sz
                    else:
                        del segs[ad]
                        del seg_starts[bisect.bisect_left(seg_starts, ad)]
        # the blocks live at the dump that the trace did not make, and small ones: the dump's
        for j in range(n_el):
            if el_end[j] >= n and (el_start[j] < 0 or bsize[j] <= big):
                b = dump.get(el_addr[j])
                if b is not None:
                    if el_start[j] >= 0 and b != bsize[j]:
                        misses += 1
                    bsize[j] = b
        # torch counts a block out at its free_requested: el_end, unless the request came
        # earlier (a block used on another stream waits for its events) or at the end
        free_at = list(el_end)
        raw = act.tobytes()
        req = bytes([A_FREE_REQ])
        # most files: every free_requested is followed at once by its free_completed
        k = raw.find(req) if raw.count(req) != raw.count(bytes([A_FREE_REQ, A_FREE_DONE])) \
            else -1
        late: dict[int, list[int]] = {}
        while k >= 0:
            if k + 1 >= n or act[k + 1] != A_FREE_DONE or addr[k + 1] != addr[k]:
                late.setdefault(addr[k], []).append(k)
            k = raw.find(req, k + 1)
        if late:
            for j in range(n_el):
                ks = late.get(el_addr[j])
                if ks:
                    s0, e = el_start[j], el_end[j]
                    for k in ks:
                        if s0 < k < e:
                            free_at[j] = k
                            break
        delta = array("q", [0]) * max(1, n)
        base = 0
        for s0, fa, b in zip(el_start, free_at, bsize):
            if s0 < 0:
                base += b
            else:
                delta[s0] += b
            if fa < n:
                delta[fa] -= b
        self.blocks_base = base
        self.el_block = bsize
        if n:
            delta[0] += base
            self.allocated_blocks = array("q", itertools.accumulate(delta))
            m = max(self.allocated_blocks)
            self.peak_blocks, self.peak_blocks_index = m, self.allocated_blocks.index(m)
        else:
            self.allocated_blocks = array("q")
            self.peak_blocks, self.peak_blocks_index = base, -1
        self.blocks_exact = exact
        self.block_rule_misses = misses

    def __getattr__(self, name):
        # the allocation elements, when the first screen was drawn from a kept replay
        if name in DeviceTrace._REPLAYED:
            with gc_paused():
                self._replay_now()
            return self.__dict__[name]
        # the block replay is computed the first time one of its figures is asked for
        if name in ("allocated_blocks", "peak_blocks", "peak_blocks_index", "blocks_exact",
                    "block_rule_misses", "el_block", "blocks_base"):
            self._block_replay()
            return self.__dict__[name]
        raise AttributeError(name)

    # -- reserved (the segments) over time -------------------------------------------------
    @property
    def reserved(self) -> array:
        """Bytes reserved in segments after each event, rebuilt backward from the segments at
        the dump (as memory_viz does): a segment_alloc/segment_map adds its size, a
        segment_free/segment_unmap takes it away."""
        if self._reserved is None:
            n, act, size = self.n, self.action, self.size
            end = sum(_i(s.get("total_size", 0)) for s in self.segments)
            if self.window:  # the segment events after the window, undone
                end -= sum(sz if a in (A_SEG_ALLOC, A_SEG_MAP) else -sz
                           for a, _ad, sz in self.window["tail_seg"])
            delta = array("q", [0]) * n
            raw = act.tobytes()
            for code, sign in ((A_SEG_ALLOC, 1), (A_SEG_MAP, 1), (A_SEG_FREE, -1),
                               (A_SEG_UNMAP, -1)):
                b = bytes([code])
                k = raw.find(b)
                while k >= 0:
                    delta[k] += sign * size[k]
                    k = raw.find(b, k + 1)
            total = sum(delta) if n else 0
            # the window may start mid-run: what was reserved then is the end minus the changes
            cum = array("q", itertools.accumulate(delta, initial=end - total)) if n \
                else array("q", [0])
            del cum[0]
            if n and min(cum) < 0:
                cum = array("q", (max(0, c) for c in cum))
            self._reserved = cum
        return self._reserved

    def reserved_at(self, i: int) -> int:
        r = self.reserved
        if not self.n:
            return sum(_i(s.get("total_size", 0)) for s in self.segments)
        return r[max(0, min(i, self.n - 1))]

    @property
    def peak_reserved(self) -> tuple[int, int]:
        """(bytes, event index) of the most reserved at once in the window."""
        r = self.reserved
        if not self.n:
            return (self.reserved_at(-1), -1)
        m = max(r)
        return (m, r.index(m))

    def decimate_series(self, series, lo: int, hi: int, cols: int,
                        with_min: bool = True) -> list[tuple[int | None, int]]:
        """(min, max) of any per-event series over events [lo, hi) in `cols` columns
        (`with_min` False: (None, max), in half the time: the chart draws the maxima only)."""
        hi = min(hi, self.n)
        if hi <= lo or cols <= 0:
            return []
        # the last few asked for are kept: moving the cursor draws the same columns again (on
        # the plain first frame, its keys answered while Textual imports)
        memo = self.__dict__.setdefault("_decimated", {})
        key = (id(series), lo, hi, cols, with_min)
        hit = memo.get(key)
        if hit is not None and hit[0] is series:
            return hit[1]
        if len(memo) >= 8:
            memo.clear()
        out = []
        memo[key] = (series, out)
        span = hi - lo
        for c in range(cols):
            s = lo + span * c // cols
            e = max(s + 1, lo + span * (c + 1) // cols)
            chunk = series[s:e]
            out.append((min(chunk) if with_min else None, max(chunk)))
        return out

    # -- queries ---------------------------------------------------------------------------
    def allocated_at(self, i: int) -> int:
        return self.base if i < 0 or not self.n else self.allocated[min(i, self.n - 1)]

    def live_elements(self, i: int) -> list[int]:
        """Element ids live just after event i (i = -1: at the window's start), largest first."""
        i = -1 if not self.n else max(-1, min(i, self.n - 1))
        st, en = self.el_start, self.el_end
        out = [j for j in range(len(st)) if st[j] <= i < en[j]]
        sz = self.el_size
        out.sort(key=lambda j: -sz[j])
        return out

    def frames(self, fid: int) -> tuple:
        """The stack of an interned frame list, innermost first, as (file, line, name) tuples."""
        r = self._resolved.get(fid)
        if r is None:
            raw = self.frames_table[fid] if 0 < fid < len(self.frames_table) else None
            r = tuple(frame_tuple(f) for f in raw) if raw else ()
            self._resolved[fid] = r
        return r

    def shown_frames(self, fid: int) -> tuple:
        """The stack as memory_viz shows it: without the unwinder, interpreter, dispatcher and
        allocator frames of a stacks='all' trace (innermost first)."""
        r = self._shown.get(fid)
        if r is None:
            r = self._shown[fid] = tuple(f for f in self.frames(fid) if is_shown_frame(f))
        return r

    def brief_frames(self, fid: int) -> tuple:
        """shown_frames without the glue between an op and the allocator (at::detail::empty,
        the dispatcher's kernel wrappers): for a one-line or few-line view of a stack."""
        return tuple(f for f in self.shown_frames(fid)
                     if f[0].endswith(".py") or not any(g in f[2] for g in GLUE_FUNCTIONS))

    def user_frame(self, fid: int):
        """The frame a stack is known by: the first user Python frame, else the first Python
        frame; None for a stack with no Python frame (see where())."""
        fr = self.frames(fid)
        for f in fr:
            if is_user_frame(f[0]):
                return f
        for f in fr:
            if f[0].endswith(".py"):
                return f
        return None

    def where(self, fid: int) -> tuple[str, tuple | None]:
        """(the group key, the frame) of a stack: a Python frame as "file.py:12 fn", else the
        C++ caller as "<autograd MmBackward0>" / "<aten::mm>" (stacks='all')."""
        r = self._where.get(fid)
        if r is None:
            f = self.user_frame(fid)
            if f is not None:
                r = (fmt_frame(f), f)
            else:
                c = cpp_caller(self.frames(fid))
                r = (f"<{c}>", None) if c else ("<no user frame>", None)
            self._where[fid] = r
        return r

    @property
    def namer(self):
        """The StacklessNamer of this trace (naming.py), None without a snapshot around it."""
        if self._namer is None and self.namer_factory is not None:
            self._namer = self.namer_factory()
        return self._namer

    def stackless_name(self, j: int) -> str | None:
        """The name of element j when its stack has no Python frame, from what gpumon knows
        (the .grad it is, its autograd node, the phase it was made in: naming.py); None when
        it has a Python frame or nothing is known."""
        fid = self.el_fid[j]
        if fid and self.where(fid)[1] is not None:
            return None
        nm = self.namer
        cpp = self.frames(fid) if fid else ()
        if nm is not None:
            return nm.name(j, cpp)
        return cpp_caller(cpp) if cpp else None

    def element_where(self, j: int, by: str = "line") -> tuple[str, tuple | None]:
        if by == "module":
            return (self.module_key(j), None)
        if by == "category":
            c = self.el_category(j)
            return (c or NO_CATEGORY, None)
        fid = self.el_fid[j]
        if fid == 0 or self.where(fid)[1] is None:
            n = self.stackless_name(j)
            if n is not None:
                return (f"<{n}>", None)
            if fid == 0:
                return (NO_STACK if self.el_start[j] < 0 else NO_PY_STACK, None)
        if by == "line":
            return self.where(fid)
        return self.key_by(fid, by)

    # -- modules (the sidecar's module enter/leave: gpumon/snapshot/modules.py) -------------
    module_annotations = None  # the sidecar's ``modules`` (set by Snapshot.trace), or None

    @property
    def module_index(self):
        """The module context of every event (gpumon/snapshot/modules.py), built at the first
        use: None without module annotations."""
        d = self.__dict__
        if "_module_index" not in d:
            ann = self.module_annotations
            idx = None
            if ann is not None:
                from .modules import ModuleIndex
                idx = ModuleIndex.from_sidecar(ann, self.action, self.time_us, A_ALLOC,
                                               A_FREE_REQ)
            d["_module_index"] = idx
        return d["_module_index"]

    def module_key(self, j: int) -> str:
        """The module whose forward (or backward) allocated element j."""
        from .modules import NO_ANNOTATIONS
        if self.el_start[j] < 0:
            return NO_STACK
        idx = self.module_index
        return idx.key_at(self.el_start[j]) if idx is not None else NO_ANNOTATIONS

    def python_first(self, fid: int) -> tuple[tuple, tuple, tuple]:
        """The stack in reading order (frames.python_first): the user's frame and the library
        frames it called, its Python callers, then the C++ frames without the unwinder,
        allocator and dispatch glue."""
        r = self._shown.get(("pf", fid))
        if r is None:
            head, callers, _cpp = python_first(self.frames(fid))
            cpp = tuple(f for f in self.brief_frames(fid) if not f[0].endswith(".py"))
            r = self._shown[("pf", fid)] = (head, callers, cpp)
        return r

    def reading_order(self, fid: int) -> tuple:
        """python_first as one list of frames: Python first, then C++ (innermost first)."""
        head, callers, cpp = self.python_first(fid)
        return head + callers + cpp

    def key_by(self, fid: int, by: str) -> tuple[str, tuple | None]:
        """The group key of a stack at a coarser level than its line (see GROUP_BY):
        "function" (file and function, steady when lines move), "file" (the Python module of
        the user frame), "library" (the package of the innermost Python frame: torch,
        transformers, ... or "your code")."""
        k = (fid, by)
        r = self._where.get(k)
        if r is None:
            key, f = self.where(fid)
            if f is not None:
                if by == "function":
                    key = f"{os.path.basename(f[0]) or f[0]} {f[2]}"
                elif by == "file":
                    key, f = short_path(f[0]), (f[0], 0, "")
                elif by == "library":
                    py = next((x for x in self.frames(fid) if x[0].endswith(".py")), None)
                    key, f = (library_of(py[0]) if py else "<C++>"), None
            elif by == "library":
                key = "<C++>" if self.frames(fid) else key
            r = self._where[k] = (key, f)
        return r

    def groups_at(self, i: int, query: str = "", by: str = "line") -> list[Group]:
        """Live allocations at event i grouped by first user frame (or by function, file or
        library: see key_by), largest group first. `query` keeps only allocations whose stack
        has a frame whose file or function contains it (case-insensitive)."""
        groups: dict[str, Group] = {}
        q = query.lower().strip()
        sz = self.el_size
        for j in self.live_elements(i):
            if q and not self.stack_matches(self.el_fid[j], q):
                continue
            key, fr = self.element_where(j, by)
            g = groups.get(key)
            if g is None:
                g = groups[key] = Group(key, fr)
            g.bytes += sz[j]
            g.count += 1
            g.elements.append(j)
        return sorted(groups.values(), key=lambda g: (-g.bytes, g.key))

    def stack_matches(self, fid: int, q: str) -> bool:
        for fn, _line, name in self.frames(fid):
            if q in fn.lower() or q in name.lower():
                return True
        return False

    def event_time_s(self, i: int) -> float | None:
        """Seconds since the window's first event, when the trace carries times."""
        if not self.n or not self.time_us[0] and not self.time_us[-1]:
            return None
        i = max(0, min(i, self.n - 1))
        t0 = self.window.get("t0") if self.window else None
        return (self.time_us[i] - (self.time_us[0] if t0 is None else t0)) / 1e6

    def event_at_time_us(self, t: int) -> int:
        return max(0, bisect.bisect_right(self.time_us, t) - 1)

    def decimate(self, lo: int, hi: int, cols: int,
                 with_min: bool = True) -> list[tuple[int | None, int]]:
        """(min, max) of allocated over events [lo, hi) in `cols` columns."""
        return self.decimate_series(self.allocated, lo, hi, cols, with_min)

    def counts(self) -> dict[str, int]:
        raw = self.action.tobytes()   # bytes.count: C speed (a Python loop took 7 ms at 40k)
        c = [raw.count(bytes([k])) for k in range(len(ACTIONS))]
        return {ACTIONS[k]: v for k, v in enumerate(c) if v}

    # -- segments --------------------------------------------------------------------------
    def segment_infos(self) -> list[SegmentInfo]:
        if self._seg_infos is None:
            out = []
            for s in self.segments:
                alloc = req = pend = free = largest = nb = 0
                for b, _ba, bs in segment_blocks(s):
                    nb += 1
                    st = b.get("state")
                    if st == "active_allocated":
                        alloc += bs
                        req += _i(b.get("requested_size", bs))
                    elif st == "active_pending_free":
                        pend += bs
                    else:
                        free += bs
                        largest = max(largest, bs)
                total = _i(s.get("total_size", alloc + pend + free))
                st_type = s.get("segment_type")
                out.append(SegmentInfo(
                    _i(s.get("address", 0)), total, alloc, req, pend, free, largest, nb,
                    _i(s.get("stream", 0)), st_type if isinstance(st_type, str) else "?",
                    bool(s.get("is_expandable", False))))
            out.sort(key=lambda x: -x.total)
            self._seg_infos = out
        return self._seg_infos

    def _segment_events(self) -> list[int]:
        """Indices of the segment_alloc/free/map/unmap events, found once (C-speed find)."""
        if self._seg_events is None:
            raw = self.action.tobytes()
            out = []
            for code in (A_SEG_ALLOC, A_SEG_MAP, A_SEG_FREE, A_SEG_UNMAP):
                b = bytes([code])
                k = raw.find(b)
                while k >= 0:
                    out.append(k)
                    k = raw.find(b, k + 1)
            out.sort()
            self._seg_events = out
        return self._seg_events

    def _segments_after(self, i: int, blocks: bool = True
                        ) -> tuple[dict[int, list], dict[int, int]]:
        """segments_at's first half: address -> [total, pool, stream, expandable] of the
        segments just after event i (the dump's, each segment event after i undone), and
        (with `blocks`) the dump's block size by address of its active_allocated blocks."""
        segs: dict[int, list] = {}
        end_size: dict[int, int] = {}
        for s in self.segments:
            a = _i(s.get("address", 0))
            st = s.get("segment_type")
            segs[a] = [_i(s.get("total_size", 0)), st if isinstance(st, str) else "?",
                       _i(s.get("stream", 0)), bool(s.get("is_expandable", False))]
            for b, ba, bs in segment_blocks(s) if blocks else ():
                if b.get("state") == "active_allocated":
                    end_size[ba] = bs
        act, addr, size = self.action, self.addr, self.size
        seg_ev = self._segment_events()
        after = [(act[k], addr[k], size[k]) for k in seg_ev[bisect.bisect_right(seg_ev, i):]]
        if self.window:
            after += self.window["tail_seg"]
        for a, ad, sz in reversed(after):
            if a == A_SEG_ALLOC or a == A_SEG_MAP:
                cur = segs.get(ad)
                if cur is not None and cur[0] > sz:
                    cur[0] -= sz          # a mapping that grew an expandable segment
                else:
                    segs.pop(ad, None)
            else:
                cur = segs.get(ad)
                if cur is not None:
                    cur[0] += sz
                else:
                    segs[ad] = [sz, "small" if sz <= (2 << 20) else "large", 0,
                                a == A_SEG_UNMAP]
        return segs, end_size

    def segments_at(self, i: int) -> list[SegmentInfo]:
        """The allocator's segments just after event i, rebuilt as memory_viz does: back from
        the segments at the dump, undoing each segment_alloc/map and segment_free/unmap after
        i; the blocks are the allocations live at i. A block's size is the dump's where the
        block is still there, else the request rounded up to 512 bytes as the allocator does
        (a large block that kept an unsplit remainder under 1 MiB is counted that much
        smaller, and its segment's free space that much larger). Largest first."""
        if not self.n or i >= self.n - 1 and (not self.window or
                                              self.window["hi"] >= self.window["n"]):
            return self.segment_infos()
        segs, end_size = self._segments_after(max(-1, i))
        starts = sorted(segs)
        live: dict[int, list[tuple[int, int, int]]] = {a: [] for a in starts}
        el_addr, el_size, el_end = self.el_addr, self.el_size, self.el_end
        for j in self.live_elements(i):
            ba = el_addr[j]
            k = bisect.bisect_right(starts, ba) - 1
            if k < 0:
                continue
            sa = starts[k]
            if ba >= sa + segs[sa][0]:
                continue
            bs = end_size.get(ba) if el_end[j] >= self.n and (
                not self.window or ba in self.window["dump_live"]) else None
            if bs is None:
                bs = max(512, (el_size[j] + 511) // 512 * 512)
            live[sa].append((ba, bs, el_size[j]))
        out = []
        for sa in starts:
            total, pool, stream, exp = segs[sa]
            blocks = sorted(live[sa])
            alloc = sum(b[1] for b in blocks)
            req = sum(b[2] for b in blocks)
            largest, pos, nfree = 0, sa, 0
            for ba, bs, _r in blocks:
                if ba > pos:
                    largest = max(largest, ba - pos)
                    nfree += 1
                pos = max(pos, ba + bs)
            if sa + total > pos:
                largest = max(largest, sa + total - pos)
                nfree += 1
            out.append(SegmentInfo(sa, total, alloc, req, 0, max(0, total - alloc), largest,
                                   len(blocks) + nfree, stream, pool, exp))
        out.sort(key=lambda x: -x.total)
        return out

    def segment_totals(self, infos: list[SegmentInfo] | None = None) -> dict:
        """The segments at the dump. A wholly empty segment is cache that
        torch.cuda.empty_cache() hands back, not fragmentation: `fragmentation` is the share
        of the segments that hold live blocks which is free holes between them (memory that
        stays reserved and that only a request fitting a hole can use)."""
        if infos is None:
            infos = self.segment_infos()
        reserved = sum(s.total for s in infos)
        allocated = sum(s.allocated for s in infos)
        requested = sum(s.requested for s in infos)
        free = sum(s.free for s in infos)
        largest = max((s.largest_free for s in infos), default=0)
        empty = [s for s in infos if not s.allocated and not s.pending_free]
        empty_bytes = sum(s.total for s in empty)
        used_total = reserved - empty_bytes
        holes = sum(s.free for s in infos if s.allocated or s.pending_free)
        return {
            "segments": len(infos), "reserved": reserved, "allocated": allocated,
            "requested": requested, "pending_free": sum(s.pending_free for s in infos),
            "free": free, "largest_free_block": largest,
            "rounding_waste": allocated - requested,
            "empty_segments": len(empty), "empty_segments_bytes": empty_bytes,
            "free_in_used_segments": holes,
            "largest_free_in_used_segments": max(
                (s.largest_free for s in infos if s.allocated or s.pending_free), default=0),
            "fragmentation": holes / used_total if used_total else 0.0,
        }


def _namer_factory(snap, tr):
    def make():
        from .naming import StacklessNamer
        return StacklessNamer(snap, tr)
    return make


class Snapshot:
    """A loaded snapshot and its analysis, computed lazily per device."""

    def __init__(self, data: dict, path: str = "", sidecar: dict | None = None):
        self.data = data
        self.path = path
        self.sidecar = sidecar or {}
        traces = data["device_traces"]
        seg_devs = [_i(s.get("device", 0)) for s in data["segments"]]
        lens = [len(t) for t in traces]
        if lens and max(lens) > 0:
            self.default_device = lens.index(max(lens))
        elif seg_devs:
            self.default_device = max(set(seg_devs), key=seg_devs.count)
        else:
            self.default_device = 0
        self.devices = sorted({i for i, n in enumerate(lens) if n} | set(seg_devs)) or [0]
        self._traces: dict[int, DeviceTrace] = {}

    def trace(self, device: int | None = None) -> DeviceTrace:
        d = self.default_device if device is None else device
        t = self._traces.get(d)
        if t is None:
            try:
                from . import cache
                whole = self.path and not self.data.get("_gpumon_window")
                kept = cache.replay_get(self.path, d) if whole else None
                with gc_paused():
                    t = DeviceTrace(self.data, d, kept)
                if whole and kept is None:
                    cache.replay_put(self.path, d, t.allocated, t.base, t.peak, t.peak_index,
                                     t.reserved)
                t.namer_factory = _namer_factory(self, t)
            except SnapshotError as e:  # name the file, as the loader's errors do
                if self.path and not str(e).startswith(self.path):
                    raise SnapshotError(f"{self.path}: {e}") from None
                raise
            self._traces[d] = t
            ann = self.sidecar.get("modules")
            if isinstance(ann, dict) and ann.get("device", d) in (d, None):
                t.module_annotations = ann  # indexed at the first use (module_index)
        return t

    def annotations(self, device: int | None = None) -> list[dict]:
        """external_annotations for the device: name, stage, time_us and the event index."""
        d = self.default_device if device is None else device
        tr = self.trace(d)
        out = []
        raw = self.data.get("external_annotations")
        if not isinstance(raw, list):
            return out
        for a in raw:
            if not isinstance(a, dict) or _i(a.get("device", d)) != d:
                continue
            t = _i(a.get("time_us", 0))
            out.append({"name": str(a.get("name", "?")), "stage": str(a.get("stage", "")),
                        "time_us": t, "event": tr.event_at_time_us(t) if tr.n else -1})
        return out

    def step_boundaries(self, device: int | None = None) -> list[tuple[int, str]]:
        """(event index, name) where an optimizer step ended: torch's `Optimizer.step` END
        annotations, else the steps of gpumon's phases tracker in the sidecar's `timeline`
        (a recording started mid-run holds no annotations)."""
        out = []
        for a in self.annotations(device):
            if a["name"].startswith("Optimizer.step") and a["stage"].upper() == "END":
                out.append((a["event"], a["name"].split("#", 1)[-1]))
        if out:
            return out
        tl = self.sidecar.get("timeline")
        steps = tl.get("steps") if isinstance(tl, dict) else None
        if not isinstance(steps, list):
            return out
        tr = self.trace(device)
        if not tr.n:
            return out
        first, last = tr.time_us[0], tr.time_us[tr.n - 1]
        for st in steps:
            if not isinstance(st, dict):
                continue
            end = st.get("end_us")
            if type(end) is not int or not first <= end <= last:
                continue
            k = st.get("step")
            out.append((tr.event_at_time_us(end), f"step {k}" if type(k) is int else "step"))
        out.sort()
        return out

    def optimizer_steps(self, device: int | None = None) -> list[tuple[int, int]]:
        """(first event, last event) of each `Optimizer.step` torch annotated, START to END,
        in order; a step whose START came before the recording starts at -1, one whose END
        has not come yet ends at the last event."""
        out: list[tuple[int, int]] = []
        start = None
        tr = self.trace(device)
        for a in sorted(self.annotations(device), key=lambda a: a["time_us"]):
            if not a["name"].startswith("Optimizer.step"):
                continue
            st = a["stage"].upper()
            if st == "START":
                start = a["event"]
            elif st == "END":
                out.append((-1 if start is None else start, a["event"]))
                start = None
        if start is not None:
            out.append((start, tr.n - 1))
        return out

    def phase_spans(self, device: int | None = None) -> list[tuple[int, int, int, str]]:
        """(first event, last event, step, phase) of each phase of gpumon's phases tracker
        (the sidecar's `timeline`) that overlaps the trace, in order; [] without one."""
        d = self.default_device if device is None else device
        cache = self.__dict__.setdefault("_phase_spans", {})
        if d in cache:
            return cache[d]
        out: list[tuple[int, int, int, str]] = []
        tl = self.sidecar.get("timeline")
        steps = tl.get("steps") if isinstance(tl, dict) else None
        tr = self.trace(d)
        if isinstance(steps, list) and tr.n:
            t = tr.time_us
            first, last = t[0], t[tr.n - 1]
            for st in steps:
                if not isinstance(st, dict) or type(st.get("step")) is not int:
                    continue
                phases = st.get("phases")
                for ph in phases if isinstance(phases, list) else ():
                    if not isinstance(ph, dict) or type(ph.get("start_us")) is not int:
                        continue
                    s0, s1 = ph["start_us"], ph.get("end_us")
                    s1 = s1 if type(s1) is int else last + 1
                    if s1 <= first or s0 > last or s1 < s0:
                        continue
                    e0 = bisect.bisect_left(t, s0)
                    e1 = bisect.bisect_left(t, s1) - 1
                    if e1 >= e0:
                        out.append((e0, e1, st["step"], str(ph.get("phase", "?"))[:20]))
        out.sort()
        cache[d] = out
        return out

    def step_at(self, i: int, device: int | None = None) -> dict | None:
        """Where event i fell in the training loop: {"step", "phase", "of", "source",
        "text"}. From gpumon's phases tracker (the sidecar's timeline: the step's number and
        its phase) when it covers the event, else from torch's Optimizer.step annotations
        (START and END: inside optimizer step k of N, or after k of N); None when neither
        says anything."""
        for e0, e1, step, phase in self.phase_spans(device):
            if e0 <= i <= e1:
                return {"step": step, "phase": phase, "of": None, "source": "gpumon",
                        "text": f"in step {step}, {phase}"}
            if e0 > i:
                break
        opt = self.optimizer_steps(device)
        if not opt:
            return None
        done = sum(1 for _s, e in opt if e < i)
        inside = next((k for k, (s0, e) in enumerate(opt) if s0 <= i <= e), None)
        if inside is not None:
            return {"step": inside + 1, "phase": "optimizer", "of": len(opt), "source": "torch",
                    "text": f"in optimizer step {inside + 1} of {len(opt)}"}
        return {"step": done, "phase": None, "of": len(opt), "source": "torch",
                "text": f"after {done} of {len(opt)} optimizer steps"}

    def allocator_settings(self) -> dict:
        s = self.data.get("allocator_settings")
        return s if isinstance(s, dict) else {}
