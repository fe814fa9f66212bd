"""Exact per-step peaks: what ``torch.cuda.max_memory_allocated()`` would say had it been reset
at the step's start (and at each phase boundary), without resetting anything.

How (measured on the H200, benchmarks/exact_peak.md): for the steps the tracker measures, the
meter turns on torch's cheapest allocation history (``_record_memory_history`` with no stacks
and no context: ~0.3 us per allocator event) at the step boundary before, on the training
thread, together with a snapshot of the allocator's segments (the state it starts from). At the
step's end it reads the history back (one ``_cuda_memorySnapshot``) and replays it
(replay.py): every allocation gets the block size torch's counters add, so the replay gives
``memory_allocated()`` after every event of the step. The phase boundaries are pinned to places
in the history by torch's own cumulative counters (allocations and frees, read with the other
figures at each boundary), not by clocks. The replay is checked against torch's counters (the
allocated figure at every boundary, the bytes allocated and freed in the step); a step that
fails any check is reported not exact, with the reason, and never given a phase.

A history that is already on (the program's own, a ``gpumon snapshot`` recording, the OOM
flight recorder) is read as it is and never changed; gpumon/agent/history.py says who may turn
what on and off. Consecutive measured steps share one history: the model of the allocator
carries over and the entries after the step's end are kept for the next one.

Cost per measured step (H200, the blog's 1.5B model at batch 2, 173 ms steps): the segments
snapshot ~2.5 ms (only after an unmeasured step), the history read ~12 ms for 11k entries, the
replay ~5-8 ms; the tracker's budget (PHASES_BUDGET) measures one step in N to pay for it.
"""
from __future__ import annotations

from typing import Any, Callable

from gpumon.agent import history as H
from gpumon.agent.phases.memory import (ALLOCATED, BYTES_ALLOC, BYTES_FREED, N_ALLOC, N_FREE)
from gpumon.agent.phases.replay import (AllocatorModel, Inconsistent, replay, window_start)

RECORD_COST_S = 0.3e-6  # what one history entry costs the allocator (H200: 0.27-0.33 us)


class _Dev:
    __slots__ = ("model", "counts", "seen", "carry")

    def __init__(self, model: AllocatorModel, counts: tuple[int, int]) -> None:
        self.model = model      # the allocator's state at ``counts``
        self.counts = counts    # torch's (allocations, frees) counters at the model's state
        self.seen = counts      # ... at the last history read
        self.carry: list = []   # entries read after the model's state, not yet replayed


class Result:
    """One device's exactly measured step."""
    __slots__ = ("peak", "phase", "span_peaks", "roles")

    def __init__(self, peak: int, phase: str, span_peaks: dict, roles: dict | None) -> None:
        self.peak = peak
        self.phase = phase
        self.span_peaks = span_peaks  # phase -> its exact peak in this step
        self.roles = roles            # persistent roles at the peak moment, or None


