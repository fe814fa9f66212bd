"""A model of torch's CUDA caching allocator, driven by its trace-only allocation history, that
gives each allocation the size torch's counters add (``allocated_bytes``): the block size.

The history records the *requested* size of every allocation and free. torch's counters add
the *block*: the request rounded up to 512 bytes (or to a power-of-two division when
``roundup_power2_divisions`` is set) and, in the large pool (> 1 MiB), the whole free block it
was cut from when the remainder would have been 1 MiB or less (that remainder is not split
off). The block size therefore depends on the free block found at that address, which this
model keeps: free blocks of the large pool per address, split on allocation as torch splits
them (``should_split``), merged with free neighbours of the same segment on
``free_completed``, created by ``segment_alloc`` and removed by ``segment_free``. Small-pool
blocks are always the rounded request (their remainders are always split off), and so are
blocks of expandable segments.

The model starts from the allocator's state (``segments`` of a snapshot) and is advanced entry
by entry. It never guesses: an entry it cannot place (an allocation where it holds no free
block, a free of a block it does not know) raises :class:`Inconsistent`, and the caller reports
the step as not exact. Entries that repeat what the starting state already shows (a
``free_completed`` or segment event recorded just before the snapshot was taken) are ignored.

Pure Python, standard library only (it runs inside the training process).
"""
from __future__ import annotations

from typing import Iterable

KMIN = 512
KSMALL = 1 << 20          # largest small-pool allocation
KSMALL_BUFFER = 2 << 20   # small-pool segments
MAX_SIZE_T = (1 << 64) - 1
ALLOC, FREE_REQ, FREE_DONE, SEG_ALLOC, SEG_FREE = range(5)  # what AllocatorModel.apply takes


class Inconsistent(Exception):
    """The trace does not fit the model: the step cannot be measured exactly."""


def _power2_index(size: int) -> int:
    # torch's intervals start at 1 MiB and end at 64 GiB: index 0..16
    log_size = size.bit_length() - 1
    return min(max(0, log_size - 20), 16)


