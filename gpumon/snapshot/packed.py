"""One device's trace events packed into columns, instead of a dict per event.

pickle.load makes each trace event a dict of 6-8 keys: ~390 bytes per event, 7x the file. A
PackedTrace keeps what the analysis and the screens use in typed arrays (~30 bytes per event):
the action as a code, addr (device_free for an OOM), size, time_us and the event's frame list
(interned: torch shares one list object per distinct stack, so the table holds each once).
`stream`, `compile_context` and `user_metadata` are kept only where an event sets them to
something other than the default (0, "N/A", ""), and an action name outside ACTIONS is kept
as it was. Events that are not dicts are counted in `skipped` and dropped.

`add()` takes events in order, in batches (the streaming loader hands it each part of the
list as it is unpickled, so only one part's dicts exist at a time); `event(i)` rebuilds
event i as a dict, for the rare reader that wants one.
"""
from __future__ import annotations

from array import array
from itertools import compress, repeat
from operator import getitem as _getitem, is_ as _is, itemgetter

ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "snapshot", "oom", "other")
A_ALLOC, A_FREE_REQ, A_FREE_DONE, A_SEG_ALLOC, A_SEG_FREE, A_SEG_MAP, A_SEG_UNMAP, \
    A_SNAPSHOT, A_OOM, A_OTHER = range(len(ACTIONS))
_CODE = {name: i for i, name in enumerate(ACTIONS)}
_CODE["free"] = A_FREE_DONE  # the name MemoryViz gives a merged request+completion; old dumps
_BIG = 2**63 - 1
_first, _last = itemgetter(0), itemgetter(-1)


class _Unseen:
    """Equal to anything: the last of each key's frame lists (PackedTrace._by_key), so
    list.index finds a stack seen before at C speed and stops here at a new one."""

    def __eq__(self, other):
        return True

    __hash__ = None


_UNSEEN = _Unseen()
_NONE_OF_KEY = ([_UNSEEN], [None])


def _clamp(v) -> int:
    """An int for a column, from a field that should be one (defensive: odd dumps)."""
    if type(v) is not int:
        try:
            v = int(v)
        except (TypeError, ValueError, OverflowError):
            return 0
    return max(min(v, _BIG), 0)


def _col(events: list, key: str, default) -> list:
    """[e.get(key, default) for e in events], without a Python frame per event."""
    return list(map(dict.get, events, repeat(key), repeat(default)))


