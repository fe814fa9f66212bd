"""A time window of a trace too long to hold: the events [lo, hi) of a device, and what the rest
of the trace says about them, so that the window's figures are the whole trace's.

The loader reads such a file twice (load.py, `window=`):
  1. the first `cap` events are packed as usual; once a device has more, a `Tally` follows the
     whole trace without keeping it (a dict of the allocations live at the moment) and finds
     the peak of allocated memory, with MemoryViz's rules (analysis.DeviceTrace._replay);
  2. a second read keeps only the window around the peak (or around the event asked for) and
     a `Seeder` collects what the window cannot see by itself: the allocations live when it
     starts (made before it, or before the recording, freed after it, or blocks of the
     segments at the dump that the trace never touched), and the segment events after it
     (for the reserved bytes and the segments at the cursor, rebuilt back from the dump).
Memory then depends on the window's length and the number of live allocations, not on the
length of the trace (but for the C Unpickler's memo table, 8-16 bytes per memoized object of
the file, which no reader of a pickle avoids).
"""
from __future__ import annotations

import os
from itertools import repeat

from .packed import (A_ALLOC, A_FREE_DONE, A_FREE_REQ, A_SEG_ALLOC, A_SEG_FREE, A_SEG_MAP,
                     A_SEG_UNMAP, _CODE, PackedTrace)

DEFAULT_WINDOW = 1_000_000  # events kept per device when a trace is longer
_AFTER = "after"  # an allocation made after the window (by the Seeder's live dict)
_SEG = {A_SEG_ALLOC: 1, A_SEG_MAP: 1, A_SEG_FREE: -1, A_SEG_UNMAP: -1}


def _cols(items: list):
    get = dict.get
    codes = list(map(_CODE.get, map(get, items, repeat("action"))))
    return codes, list(map(get, items, repeat("addr"), repeat(0))), \
        list(map(get, items, repeat("size"), repeat(0)))


class Tally:
    """Follows a trace event by event, keeping only the live allocations, and finds the first
    event where allocated memory peaks (relative to the window's start; the base is constant)."""

    def __init__(self):
        self.live: dict[int, int] = {}
        self.cum = 0
        self.prev_v = 0
        self.prev_c = -1
        self.prev_ad = -1
        self.best = None
        self.best_i = -1
        self.i = 0
        # bit k set: event k is a free_requested whose free_completed is event k + 1 (a pair a
        # window must not cut: MemoryViz counts it as one free). n / 8 bytes.
        self.pairs = bytearray()

    def feed(self, codes, addrs, sizes) -> None:
        live, cum, prev_v, prev_c, prev_ad = self.live, self.cum, self.prev_v, self.prev_c, \
            self.prev_ad
        best, best_i, i = self.best, self.best_i, self.i
        pairs = self.pairs
        pop = live.pop
        for c, ad, sz in zip(codes, addrs, sizes):
            d = 0
            if c == A_ALLOC:
                live[ad] = sz
                d = sz
            elif c == A_FREE_DONE:
                s = pop(ad, None)
                if s is None:
                    s = sz
                if prev_c == A_FREE_REQ and prev_ad == ad:  # merged: the free is at i - 1
                    prev_v -= s
                    cum -= s
                    k = (i - 1) >> 3
                    if k >= len(pairs):
                        pairs.extend(bytes(k + 4096 - len(pairs)))
                    pairs[k] |= 1 << ((i - 1) & 7)
                else:
                    d = -s
            if i and (best is None or prev_v > best):
                best, best_i = prev_v, i - 1
            cum += d
            prev_v, prev_c, prev_ad = cum, c, ad
            i += 1
        self.cum, self.prev_v, self.prev_c, self.prev_ad = cum, prev_v, prev_c, prev_ad
        self.best, self.best_i, self.i = best, best_i, i

    def pair_at(self, k: int) -> bool:
        """Whether event k is a free_requested merged with event k + 1."""
        return 0 <= k and (k >> 3) < len(self.pairs) and bool(self.pairs[k >> 3] & (1 << (k & 7)))

    def peak_index(self) -> int:
        if self.i and (self.best is None or self.prev_v > self.best):
            return self.i - 1
        return self.best_i