class ExactMeter:
    """Follows the measured steps through torch's allocation history (training thread).

    ``history``: TorchHistory (memory.py) or a fake; ``devices()``: the CUDA indices to follow.
    """

    def __init__(self, history: Any, devices: Callable[[], list]) -> None:
        self.h = history
        self._devices = devices
        self.ours = False            # our trace-only history is on
        self.devs: dict[Any, _Dev] = {}
        self.note: str | None = None  # why the last step was not measured exactly
        self.off: str | None = None   # why the meter is off for good
        self._checked = False         # whether ``off`` was asked of the history (once, at the
        # first measured step: CUDA is in use by then)
        self.entries = 0              # history entries read for the last step (its cost)

    # ------------------------------------------------------------------ ownership
    def handed_over(self) -> None:
        """history.take_over(): our history is someone else's recording now."""
        self.ours = False

    def _stop_ours(self) -> None:
        with H.LOCK:
            if self.ours:
                self.ours = False
                H.set_temporary(None)
                try:
                    self.h.stop()
                except Exception:
                    pass

    def release(self) -> None:
        """Stop following: our history off (if it is ours), the model dropped."""
        self.devs = {}
        self._stop_ours()

    def following(self) -> bool:
        return bool(self.devs)

    # ------------------------------------------------------------------ step start
    def arm(self, read_all: Callable[[], dict]) -> dict | None:
        """Start following at this point (the start of a measured step): the history on and
        the allocator's state read. Returns the reads taken at that state (the step's start
        figures), or None if the step cannot be followed (``note`` says why)."""
        if self.off or self.devs:
            return None  # off, or already following (the step before was measured)
        devs = [d for d in self._devices() if isinstance(d, int)]
        if not devs:
            return None  # no CUDA device in use (never start the history: it would init CUDA)
        if not self._checked:
            self._checked = True
            try:
                self.off = self.h.unavailable()
            except Exception as e:
                self.off = f"the allocation history cannot be used: {_line(e)}"
            if self.off:
                return None
        try:
            with H.LOCK:
                if not self.h.is_on():
                    self.h.start()
                    self.ours = True
                    H.set_temporary(self)
            for _ in range(2):
                r0 = read_all()
                snap = self.h.snapshot(False)
                r1 = read_all()
                if all(_counts(r0.get(d)) == _counts(r1.get(d)) for d in devs):
                    break
            else:
                self.note = "allocations on another thread while the allocator's state was read"
                self._stop_ours()
                return None
        except Exception as e:
            self.note = f"the allocation history could not be read: {_line(e)}"
            self._stop_ours()
            return None
        settings = snap.get("allocator_settings")
        segs = snap.get("segments") or []
        for d in devs:
            c = _counts(r1.get(d))
            if c is None:
                self.note = "torch's counters lack the allocation counts"
                self.release()
                return None
            m = AllocatorModel(segs, settings, device=d)
            if m.allocated != r1[d][ALLOCATED]:
                self.note = "the allocator's state disagrees with its counters"
                self.release()
                return None
            self.devs[d] = _Dev(m, c)
        return r1

    # ------------------------------------------------------------------ step end
    def measure(self, marks: list, pointers: dict | None, keep: bool,
                read_all: Callable[[], dict]) -> dict:
        """Replay the step. ``marks``: [(phase entered, reads)] from the step's start to its
        end; ``pointers``: the roles' storages at the step's end ({dev: {addr: (role,
        bytes)}}); ``keep``: the next step is measured too. Returns {dev: Result | str (why
        not exact)}."""
        out: dict = {}
        self.entries = 0
        if not self.devs:
            return out
        try:
            for _ in range(2):
                e0 = read_all()
                snap = self.h.snapshot(True)
                e1 = read_all()
                if all(_counts(e0.get(d)) == _counts(e1.get(d)) for d in self.devs):
                    break
            else:
                raise Inconsistent("allocations on another thread while the history was read")
        except Exception as e:
            why = f"the allocation history could not be read: {_line(e)}"
            out = {d: why for d in self.devs}
            self.release()
            return out
        traces = snap.get("device_traces") or []
        frames = False
        for d, st in list(self.devs.items()):
            try:
                trace = traces[d] if d < len(traces) else []
                now = _counts(e1.get(d))
                i = window_start(trace, now[0] - st.seen[0], now[1] - st.seen[1])
                if i is None:
                    raise Inconsistent("the allocation history lost entries of this step (its "
                                       "ring is too small, or it was turned off or cleared)")
                new = trace[i:]
                self.entries += len(new)
                if new and new[-1].get("frames"):
                    frames = True  # someone turned stacks on: that history is not ours now
                entries = st.carry + new
                st.seen = now
                out[d] = self._one(st, entries, marks, d, (pointers or {}).get(d) or {})
            except Inconsistent as e:
                out[d] = str(e)
                del self.devs[d]
            except Exception as e:  # never into the program
                out[d] = f"replay failed: {_line(e)}"
                del self.devs[d]
        if frames:
            with H.LOCK:
                if self.ours:
                    self.ours = False
                    H.set_temporary(None)
        if not keep or not self.devs:
            self.release()
        elif self.ours:
            with H.LOCK:
                if self.ours:
                    try:
                        self.h.clear()  # the carry holds what the next step needs
                    except Exception:
                        self.release()
        return out

    def _one(self, st: _Dev, entries: list, marks: list, d: int, ptrs: dict) -> Result:
        counts = []
        for _, reads in marks:
            c = _counts(reads.get(d))
            if c is None:
                raise Inconsistent("a phase boundary has no counters")
            counts.append(c)
        # the model may start before the step (armed at an earlier optimizer end): the
        # entries before the first mark are replayed outside every span
        r = replay(st.model, entries, st.counts, counts, frozenset(ptrs))
        values, peaks = r.values, r.peaks
        for (label, reads), v in zip(marks, values):
            if v != reads[d][ALLOCATED]:
                raise Inconsistent(f"the replay gives {v} allocated at a boundary where torch "
                                   f"counted {reads[d][ALLOCATED]}")
        s, t = marks[0][1][d], marks[-1][1][d]
        if r.alloc_bytes != t[BYTES_ALLOC] - s[BYTES_ALLOC] \
                or r.freed_bytes != t[BYTES_FREED] - s[BYTES_FREED]:
            raise Inconsistent("the replayed block sizes disagree with torch's byte counters")
        st.carry = entries[r.end:]
        st.counts = counts[-1]
        # spans: marks[k] .. marks[k+1], in the phase entered at marks[k]
        span_peaks: dict = {}
        best = None
        for k, (mx, pos) in enumerate(peaks):
            label = marks[k][0]
            if mx > span_peaks.get(label, -1):
                span_peaks[label] = mx
            if best is None or mx > best[0]:
                best = (mx, pos, label)
        if best is None:  # a step of no span (start == end): its one value
            return Result(values[0], marks[0][0], {marks[0][0]: values[0]}, None)
        roles = None
        if ptrs:
            live = st.model.live
            roles = {"parameters": 0, "gradients": 0, "optimizer_state": 0}
            for addr, (role, nbytes) in ptrs.items():
                if addr in live and r.last_alloc.get(addr, -1) < best[1]:
                    roles[role] += nbytes
        return Result(best[0], best[2], span_peaks, roles)


def _counts(r: Any) -> tuple[int, int] | None:
    if r is None or len(r) <= N_FREE:
        return None
    return (r[N_ALLOC], r[N_FREE])


def _line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__