class AllocatorModel:
    """Block sizes of one device's caching allocator (see the module docstring).

    ``segments``: the ``segments`` list of ``torch.cuda.memory._snapshot()`` (any device; only
    ``device`` is kept); ``settings``: its ``allocator_settings`` (or None: torch's defaults).
    ``allocated``: the sum of the allocated blocks, what ``memory_allocated()`` reports.
    """

    def __init__(self, segments: Iterable[dict], settings: dict | None, device: int = 0) -> None:
        settings = settings or {}
        mss = settings.get("max_split_size", -1)
        self.max_split = MAX_SIZE_T if mss is None or int(mss) < 0 else int(mss)
        self.expandable = bool(settings.get("expandable_segments", False))
        div = settings.get("roundup_power2_divisions") or {}
        self.divisions = [0] * 17
        if isinstance(div, dict):
            for k, v in div.items():  # keys "1", "2", ... "32768" (MiB): interval index
                try:
                    i = int(k).bit_length() - 1
                    if 0 <= i < 17:
                        self.divisions[i] = int(v)
                except (TypeError, ValueError):
                    continue
        self.live: dict[int, int] = {}      # allocated blocks: addr -> block size
        self.pending: dict[int, int] = {}   # large blocks freed, awaiting free_completed
        self.free: dict[int, int] = {}      # free large-pool blocks: addr -> size
        self.free_end: dict[int, int] = {}  # end addr -> addr of those
        self.seg_starts: set[int] = set()   # large segments (no merge across their starts)
        self.allocated = 0
        for seg in segments:
            if seg.get("device", device) != device:
                continue
            large = seg.get("segment_type") == "large"
            if seg.get("is_expandable"):
                self.expandable = True
            addr = int(seg["address"])
            if large:
                self.seg_starts.add(addr)
            for b in seg.get("blocks", ()):
                a, size, state = int(b.get("address", addr)), int(b["size"]), b.get("state")
                addr = a + size
                if state == "active_allocated":
                    self.live[a] = size
                    self.allocated += size
                elif not large:
                    continue
                elif state == "inactive":
                    self.free[a] = size
                    self.free_end[a + size] = a
                else:  # active_pending_free: freed, still in use by another stream
                    self.pending[a] = size

    def round_size(self, size: int) -> int:
        if size < KMIN:
            return KMIN
        d = self.divisions[_power2_index(size)]
        if d > 1 and size > KMIN * d:
            if size & (size - 1) == 0:
                return size
            floor = 1 << (size.bit_length() - 1)
            step = floor >> (d.bit_length() - 1)
            if step == 0:
                return floor << 1
            r = size & ~(step - 1)
            return size if r == size else r + step
        return (size + KMIN - 1) // KMIN * KMIN

    def apply(self, action: int, addr: int, size: int) -> int:
        """Advance by one trace entry; returns the change of ``allocated`` (block bytes)."""
        if action == ALLOC:
            rs = self.round_size(size)
            if rs <= KSMALL or self.expandable:
                block = rs  # remainders of 512 bytes and more are always split off
            else:
                f = self.free.pop(addr, None)
                if f is None:
                    raise Inconsistent(f"allocation at {addr:#x}: no free block there")
                del self.free_end[addr + f]
                if f < rs:
                    raise Inconsistent(f"allocation at {addr:#x}: free block too small")
                if rs < self.max_split and f - rs > KSMALL:
                    block = rs
                    self.free[addr + rs] = f - rs
                    self.free_end[addr + f] = addr + rs
                else:
                    block = f  # the remainder stays in the block: torch counts all of it
            if addr in self.live:
                raise Inconsistent(f"allocation at {addr:#x}: a block is live there")
            self.live[addr] = block
            self.allocated += block
            return block
        if action == FREE_REQ:
            block = self.live.pop(addr, None)
            if block is None:
                raise Inconsistent(f"free of {addr:#x}: no live block there")
            self.allocated -= block
            if block > KSMALL and not self.expandable:
                self.pending[addr] = block
            return -block
        if action == FREE_DONE:
            block = self.pending.pop(addr, None)
            if block is None:
                return 0  # a small block, or already shown free by the starting state
            start, end = addr, addr + block
            nxt = self.free.get(end)
            if nxt is not None and end not in self.seg_starts:
                del self.free[end]
                del self.free_end[end + nxt]
                end += nxt
            prev = self.free_end.get(addr)
            if prev is not None and addr not in self.seg_starts:
                del self.free_end[addr]
                del self.free[prev]
                start = prev
            self.free[start] = end - start
            self.free_end[end] = start
            return 0
        if action == SEG_ALLOC:
            if size == KSMALL_BUFFER or addr in self.seg_starts or self.expandable:
                return 0  # a small-pool segment, or one the starting state already has
            self.seg_starts.add(addr)
            self.free[addr] = size
            self.free_end[addr + size] = addr
            return 0
        if action == SEG_FREE:
            if addr in self.seg_starts and self.free.get(addr) == size:
                self.seg_starts.discard(addr)
                del self.free[addr]
                del self.free_end[addr + size]
            return 0
        return 0


def window_start(entries: list, n_alloc: int, n_free: int) -> int | None:
    """Index of the first entry after which the trace (entry dicts) holds exactly ``n_alloc``
    allocations and ``n_free`` free requests (the newest ones): where a window of known
    counter deltas begins. Non-counted entries just before it are included (the model ignores
    repeats). None if the trace holds fewer (entries were lost: a ring that wrapped, a clear)."""
    ca = cf = 0
    i = len(entries)
    counted_actions = ("alloc", "free_requested")
    while i > 0 and (ca, cf) != (n_alloc, n_free):
        a = entries[i - 1].get("action")
        if a == "alloc":
            ca += 1
        elif a == "free_requested":
            cf += 1
        i -= 1
        if ca > n_alloc or cf > n_free:
            return None
    if (ca, cf) != (n_alloc, n_free):
        return None
    while i > 0 and entries[i - 1].get("action") not in counted_actions:
        i -= 1
    return i

