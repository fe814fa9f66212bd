"""Every step's exact peak from torch's own peak counters, with the program's view of them kept.

At every phase boundary the tracker asks ``PeakCounters.boundary(dev)``: one read of the CUDA
caching allocator's counters (``torch._C._cuda_memoryStats``, the nested dict, ~15 us), one
``torch._C._cuda_resetPeakMemoryStats`` and a second read. The first read's
``allocated_bytes.all.peak`` is then exactly what ``max_memory_allocated()`` would have said
had it been reset where the phase began: the phase's own peak, in block bytes, for every step.

The program must not see any of it. Every Python-level reader of torch's peaks goes through
``torch._C._cuda_memoryStats`` (``torch.cuda.memory_stats``, ``max_memory_allocated``,
``max_memory_reserved``, ``memory_summary``, ``torch.cuda.memory.*``) or, on torch >= 2.9,
``torch._C._accelerator_getDeviceStats`` (``torch.accelerator.*``); every reset through
``torch._C._cuda_resetPeakMemoryStats`` (``reset_peak_memory_stats``,
``reset_max_memory_allocated``, ``reset_max_memory_cached``) or
``torch._C._accelerator_resetPeakStats``. While installed, those entry points are answered
with the peaks the program would have seen:

* for each device, ``virtual[key]`` holds, for every counter with a ``peak`` (allocation,
  segment, active, inactive_split, allocated/reserved/active/inactive_split/requested bytes,
  each all/large_pool/small_pool, oversize_*), the highest value since the program's last
  reset up to gpumon's last reset (the reads taken at gpumon's resets are kept and folded in
  when the program reads or resets, every FOLD_AT of them, and when gpumon stops);
* a read answers ``max(virtual[key], real peak)`` for each key: exactly the maximum of the
  counter since the program's last reset, since the real peak covers the time after gpumon's
  last reset;
* a reset by the program resets the real counters and drops ``virtual``: from then on the
  program reads the real counters again. Before resetting, the real allocated peak is kept for
  gpumon (the phase in progress keeps its exact peak: the program's reset costs nothing);
* reads, resets and gpumon's boundaries are serialised by one lock, so a read never sees the
  real counters of after a reset with the virtual peaks of before it.

What cannot be exact is said, never guessed: allocations on another thread between the read
and the reset at a boundary (the counters' allocation counts moved) may hide a transient there
(the phase is then ``not exact``, and the program's view keeps the lower figure: the bound on
what was missed is logged and counted in ``status()``); a reset that bypasses the patched entry
points (C++ code, a reference to the original taken before gpumon started) is noticed when the
peak falls below the phase's starting figure, and that phase is marked.

When the agent stops, the real counters stay reset: the wrappers are removed at once for each
device gpumon never reset, and otherwise stay (answering exactly, with no reference to the
agent) until the program resets that device's peaks itself, after which they are gone.
Standard library only.
"""
from __future__ import annotations

import operator
import os
import threading
import weakref
from typing import Any, Callable

from gpumon.agent.phases.memory import ALLOCATED

STATS = "_cuda_memoryStats"
RESET = "_cuda_resetPeakMemoryStats"
ACC_STATS = "_accelerator_getDeviceStats"
ACC_RESET = "_accelerator_resetPeakStats"

# Reads kept unfolded per device at most (each ~1 KB: its ~30 peaks as a tuple of ints).
FOLD_AT = 256

# The reasons a phase (and so a step) is not exact, as the step events say them.
RACE = "allocations on another thread at a phase boundary (a transient there may be missed)"
FIRST = "the phase began before gpumon followed the peak counters"
UNSEEN_RESET = ("the program reset the peak counters outside torch.cuda's functions (the phase's "
                "figure starts at that reset)")


def _log(msg: str) -> None:
    try:
        from gpumon.agent.log import get_logger  # the agent's own log, never stdout/stderr
        get_logger().info("phases: %s", msg)
    except Exception:
        pass