class PackedTrace:
    """The events of one device trace, in columns. len() is the number of events kept."""

    def __init__(self, events=None):
        self.action = array("b")
        self.addr = array("q")
        self.size = array("q")
        self.time_us = array("q")
        self.fid = array("i")
        self.frames_table: list = [None]   # fid 0: no stack; others: the trace's frame lists
        self._fid_by_id: dict[int, int] = {}      # id(list kept in frames_table) -> fid
        self._fid_by_key: dict[tuple, list] = {}  # ids of first/last frame, length -> fids
        # the same key -> (the table's lists of that key + [_UNSEEN], their fids + [None])
        self._by_key: dict[tuple, tuple[list, list]] = {}
        self.skipped = 0
        # sparse: event index -> value, only where it is not the default
        self.stream: dict[int, object] = {}
        self.compile_context: dict[int, object] = {}
        self.user_metadata: dict[int, object] = {}
        self.odd_action: dict[int, object] = {}   # the action as written, when not in ACTIONS
        # what the profiler's snapshot (torch.cuda._memory_viz.profile_plot) says an
        # allocation is: parameter, activation, gradient, ... (interned strings)
        self.category: dict[int, str] = {}
        if events is not None:
            self.add(events)

    def __len__(self) -> int:
        return len(self.action)

    def intern(self, frames) -> int:
        """The fid of a frame list. torch writes a new list per event whose frame dicts are
        shared (its symbolizer dedups frames, the pickle memoizes them), so a list is looked
        up by the identity of its first and last frames and its length, and compared with
        the lists found there (list == list checks identity first: C speed for shared
        frames): one fid per distinct stack, not per event. The table keeps each first list
        (and so its dicts) alive, so the ids in a key stay unique."""
        if not frames:
            return 0
        k = id(frames)
        fid = self._fid_by_id.get(k)
        if fid is None:
            key = (id(frames[0]), id(frames[-1]), len(frames))
            cands = self._fid_by_key.get(key)
            if cands is not None:
                table = self.frames_table
                for c in cands:
                    try:
                        if table[c] == frames:
                            return c
                    except RecursionError:
                        pass
            fid = len(self.frames_table)
            self.frames_table.append(frames)
            self._fid_by_id[k] = fid
            if cands is None:
                self._fid_by_key[key] = [fid]
            else:
                cands.append(fid)
            self._note_key(key, frames, fid)
        return fid

    def _note_key(self, key: tuple, frames: list, fid: int) -> None:
        """A new stack of the table, for _intern_fresh's lookup."""
        same = self._by_key.get(key)
        if same is None:
            self._by_key[key] = ([frames, _UNSEEN], [fid, None])
        else:
            same[0].insert(-1, frames)
            same[1].insert(-1, fid)

    def _intern_fresh(self, frames: list, got: list) -> list:
        """The fids of a batch where some frame lists are new objects (torch's pickler writes
        a fresh list per event): intern()'s lookup, key and comparison done for the whole
        batch at C speed, Python only for the lists no earlier one equals (new stacks)."""
        intern = self.intern
        types = set(map(type, frames))
        if not types:
            return []
        if types != {list} and types - {list, type(None)}:
            return [g if g is not None else (intern(fr) if type(fr) is list and fr else 0)
                    for g, fr in zip(got, frames)]
        if types != {list} or frames.count([]):
            # events without a stack (a free with Python stacks only: no "frames" key, or an
            # empty list): fid 0; the lookup below at C speed for the others, in order (fids
            # as one by one), put back in their places at C speed
            keep = list(map(bool, frames))
            out = [0] * len(frames)
            list(map(out.__setitem__, compress(range(len(frames)), keep),
                     self._intern_fresh(list(compress(frames, keep)),
                                        list(compress(got, keep)))))
            return out
        # each list against the table's lists of its key, in the order they came (intern()'s
        # loop), at C speed: list.index compares the lists (list == list: the frames by
        # identity first) and stops at _UNSEEN, fid None, for a stack not in the table.
        # Distinct stacks often share a key: of a real stacks='all' file's 35,849 events,
        # 17,784 were not the first stack of their key, and went to intern() one by one
        keys = zip(map(id, map(_first, frames)), map(id, map(_last, frames)), map(len, frames))
        by_key = list(map(self._by_key.get, keys, repeat(_NONE_OF_KEY)))
        try:
            pos = list(map(list.index, map(_first, by_key), frames))
        except RecursionError:  # a hostile self-nesting frame: intern() copes one by one
            return [g if g is not None else intern(fr) for g, fr in zip(got, frames)]
        out = list(map(_getitem, map(_last, by_key), pos))
        if None not in out:
            return out
        # Python only for the stacks the table did not have (new stacks), in order
        for i in compress(range(len(out)), map(_is, out, repeat(None))):
            g = got[i]
            out[i] = g if g is not None else intern(frames[i])
        return out

    def add(self, events) -> None:
        """Append events (in order). Column by column when the batch is plain (C-speed
        comprehensions); event by event, with every oddity handled, when it is not."""
        if not self._add_fast(events):
            self._add_slow(events)

    def _add_fast(self, events) -> bool:
        """The common batch: dicts with known actions, int fields, no OOM. False (and nothing
        added) when the batch is anything else."""
        if type(events) is not list or not events:
            return not events
        try:
            if set(map(type, events)) != {dict}:
                return False
            names = _col(events, "action", None)
            addrs = _col(events, "addr", 0)
            sizes = _col(events, "size", 0)
            tus = _col(events, "time_us", 0)
            frames = _col(events, "frames", None)
            streams = _col(events, "stream", 0)
            codes = list(map(_CODE.get, names))
            if None in codes or A_OOM in codes or "free" in names:
                return False
            addr = array("q", addrs)
            size = array("q", sizes)
            tus = array("q", tus)
        except (TypeError, OverflowError):
            return False  # an unhashable action, a field that is not an int in range
        base = len(self.action)
        fid_of = self._fid_by_id.get
        got = list(map(fid_of, map(id, frames)))   # C speed where the lists are shared
        if None in got:
            got = self._intern_fresh(frames, got)
        fids = array("i", got)
        self.action.extend(array("b", codes))
        self.addr.extend(addr)
        self.size.extend(size)
        self.time_us.extend(tus)
        self.fid.extend(fids)
        # the sparse columns: one C-speed count each, a Python loop only for a batch that
        # has a value other than the default (0, "N/A"/absent, ""/absent)
        vals = streams
        if vals.count(0) != len(vals):
            for i, v in enumerate(vals):
                if v != 0:
                    self.stream[base + i] = v
        for k, col, default in (("compile_context", self.compile_context, "N/A"),
                                ("user_metadata", self.user_metadata, ""),
                                ("category", self.category, "")):
            vals = _col(events, k, None)
            if vals.count(None) + vals.count(default) != len(vals):
                for i, v in enumerate(vals):
                    if v is not None and v != default:
                        col[base + i] = v
        return True

    def _add_slow(self, events) -> None:
        code = _CODE
        act, addr, size, tus, fidc = self.action, self.addr, self.size, self.time_us, self.fid
        intern, fid_of = self.intern, self._fid_by_id.get
        stream, cc, um, odd = self.stream, self.compile_context, self.user_metadata, \
            self.odd_action
        for e in events:
            if type(e) is not dict:
                self.skipped += 1
                continue
            g = e.get
            a = g("action")
            c = code.get(a, A_OTHER) if type(a) is str else A_OTHER
            i = len(act)
            if c == A_OTHER and a != "other" or a == "free":
                odd[i] = a
            ad = g("device_free", 0) if c == A_OOM else g("addr", 0)
            sz = g("size", 0)
            t = g("time_us", 0)
            try:
                addr.append(ad)
                size.append(sz)
                tus.append(t)
            except (TypeError, OverflowError):
                del addr[i:], size[i:], tus[i:]
                addr.append(_clamp(ad))
                size.append(_clamp(sz))
                tus.append(_clamp(t))
            act.append(c)
            fr = g("frames")
            if type(fr) is list and fr:
                f = fid_of(id(fr))
                fidc.append(f if f is not None else intern(fr))
            else:
                fidc.append(0)
            s = g("stream", 0)
            if s != 0:
                stream[i] = s
            v = g("compile_context")
            if v is not None and v != "N/A":
                cc[i] = v
            v = g("user_metadata")
            if v is not None and v != "":
                um[i] = v
            v = g("category")
            if type(v) is str and v:
                self.category[i] = v

    def event(self, i: int) -> dict:
        """Event i as a dict in torch's format (the fields kept)."""
        c = self.action[i]
        d = {"action": self.odd_action.get(i, ACTIONS[c])}
        d["device_free" if c == A_OOM else "addr"] = self.addr[i]
        d["size"] = self.size[i]
        d["stream"] = self.stream.get(i, 0)
        d["time_us"] = self.time_us[i]
        for k, col in (("compile_context", self.compile_context),
                       ("user_metadata", self.user_metadata), ("category", self.category)):
            if i in col:
                d[k] = col[i]
        fr = self.frames_table[self.fid[i]]
        d["frames"] = fr if fr is not None else []
        return d

    def __getitem__(self, i: int) -> dict:
        n = len(self.action)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("event index out of range")
        return self.event(i)

    def __iter__(self):
        return (self.event(i) for i in range(len(self.action)))