class Replay:
    """What one pass over a step's entries gives (see :func:`replay`)."""
    __slots__ = ("values", "peaks", "alloc_bytes", "freed_bytes", "end", "last_alloc")

    def __init__(self) -> None:
        self.values: list[int] = []        # allocated at each mark
        # per span between marks: (max, position: how many entries were applied when it was
        # first reached)
        self.peaks: list[tuple[int, int]] = []
        self.alloc_bytes = 0               # block bytes allocated from the first mark to the last
        self.freed_bytes = 0               # ... and freed
        self.end = 0                       # index of the first entry after the last mark
        self.last_alloc: dict[int, int] = {}  # watched address -> index of its last allocation


def replay(model: AllocatorModel, entries: list, base: tuple[int, int], marks: list,
           watch: set | frozenset = frozenset()) -> Replay:
    """Advance ``model`` through ``entries`` (trace entry dicts, the first one right after the
    model's state) up to the last of ``marks``, and measure.

    ``base``: torch's (allocation.allocated, allocation.freed) counters at the model's state;
    ``marks``: ascending (allocation.allocated, allocation.freed) counter values read at the
    step's start, at its phase boundaries and at its end. A span runs from one mark to the next;
    its peak counts the value at its start, as ``max_memory_allocated`` does after a reset.
    Raises :class:`Inconsistent` when the entries end before the last mark or do not fit.
    """
    r = Replay()
    if not marks:
        return r
    apply = model.apply
    live, pending = model.live, model.pending
    # the hot path inline (most entries are small blocks): the rounded request, no free map
    plain_small = not any(model.divisions)
    keep_pending = not model.expandable
    ca, cf = base
    mi = 0
    n = len(marks)
    cur = model.allocated
    span_max, span_idx = -1, -1
    in_step = False
    abytes = fbytes = 0
    last_alloc = r.last_alloc
    values, peaks = r.values, r.peaks

    def reach(i: int) -> None:
        nonlocal mi, span_max, span_idx, in_step
        while mi < n and marks[mi][0] == ca and marks[mi][1] == cf:
            if in_step:
                peaks.append((span_max, span_idx))
            values.append(cur)
            span_max, span_idx = cur, i
            in_step = True
            mi += 1

    reach(0)
    r.end = len(entries)
    for i, e in enumerate(entries):
        if mi >= n:
            r.end = i
            break
        act = e["action"]
        if act == "alloc":
            addr, size = e["addr"], e["size"]
            if plain_small and size <= KSMALL:
                d = KMIN if size < KMIN else (size + KMIN - 1) // KMIN * KMIN
                if addr in live:
                    raise Inconsistent(f"allocation at {addr:#x}: a block is live there")
                live[addr] = d
                model.allocated += d
            else:
                d = apply(ALLOC, addr, size)
            ca += 1
            cur += d
            if in_step:
                abytes += d
                if cur > span_max:
                    span_max, span_idx = cur, i + 1  # after this entry
                if watch and addr in watch:
                    last_alloc[addr] = i
            reach(i + 1)
        elif act == "free_requested":
            addr = e["addr"]
            d = live.pop(addr, None)
            if d is None:
                raise Inconsistent(f"free of {addr:#x}: no live block there")
            model.allocated -= d
            if d > KSMALL and keep_pending:
                pending[addr] = d
            cf += 1
            cur -= d
            if in_step:
                fbytes += d
            reach(i + 1)
        elif act == "free_completed":
            if e["addr"] in pending:
                apply(FREE_DONE, e["addr"], 0)
        elif act == "segment_alloc":
            apply(SEG_ALLOC, e["addr"], e["size"])
        elif act == "segment_free":
            apply(SEG_FREE, e["addr"], e["size"])
    if mi < n:
        raise Inconsistent(f"the trace ends before the step does ({mi} of {n} marks)")
    r.alloc_bytes, r.freed_bytes = abytes, fbytes
    return r