def peak_paths(stats: dict) -> list[tuple]:
    """The keys of every counter with a ``peak`` in a nested stats dict: ('allocation', 'all'),
    ('oversize_segments',), ..."""
    out = []
    for k, v in stats.items():
        if not isinstance(v, dict):
            continue
        if "peak" in v:
            out.append((k,))
            continue
        for k2, v2 in v.items():
            if isinstance(v2, dict) and "peak" in v2:
                out.append((k, k2))
    return out


def peak_getter(paths: list) -> Callable[[dict], tuple]:
    """One function giving a read's peaks in ``paths``' order (``[(path, k, k2), ...]``), with
    the subscripts as constants: ~3x faster than a loop over the paths. torch's keys are plain
    strings, written as their repr; anything else gets the loop."""
    if all(isinstance(k, str) for p, _, _ in paths for k in p):
        src = "lambda s: (" + "".join(
            "s" + "".join(f"[{k!r}]" for k in p) + "['peak'], " for p, _, _ in paths) + ")"
        return eval(src, {"__builtins__": {}})  # noqa: S307 (reprs of torch's key strings)
    return lambda s: tuple(s[k]["peak"] if k2 is None else s[k][k2]["peak"]
                           for _, k, k2 in paths)


def _node(stats: dict, path: tuple) -> dict:
    d = stats[path[0]]
    return d if len(path) == 1 else d[path[1]]


def _paths_of(stats: dict) -> list:
    return [(p, p[0], p[1] if len(p) > 1 else None) for p in peak_paths(stats)]


def _raw_peaks(stats: dict, paths: list | None) -> tuple:
    """(paths, peaks) of a whole read kept unsettled (a program read inside a forward whose
    start was taken early): by ``paths`` if the read has them, else by its own."""
    if paths is not None:
        try:
            return paths, tuple(_node(stats, p)["peak"] for p, _, _ in paths)
        except (KeyError, TypeError):
            pass
    own = _paths_of(stats)
    return own, tuple(_node(stats, p)["peak"] for p, _, _ in own)


def _dev_key(device: Any) -> Any:
    try:
        return operator.index(device)
    except TypeError:
        return device


class _State:
    """What the wrappers need, apart from the tracker: they may outlive it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.virtual: dict[Any, dict] = {}   # dev -> {path: the program's peak before gpumon's
        #                                       last reset}; absent: the real counters are right
        self.pending: dict[Any, int] = {}    # dev -> gpumon's allocated peak of the phase in
        #                                       progress from before a program's reset
        self.program_resets: dict[Any, int] = {}  # dev -> resets by the program this phase
        self.view_short: dict[Any, int] = {}  # dev -> bound on what a raced boundary may hide
        self.unfolded: dict[Any, list] = {}   # dev -> [(paths, the peaks in paths' order read
        #                                       at a gpumon reset)] not yet folded (fold())
        #                                       or [None, the whole read] (take())
        self.paths: list | None = None        # the PeakCounters' paths (its first read's)
        self.closing = False                  # the agent stopped: remove when virtual empties
        self.installed: list = []             # [(module, name, original, wrapper)]

    def fold(self, dev: Any) -> dict | None:
        """The program's virtual peaks for ``dev``, with the reads of gpumon's resets since the
        last fold folded in (caller holds the lock). Folding at each boundary cost ~25-80 us on
        an H100 host inside a training loop (30 keys of a freshly built dict, cold caches):
        each read's peaks are taken at its boundary, and wait here as a tuple until the program
        reads or resets, or FOLD_AT of them are kept."""
        pend = self.unfolded.pop(dev, None)
        v = self.virtual.get(dev)
        if not pend:
            return v
        nv = dict(v) if v else {}  # a new dict: a reader may hold the old one
        groups: dict = {}  # the reads' peaks by their paths list (one PeakCounters: one list)
        for paths, peaks in pend:
            if paths is None:  # a read taken at a boundary not yet settled: its peaks now
                paths, peaks = _raw_peaks(peaks, self.paths)
            g = groups.get(id(paths))
            if g is None:
                g = groups[id(paths)] = (paths, [])
            g[1].append(peaks)
        get = nv.get
        for paths, rows in groups.values():
            for (p, _, _), x in zip(paths, map(max, zip(*rows))):  # each counter's highest
                y = get(p)
                if y is None or x > y:
                    nv[p] = x
        self.virtual[dev] = nv
        return nv

    def holds(self) -> bool:
        """Whether any device's view differs from the real counters (peaks kept for it)."""
        return bool(self.virtual) or any(self.unfolded.values())