class Seeder:
    """The second read's view of the events outside the window [lo, hi)."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.live: dict[int, object] = {}   # addr -> (size, frames) before lo; None after
        self.seed_a: list | None = None
        self.seed_b: list = []
        self.tail_seg: list[tuple[int, int, int]] = []
        self.dump_blocks: set = set()   # blocks of the dump live all through the trace

    def feed(self, items: list, start: int) -> None:
        codes, addrs, sizes = _cols(items)
        live = self.live
        lo, hi = self.lo, self.hi
        g = start
        for k, (c, ad, sz) in enumerate(zip(codes, addrs, sizes)):
            if g == lo and self.seed_a is None:
                self.seed_a = [(a, v[0], v[1], False) for a, v in live.items()]
            if c == A_ALLOC:
                live[ad] = (sz, items[k].get("frames")) if g < lo else (None if g < hi
                                                                        else _AFTER)
            elif c == A_FREE_DONE:
                if live.pop(ad, 0) == 0 and g >= hi:
                    # allocated before the recording and freed after the window: live in it
                    self.seed_b.append((ad, sz, items[k].get("frames"), True))
            elif g >= hi and c in _SEG:
                self.tail_seg.append((c, ad, sz))
            g += 1

    def live_at_dump(self) -> set:
        """Addresses whose allocation live at the window's end is still live at the dump (the
        dump's block sizes then hold for it)."""
        return {a for a, v in self.live.items() if v is not _AFTER} | self.dump_blocks

    def seed(self, segments: list, device: int) -> list:
        from .analysis import live_blocks
        out = list(self.seed_a if self.seed_a is not None else
                   [(a, v[0], v[1], False) for a, v in self.live.items()
                    if type(v) is tuple])
        out += self.seed_b
        for baddr, req, fr, _bsize in live_blocks(segments, device):
            if baddr not in self.live:
                self.dump_blocks.add(baddr)
                out.append((baddr, req, fr, False))
        return out


class WindowTrace:
    """Stands in for a PackedTrace while the loader reads a device's events: keeps [lo, hi) in
    `packed`, counts all of them in `n`, and feeds the Tally (first read) or the Seeder
    (second read)."""

    def __init__(self, lo: int, hi: int, tally: bool = False, seeder: bool = False):
        self.packed = PackedTrace()
        self.lo, self.hi = lo, hi
        self.n = 0
        self.tally = Tally() if tally else None
        self.seeder = Seeder(lo, hi) if seeder else None
        self._tallied = 0
        self.t0 = None   # time_us of the trace's first event

    @property
    def skipped(self) -> int:
        return self.packed.skipped

    def add(self, items: list) -> None:
        if set(map(type, items)) != {dict}:
            self.packed.skipped += sum(1 for e in items if type(e) is not dict)
            items = [e for e in items if type(e) is dict]
        if not items:
            return
        start = self.n
        self.n = start + len(items)
        if not start:
            self.t0 = items[0].get("time_us")
        a = min(max(self.lo - start, 0), len(items))
        b = min(max(self.hi - start, 0), len(items))
        if self.seeder is not None:
            # a free_requested last in the window: its free_completed comes in too (MemoryViz
            # counts the pair as one free at the first)
            while a < b < len(items) and items[b - 1].get("action") == "free_requested":
                b += 1
                self.hi += 1
            if a == b == 0 and start == self.hi and len(self.packed) and \
                    self.packed.action[-1] == A_FREE_REQ:
                b = 1
                self.hi += 1
            self.seeder.hi = self.hi
        if b > a:
            self.packed.add(items[a:b])
        if self.tally is not None and self.n > self.hi:
            if not self._tallied:  # the first overflow: what was kept so far, from its start
                p = self.packed
                self.tally.feed(p.action, p.addr, p.size)
                self._tallied = len(p)
            self.tally.feed(*_cols(items[b:]))
        if self.seeder is not None:
            self.seeder.feed(items, start)


_PAIRS: dict = {}   # (file identity, trace length) -> the first pass's Tally (its pairs only)


def _ident(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.abspath(path), st.st_size, st.st_mtime_ns)


def remember_pairs(path: str, n: int, tally: Tally) -> None:
    """Keep the first pass's free pairs of a trace for the windows read later (< > in the
    view skip the first pass): n / 8 bytes. One file's, the last read."""
    ident = _ident(path)
    if ident is not None:
        kept = Tally()
        kept.pairs = tally.pairs
        _PAIRS.clear()
        _PAIRS[(ident, n)] = kept


def remembered_pairs(path: str, n: int) -> Tally | None:
    ident = _ident(path)
    return _PAIRS.get((ident, n)) if ident is not None else None


def window_bounds(n: int, length: int, at: int, tally: Tally | None = None) -> tuple[int, int]:
    """[lo, hi) of `length` events of `n`, centred on event `at`. With the first pass's
    `tally`, a window that would end between a free_requested and its free_completed moves
    one event later, so that it keeps `length` events (the second read otherwise takes the
    completion in too: --window N kept N + 1)."""
    length = max(1, min(length, n))
    lo = max(0, min(n - length, at - length // 2))
    if tally is not None and tally.pair_at(lo + length - 1):
        lo = lo + 1 if lo + length < n else lo - 1
    return lo, lo + length
