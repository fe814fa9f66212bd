"""Which module made each allocation of a snapshot: the module enter/leave events gpumon's
agent writes into the sidecar while it records (``modules``, format in
gpumon/agent/modules.py), placed between the trace's entries, and the module stack at any
event. Pure data: no torch, no Textual.

Placing an event: each carries the trace's clock (``time_us``) and torch's cumulative
allocation counters read at the hook. The counters say exactly how many allocations and frees
came before it; the trace does not say which counter value its first entry had, so that
offset is taken as the one most events agree on when each is placed by its time, give or
take two entries (a module event between two allocations that happened microseconds apart is
then placed by the counters, not the clock). Without counters (or without agreement) events are placed by time alone.

    idx = ModuleIndex.from_sidecar(sidecar["modules"], actions, times)   # or None
    idx.context_at(i)   # ("forward"|"backward"|None, (outermost path, ..., innermost))
    idx.key_at(i)       # the group key: "model.layers.7.mlp", "... [backward]", "<no module>"
"""
from __future__ import annotations

import bisect
from collections import Counter
from typing import Any, Sequence

FWD_ENTER, FWD_LEAVE, BWD_ENTER, BWD_LEAVE, BWD_END = range(5)
NO_MODULE = "<no module>"
NO_ANNOTATIONS = "<no module annotations>"
BACKWARD_SUFFIX = " [backward]"
ROOT = "(root)"
# action codes of gpumon.snapshot.packed (kept here as numbers: this module needs no import)
MIN_AGREEMENT = 0.2   # share of events that must agree on the counters' offset
NEAR = 2              # entries either side of an event's place by time that it votes for


def _label(path: str) -> str:
    return path or ROOT


class ModuleIndex:
    def __init__(self, positions: list, contexts: list, paths: list, how: str) -> None:
        self.positions = positions  # ascending: a context starts before the entry at this index
        self.contexts = contexts    # (kind, stack) from that position on
        self.paths = paths
        self.how = how              # "counters" | "time"

    @classmethod
    def from_sidecar(cls, ann: Any, actions: Sequence[int], times: Sequence[int],
                     alloc_code: int, free_code: int) -> "ModuleIndex | None":
        """``actions``/``times``: the trace's action codes and time_us per entry;
        ``alloc_code``/``free_code``: the codes of ``alloc`` and ``free_requested``."""
        if not isinstance(ann, dict) or not isinstance(ann.get("events"), str):
            return None
        paths = ann.get("paths")
        if not isinstance(paths, list):
            return None
        paths = [str(p) for p in paths]
        evs = decode_events(ann.get("events"))
        n = len(actions)
        if not evs or not n:
            return None
        # counted entries before each position 0..n
        ka = [0] * (n + 1)
        kf = [0] * (n + 1)
        ca = cf = 0
        for i in range(n):
            a = actions[i]
            if a == alloc_code:
                ca += 1
            elif a == free_code:
                cf += 1
            ka[i + 1], kf[i + 1] = ca, cf
        by_time = [bisect.bisect_right(times, t) for t, _c, _k, _p in evs]
        # each event votes for the offsets its time allows, give or take NEAR entries (the
        # two clocks agree to a few microseconds, in which several entries may fall): the true
        # offset gets nearly every event's vote, a wrong one only a few
        offsets: Counter = Counter()
        for (t, c, _k, _p), p in zip(evs, by_time):
            if c is None:
                continue
            offsets.update({(c[0] - ka[q], c[1] - kf[q])
                            for q in range(max(0, p - NEAR), min(n, p + NEAR) + 1)})
        how = "time"
        pos = by_time
        if offsets:
            (oa, of), votes = offsets.most_common(1)[0]
            if votes >= MIN_AGREEMENT * len(evs):
                pos = []
                for (t, c, _k, _p), pt in zip(evs, by_time):
                    p = _position(ka, kf, c[0] - oa, c[1] - of) if c is not None else None
                    pos.append(pt if p is None else p)
                how = "counters"
        order = sorted(range(len(evs)), key=lambda k: (pos[k], k))
        positions: list = [0]
        contexts: list = [(None, ())]
        fstack: list = []
        bstack: list = []
        in_bwd = False
        for k in order:
            _t, _c, code, pi = evs[k]
            path = paths[pi] if 0 <= pi < len(paths) else None
            if code == FWD_ENTER and path is not None:
                (bstack if in_bwd else fstack).append(path)
            elif code == FWD_LEAVE and path is not None:
                _pop(bstack if in_bwd and path in bstack else fstack, path)
            elif code == BWD_ENTER and path is not None:
                in_bwd = True
                fstack.clear()
                if path not in bstack:
                    bstack.append(path)
            elif code == BWD_LEAVE and path is not None:
                _pop(bstack, path)
            elif code == BWD_END:
                bstack.clear()
                in_bwd = False
            if bstack or in_bwd:
                ctx = ("backward", tuple(bstack))
            else:
                ctx = ("forward" if fstack else None, tuple(fstack))
            if positions[-1] == pos[k]:
                contexts[-1] = ctx
            else:
                positions.append(pos[k])
                contexts.append(ctx)
        return cls(positions, contexts, paths, how)

    def context_at(self, i: int) -> tuple:
        """The module context an entry at index i was made in."""
        k = bisect.bisect_right(self.positions, i) - 1
        return self.contexts[k] if k >= 0 else (None, ())

    def key_at(self, i: int) -> str:
        kind, stack = self.context_at(i)
        if not stack:
            return NO_MODULE + (BACKWARD_SUFFIX if kind == "backward" else "")
        return _label(stack[-1]) + (BACKWARD_SUFFIX if kind == "backward" else "")

    def stack_lines(self, i: int) -> list:
        """The module stack at entry i, outermost first, for a stack pane."""
        kind, stack = self.context_at(i)
        if not stack:
            return [NO_MODULE + (BACKWARD_SUFFIX if kind == "backward" else "")]
        return [("  " * d) + _label(p) for d, p in enumerate(stack)] + (
            [f"({kind})"] if kind else [])


MAX_EVENTS = 1_000_000


def decode_events(text: str) -> list:
    """The sidecar's ``events`` string (gpumon/agent/modules.py: "t,a,f,code,path;...", time
    and counters as differences from the event before) -> [(time_us, (n_alloc, n_free) or
    None, code, path index)]. A malformed event ends the list there (what came before it is
    kept); at most MAX_EVENTS."""
    out: list = []
    t = a = f = 0
    for row in text.split(";", MAX_EVENTS)[:MAX_EVENTS] if text else ():
        parts = row.split(",")
        if len(parts) != 5:
            break
        try:
            t += int(parts[0])
            c = None
            if parts[1] and parts[2]:
                a += int(parts[1])
                f += int(parts[2])
                c = (a, f)
            code, pi = int(parts[3]), int(parts[4])
        except ValueError:
            break
        out.append((t, c, code, pi))
    return out


def _pop(stack: list, path: str) -> None:
    for j in range(len(stack) - 1, -1, -1):
        if stack[j] == path:
            del stack[j:]
            return


def _position(ka: list, kf: list, a: int, f: int) -> int | None:
    """The first position whose counted allocations and frees are (a, f), or None."""
    lo = bisect.bisect_left(ka, a)
    hi = bisect.bisect_right(ka, a)
    if lo >= hi:
        return None
    j = bisect.bisect_left(kf, f, lo, hi)
    if j < hi and kf[j] == f:
        return j
    return None