_STATES: "weakref.WeakSet[_State]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for st in list(_STATES):
        st.lock = threading.Lock()  # a lock held by a thread that does not exist in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class PeakCounters:
    """The tracker's memory reader (``read`` like memory.CudaMemory) with ``boundary`` (read,
    reset, read) for exact per-phase peaks. ``C``: ``torch._C`` (or a fake with the same
    entry points). ``install()`` patches the entry points; ``uninstall()`` removes them (at
    once, or when each reset device's virtual peaks are dropped by the program's own reset)."""

    def __init__(self, C: Any, torch_mod: Any = None, accelerator: bool = False) -> None:
        self.C = C
        self.torch = torch_mod
        self._stats: Callable = getattr(C, STATS)
        self._reset: Callable = getattr(C, RESET)
        self._seq = (self._stats, self._reset, self._stats)  # a boundary's calls, in order
        self.accelerator = accelerator
        self.off: str | None = None   # why the counters are not used (decided by prepare())
        self.s = _State()
        _STATES.add(self.s)
        self._paths: list | None = None
        self._getter: Callable = tuple
        self._start: dict[Any, int] = {}   # dev -> allocated at the phase's start (after reset)
        self.races = 0
        self.unseen_resets = 0
        self.boundaries = 0

    # ------------------------------------------------------------------ install / remove
    def prepare(self) -> bool:
        """Decide and install, once the program uses a CUDA device (not before: the allocator's
        backend is read from PYTORCH_CUDA_ALLOC_CONF, which a program may set after importing
        torch). Returns whether the counters are in use."""
        if self.s.installed:
            return True
        if self.off:
            return False
        if self.torch is not None:
            self.off = available(self.torch, self.C)
            if self.off:
                return False
            self.accelerator = accelerator_is_cuda(self.torch)
        self.install()
        return True

    def install(self) -> None:
        s = self.s
        if s.installed:
            s.closing = False  # installed again before the program reset: ours again
            return
        self.accelerator = bool(self.accelerator and hasattr(self.C, ACC_STATS)
                                and hasattr(self.C, ACC_RESET))
        pairs = [(STATS, self._wrap_stats(self._stats)), (RESET, self._wrap_reset(self._stats,
                                                                                  self._reset))]
        if self.accelerator:
            acc_stats = getattr(self.C, ACC_STATS)
            pairs += [(ACC_STATS, self._wrap_stats(acc_stats)),
                      (ACC_RESET, self._wrap_reset(acc_stats, getattr(self.C, ACC_RESET)))]
        for name, wrapper in pairs:
            orig = getattr(self.C, name)
            for a in ("__name__", "__qualname__", "__doc__"):
                try:
                    setattr(wrapper, a, getattr(orig, a))
                except (AttributeError, TypeError):
                    pass
            s.installed.append((self.C, name, orig, wrapper))
            setattr(self.C, name, wrapper)

    def uninstall(self) -> None:
        """The agent stops. The program's view stays exact: devices whose counters gpumon reset
        keep their wrappers until the program resets them."""
        s = self.s
        with s.lock:
            s.closing = True
            for dev in list(s.unfolded):  # the reads kept unfolded go: only the peaks stay
                s.fold(dev)
            if not s.holds():
                _restore(s)

    @property
    def installed(self) -> bool:
        return bool(self.s.installed)

    def _wrap_stats(self, orig: Callable) -> Callable:
        s = self.s

        def stats(device):  # named after the original by install()
            with s.lock:
                out = orig(device)
                v = s.fold(_dev_key(device)) if s.virtual or s.unfolded else None
            if v and out:
                for path, peak in v.items():
                    try:
                        node = _node(out, path)
                        if peak > node["peak"]:
                            node["peak"] = peak
                    except (KeyError, TypeError):
                        pass
            return out
        return stats

    def _wrap_reset(self, orig_stats: Callable, orig: Callable) -> Callable:
        s = self.s

        def reset(device):
            with s.lock:
                dev = _dev_key(device)
                try:  # gpumon keeps the phase's peak so far: the program's reset costs it nothing
                    a = orig_stats(device)["allocated_bytes"]["all"]["peak"]
                    if a > s.pending.get(dev, -1):
                        s.pending[dev] = a
                    s.program_resets[dev] = s.program_resets.get(dev, 0) + 1
                except Exception:
                    pass
                r = orig(device)
                s.virtual.pop(dev, None)
                s.unfolded.pop(dev, None)
                s.view_short.pop(dev, None)
                if s.closing and not s.holds():
                    _restore(s)
            return r
        return reset

    # ------------------------------------------------------------------ the tracker's side
    def read(self, dev: Any) -> tuple | None:
        """Allocated, (real) peak, reserved, retries and the cumulative counters: as
        memory.CudaMemory.read, without resetting anything."""
        if not isinstance(dev, int):
            return None
        st = self._stats(dev)
        return _tuple(st, None) if st else None

    def boundary(self, dev: Any) -> tuple | None:
        """At a phase boundary: ``(reads, phase_peak, why_not_exact)``: the figures now (a
        memory.read tuple whose PEAK is the ended phase's own peak), and the reason, or None,
        why that peak may not be exact. The counters are reset: the next phase starts here.
        ``take`` then ``settle``: the tracker may run the second later (see take)."""
        taken = self.take(dev)
        return None if taken is None else self.settle(dev, taken)

    def take(self, dev: Any) -> tuple | None:
        """The part of a boundary that must run at the boundary: read, reset and read again,
        and what the program did to the counters in the ended phase. Everything else is
        ``settle``'s, which may run later (after a forward's launches: at its start, after a
        sync, the GPU waits for every microsecond spent here) and must run before the next
        take of this device. None: no allocator on this device yet.

        Read, reset and read again run as one call chain in C (``map``): no Python bytecode
        runs between them, so no other Python thread can take the GIL and allocate in the
        window; the second read proves no other (C++) thread did."""
        if not isinstance(dev, int):
            return None
        s = self.s
        with s.lock:
            s1, _, s2 = map(operator.methodcaller("__call__", dev), self._seq)
            if not s1:  # no allocator on this device yet: no peaks to keep
                return None
            # the program's view of the peaks before this reset: the whole read waits in the
            # list (a program read before settle() folds it whole); settle() keeps its peaks
            entry = [None, s1]
            pend = s.unfolded.get(dev)
            if pend is None:
                pend = s.unfolded[dev] = []
            pend.append(entry)
            kept = s.pending.pop(dev, None) if s.pending else None
            resets = s.program_resets.pop(dev, 0) if s.program_resets else 0
        return s1, s2, kept, resets, entry

    def settle(self, dev: Any, taken: tuple) -> tuple:
        """The rest of ``take``'s boundary: ``(reads, phase_peak, why_not_exact)``."""
        s1, s2, kept, resets, entry = taken
        s = self.s
        with s.lock:
            if entry[0] is None:
                # its peaks only (a kept dict is ~150 objects: folding 64 of them cold cost
                # ~1 ms inside a CPU training loop), folded later (State.fold)
                entry[0], entry[1] = self._paths_and_peaks(s1)
            pend = s.unfolded.get(dev)
            if pend is not None and len(pend) >= FOLD_AT:
                s.fold(dev)
        self.boundaries += 1
        a1 = s1["allocated_bytes"]["all"]
        a2 = s2["allocated_bytes"]["all"]
        peak = a1["peak"]
        if kept is not None and kept > peak:
            peak = kept
        why = None
        start = self._start.get(dev)
        if start is None:
            why = FIRST  # the peak is the program's since its start (or its last reset)
        elif a1["peak"] < start and not resets:
            why = UNSEEN_RESET
            self.unseen_resets += 1
        # only an allocation in the window can hide a transient (a free lowers what the next
        # phase starts from, which the second read gives)
        if a1["allocated"] != a2["allocated"] and why is None:
            # the window's transient is in neither phase: bounded by allocated then +
            # everything allocated in the window
            bound = a1["current"] + (a2["allocated"] - a1["allocated"])
            if bound > peak:
                why = RACE
                self.races += 1
                with s.lock:
                    vv = s.fold(dev)
                    if vv is not None:
                        s.view_short[dev] = max(s.view_short.get(dev, 0),
                                                bound - vv.get(("allocated_bytes", "all"), 0))
                _log(f"device {dev}: allocations during a phase boundary (up to {bound} B "
                     "in the window)")
        self._start[dev] = a2["current"]
        return _tuple(s1, peak), _tuple(s2, None), why

    def _paths_and_peaks(self, st: dict) -> tuple:
        try:
            peaks = self._peaks(st)  # decides self._paths at the first read
        except Exception:  # another scheme than the first read's: this read's own
            self._paths = None
            peaks = self._peaks(st)
        return self._paths, peaks

    def _peaks(self, st: dict) -> tuple:
        """A read's peaks in ``self._paths``' order (decided by the first read)."""
        if self._paths is None:
            self._paths = self.s.paths = _paths_of(st)
            self._getter = peak_getter(self._paths)
        return self._getter(st)

    def status(self) -> dict:
        return {"boundaries": self.boundaries, "races": self.races,
                "unseen_resets": self.unseen_resets,
                "program_view_may_be_low_by": dict(self.s.view_short) or None}


def _restore(s: _State) -> None:
    """Put the original entry points back (those still ours). Caller holds s.lock."""
    for mod, name, orig, wrapper in s.installed:
        if getattr(mod, name, None) is wrapper:
            setattr(mod, name, orig)
    s.installed = []


def _tuple(st: dict, peak: int | None) -> tuple:
    a = st["allocated_bytes"]["all"]
    n = st.get("allocation", {}).get("all")
    p = int(a["peak"]) if peak is None else int(peak)
    head = (int(a["current"]), p, int(st["reserved_bytes"]["all"]["current"]),
            int(st.get("num_alloc_retries", 0)))
    if n is None:
        return head
    return head + (int(n["allocated"]), int(n["freed"]), int(a["allocated"]), int(a["freed"]))


def available(torch_mod: Any, C: Any = None) -> str | None:
    """Why the counter path cannot be used in this process (None: it can)."""
    C = C if C is not None else getattr(torch_mod, "_C", None)
    if C is None or not hasattr(C, STATS) or not hasattr(C, RESET):
        return f"torch {getattr(torch_mod, '__version__', '?')} has no CUDA peak counters"
    try:
        backend = torch_mod.cuda.get_allocator_backend()
    except Exception:
        backend = "native"
    if backend != "native":
        return (f"the {backend} allocator: gpumon resets only the native caching allocator's "
                "peak counters")
    return None


def accelerator_is_cuda(torch_mod: Any) -> bool:
    try:
        acc = torch_mod.accelerator.current_accelerator()
        return acc is not None and acc.type == "cuda"
    except Exception:
        return False


assert ALLOCATED == 0  # _tuple's order is memory.read's
