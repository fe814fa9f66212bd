"""Steps and phases: the labels, the boundaries between them, the step events, the tracker's
cost budget, the timeline, when a role breakdown is taken, and where the exact-peak meter
(exact.py) starts and ends its steps. The hooks (hooks.py) call in here, on the training
thread, with the lock held; the agent's thread only reads what was built here (``status``,
``request_breakdown``, ``timeline``) and closes a step that went quiet (``sample_extra``).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

from gpumon.agent import history as H
from gpumon.agent.phases.counters import FIRST
from gpumon.agent.phases.exact import RECORD_COST_S, ExactMeter, Result
from gpumon.agent.phases.hooks import TorchHooks
from gpumon.agent.phases.memory import PEAK, NoMemory
from gpumon.agent.phases.spikes import SpikeFinder
from gpumon.agent.phases.roles import RoleBook, account, derive_roles, optimizer_impl
from gpumon.agent.phases.timeline import Timeline

MAX_BOUNDARIES = 64     # boundaries sent per step event
MAX_MARKS = 4096        # boundaries kept per step for the exact replay
# The tracker's own time (stats reads, history reads and replays, bookkeeping) is kept under
# this fraction of the program's wall time by measuring only one step in N; N <= MAX_EVERY.
# 0.1%: with the sampler's ~0.3-0.35% at 10 Hz on a Python-bound loop (benchmarks/
# sampler_cost.md) the agent in all stays under 0.5%.
PHASES_BUDGET = 0.001
MAX_EVERY = 1024
RECENT_STEPS = 64
AUTO = ("forward", "backward", "optimizer", "other")  # a step's other phases tag it (eval, ...)
BREAKDOWN_WAIT_S = 1.0  # how long phases_breakdown waits for the training thread's next hook
# Breakdowns clients ask for are taken at most this often, and never more than ~0.5% of wall,
# however many clients ask: a flood of requests must not slow the program.
FORCED_MIN_INTERVAL_S = 0.2
# The breakdowns nobody asked for (once an interval) take at most this share of wall time: a
# walk of a 1.5B model's ~1,400 tensors costs ~4 ms on an H100 host, so every ~20 s there
# (at 0.1% it was every 4 s: a whole 0.1% of a step time target spent on a figure that, in a
# steady run, does not change; a client that wants it fresher asks, within ~0.5%).
BREAKDOWN_SHARE = 0.0002


def _log(msg: str) -> None:
    try:
        from gpumon.agent.log import get_logger  # the agent's own log, never stdout/stderr
        get_logger().info("phases: %s", msg)
    except Exception:
        pass


class _Segment:
    __slots__ = ("label", "t0", "reads0")

    def __init__(self, label: str, t0: float, reads0: dict) -> None:
        self.label = label
        self.t0 = t0
        self.reads0 = reads0


class _Step:
    def __init__(self, t0: float, reads0: dict | None, measured: bool = True) -> None:
        self.t0 = t0
        self.reads0 = reads0 or {}
        self.phase_time: dict[str, float] = {}
        self.phase_count: dict[str, int] = {}
        self.phase_peak: dict[Any, dict[str, int]] = {}    # bounds from the boundary reads
        self.phase_exact: dict[Any, dict[str, bool]] = {}  # ... exact (torch's counters)
        self.phase_note: dict[Any, str] = {}  # dev -> why a phase of this step is not exact
        self.boundaries: list = []
        self.marks: list = []          # (phase entered, reads, t) for the exact replay
        self.end_mark: int | None = None   # the mark at the last optimizer step's end
        self.forwards = 0
        self.backwards = 0
        self.optimizers: list = []          # the optimizer objects that stepped (identity)
        self.optimizer_impl: list = []      # their implementations, read when they stepped
        self.pending_close_t: float | None = None  # time of the last optimizer step end
        self.pending_reads: dict | None = None
        self.next_measured: bool | None = None     # decided at the optimizer step's end
        self.output_bytes: int | None = None  # the largest tensor a training forward returned
        self.autocast: str | bool | None = None  # that forward's autocast dtype, False: off
        self.measured = measured  # False: only labels and the step count (see PHASES_BUDGET)
        self.exact = False        # the exact-peak meter follows this step
        self.ptrs: dict | None = None  # the roles' storages at the step's end (exact roles)
        self.cost = 0.0           # the tracker's own seconds spent on this step


class PhaseTracker:
    """Phase detection, step accounting, exact peaks and the role breakdown.

    ``emit(kind, payload)`` sends an event; ``devices()`` gives the device keys to watch (CUDA
    indices the program initialised, or "cpu"); ``memory.read(dev)`` gives the allocator's
    figures (memory.py) or None; ``history``: torch's allocation history (memory.TorchHistory,
    or a fake; None: no exact peaks); ``nvml_used(dev)`` optionally gives NVML process memory.
    """

    def __init__(self, torch_mod: Any, emit: Callable[[str, dict], None],
                 devices: Callable[[], list], memory: Any = None,
                 nvml_used: Callable[[Any], int | None] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time,
                 breakdown_interval_s: float = 1.0, warm_steps: int = 3,
                 budget: float | None = None, history: Any = None) -> None:
        self.torch = torch_mod
        self._emit = emit
        self._devices = devices
        self.memory = memory if memory is not None else NoMemory()
        # counters.PeakCounters: every phase's exact peak from torch's counters (reset at each
        # boundary, the program's view kept); without it, the replay's sampled steps only
        self.counters = memory if hasattr(memory, "boundary") else None
        self.counters_note: str | None = None  # why there are no counters (set by the installer)
        self._next_reads: dict | None = None   # the figures right after the last boundary
        self.spikes = SpikeFinder()
        self._clock = clock
        self._wall = wall
        self._interval = breakdown_interval_s
        self._warm_steps = warm_steps
        self._budget = budget if budget and budget > 0 else None  # None: measure every step
        self.every = 1               # measure one step in this many
        self._cost_frac: float | None = None  # smoothed own time / step time, measured steps
        self._measure_more = 0       # measure this many next steps whatever the budget
        self._pending_cost = 0.0     # spent for the next step before it began (arming)
        self._lock = threading.RLock()
        self.hooks = TorchHooks(self, torch_mod)
        self.roles = RoleBook(nvml_used)
        self.timeline = Timeline(clock, wall)
        self.meter: ExactMeter | None = None
        if history is not None:
            self.meter = ExactMeter(history, devices)
        self._auto: str | None = None  # current automatic phase, None before anything was seen
        self._user: list[str] = []     # gpumon.phase() stack
        self._label: str | None = None
        self._seg: _Segment | None = None
        self._step: _Step | None = None
        self.steps_done = 0
        self.cost_total = 0.0         # the tracker's own seconds, all steps (benchmarks)
        self.time_total = 0.0         # the steps' seconds
        self._last_close_t: float | None = None
        self._next_breakdown_t = 0.0
        self._force_breakdown = False
        self._next_forced_t = 0.0     # a client's breakdown is taken no earlier than this
        self._waiters: list = []      # phases_breakdown requests waiting for the next hook
        self._walk: tuple | None = None   # (persistent, tensors) walked at this boundary
        self._no_forward_steps = 0
        # a step closed at a forward's start and not yet reported: its event is built when
        # that forward returns, or at the next boundary (the forward's kernels are queued by
        # then; after a sync, as in a loop that calls loss.item(), the GPU would wait for it)
        self._closed: tuple | None = None
        self._closed_now = False     # closed at this very forward's start: not reported yet
        # [phase, t, counters taken, own seconds, the ended step closed]: a forward's start
        # whose boundary is settled after its launches (_take_early, _settle)
        self._early: list | None = None
        self.early_starts = 0        # forward starts taken so (tests, benchmarks)
        self.note: str | None = None
        self.recent_steps: deque = deque(maxlen=RECENT_STEPS)
        self._rf: Any = None          # open record_function range (while recording)
        self._recording_check: Callable[[], bool] | None = None
        self._recording = False       # its answer, asked once a step (not at every boundary)
        self._u_frac = 0.0            # smoothed own time / step time of unmeasured steps
        self._installed = False
        self.label_samples = True

    # ------------------------------------------------------------------ install / remove
    def install_hooks(self) -> None:
        t = self.torch
        self.hooks.install()
        check = getattr(t._C, "_cuda_isHistoryEnabled", None)
        if check is not None:
            def recording() -> bool:  # a recording of the user's or a snapshot's, not ours
                try:
                    return bool(t.cuda.is_initialized() and check()) and not H.temporary()
                except Exception:
                    return False
            self._recording_check = recording
        self._installed = True

    def close(self) -> None:
        with self._lock:
            try:  # the run's last step (ended, not yet reported): measured while the meter is on
                # (maybe on the agent's thread: it settles a forward taken early's close, not
                # its boundary, which is dropped)
                self._maybe_close_step()
                self._early = None
                self._report_closed()
            except Exception as e:  # never into the program
                _log(f"last step: {e!r}")
            self.hooks.close()
            self._end_range()
            if self.meter is not None:
                self.meter.release()
            if self.counters is not None:
                self.counters.uninstall()
            self._installed = False

    def watch(self, model: Any = None, optimizer: Any = None) -> None:
        self.hooks.watch(model, optimizer)

    def roots(self) -> list:
        return self.hooks.roots()

    def current_label(self) -> str | None:
        return self._label

    def _read_all(self) -> dict:
        reads = {}
        for dev in self._devices():
            try:
                r = self.memory.read(dev)
            except Exception:
                r = None
            reads[dev] = r
        return reads

    # ------------------------------------------------------------------ what the hooks say
    def forward_started(self, grad_enabled: bool) -> None:
        phase = "forward" if grad_enabled else "eval"
        if self._can_take_early(phase):
            self._take_early(phase)
            return
        self._settle()
        self._maybe_close_step(defer=True)
        self.set_auto(phase)
        self._closed_now = False
        if phase == "forward":
            self._ensure_step().forwards += 1

    def forward_returned(self) -> None:
        """A root forward returned: its kernels are queued, so the boundary taken at its start
        is settled and the step closed there reported now, off the GPU's critical path."""
        self._settle()
        if self._closed is not None:
            self._report_closed()

    # A forward's start, where a loop that waits for the GPU every step (loss.item(), the
    # Trainer's NaN check, a pageable copy of the batch) has left it idle: every microsecond
    # the pre-hook spends there is the step's. Only the counters' read-reset-read runs there
    # (the next phase's peak starts at the reset); closing the step and the ended segment's
    # bookkeeping wait for the forward's return, or for whatever looks at the tracker first
    # (_settle). Steps the replay follows and recordings keep the in-place path (their marks
    # and ranges belong where the boundary is).
    def _can_take_early(self, phase: str) -> bool:
        c, m = self.counters, self.meter
        return (self._early is None and c is not None and c.installed and not self._user
                and self._step is not None and self._label != phase and not self._recording
                and self._closed is None and (m is None or not m.following()))

    def _take_early(self, phase: str) -> None:
        c0 = time.perf_counter()
        now = self._clock()
        taken: dict = {}
        for dev in self._devices():
            try:
                taken[dev] = self.counters.take(dev)
            except Exception as e:  # never into the program
                _log(f"counters: {e!r}")
                taken[dev] = None
        self._early = [phase, now, taken, time.perf_counter() - c0, False]
        self.early_starts += 1

    def _settle(self, boundary: bool = True) -> None:
        """The rest of a forward start taken early (``_take_early``), in the order the
        in-place path runs it: the step that ended is closed (and reported), then the boundary
        into the forward, with the figures and the time taken at its start. Caller holds the
        lock. ``boundary=False`` (the agent's threads): the close only; the boundary's part
        may walk the roles' tensors (a breakdown), which only the training thread does."""
        early = self._early
        if early is None:
            return
        if not early[4]:
            early[4] = True
            self._maybe_close_step()
        if not boundary:
            return
        self._early = None
        phase, now, taken, cost, _ = early
        self._auto = phase
        self._boundary(phase, now, taken)
        self._closed_now = False
        st = self._ensure_step()
        if phase == "forward":
            st.forwards += 1
        st.cost += cost

    def wants_output(self) -> bool:
        # the output's size rarely changes: the first steps and every 16th
        return self.steps_done < self._warm_steps or self.steps_done % 16 == 0

    def note_output(self, tensors: list, autocast: str | bool | None) -> None:
        st = self._step
        if st is None:
            return
        st.autocast = autocast
        for t in tensors:
            try:
                if t.is_floating_point() and t.dim() >= 2 and t.device.type != "meta":
                    b = t.numel() * t.element_size()
                    if st.output_bytes is None or b > st.output_bytes:
                        st.output_bytes = b
            except Exception:
                continue

    def backward_started(self) -> None:
        self._settle()
        self.set_auto("backward")
        self._ensure_step().backwards += 1

    def backward_ended(self) -> None:
        if self._auto == "backward":
            self.set_auto("other")

    def optimizer_started(self, optimizer: Any) -> None:
        self._settle()
        st = self._step
        if st is not None and st.pending_close_t is not None and any(
                o is optimizer for o in st.optimizers):
            self._maybe_close_step()
        self.set_auto("optimizer")
        st = self._step
        if st is not None:
            st.pending_close_t = None

    def optimizer_ended(self, optimizer: Any) -> None:
        now = self._clock()
        self._settle()
        st = self._step
        if st is not None and st.exact:
            # the roles' storages where the step ends (training thread: the only place
            # tensors are read): the replay finds them at the peak
            c0 = time.perf_counter()
            try:
                ptrs: dict = {}
                self._walk = self.compute_persistent(ptrs)
                st.ptrs = ptrs
            except Exception as e:
                _log(f"role walk failed: {e!r}")
            st.cost += time.perf_counter() - c0
        self.set_auto("other", now)
        self._walk = None
        st = self._ensure_step(now)
        if not any(o is optimizer for o in st.optimizers):
            st.optimizers.append(optimizer)
            st.optimizer_impl.append(optimizer_impl(optimizer))
        st.pending_close_t = now
        self.timeline.pending = (self.steps_done + 1, now)
        nxt = self._will_measure(self.steps_done + 1)
        st.next_measured = nxt
        c0 = time.perf_counter()
        reads = None
        if nxt and not (st.exact and self.meter is not None and self.meter.following()):
            reads = self._arm()
        if reads is None:
            # the figures right after this boundary (the counters were reset there), or now
            reads = self._next_reads if self._next_reads_t == now else self._read_all()
        st.pending_reads = reads
        if st.measured:
            if not st.marks or st.marks[-1][2] != now:
                self._add_mark(st, self._label, reads, now)
            st.end_mark = len(st.marks) - 1
        st.cost += time.perf_counter() - c0

    def set_auto(self, phase: str, now: float | None = None) -> None:
        self._auto = phase
        if not self._user:
            self._boundary(phase, now)

    def _ensure_step(self, now: float | None = None) -> _Step:
        if self._step is None:  # the first step of the run (always measured)
            now = self._clock() if now is None else now
            c0 = time.perf_counter()
            _, nxt, _ = self._read_boundary()
            reads = self._arm() or nxt
            self._next_reads, self._next_reads_t = reads, now
            st = self._step = _Step(now, reads)
            st.exact = self.meter is not None and self.meter.following()
            self._add_mark(st, self._label, reads, now)
            st.cost += time.perf_counter() - c0  # the arming included
            self._pending_cost = 0.0
        return self._step

    def _add_mark(self, st: _Step, label: str | None, reads: dict, t: float) -> None:
        if len(st.marks) < MAX_MARKS:
            st.marks.append((label, reads, t))
        elif st.exact:
            st.exact = False  # a step of thousands of phases: not replayed
            if self.meter is not None:
                self.meter.note = f"more than {MAX_MARKS} phase boundaries in one step"
                self.meter.release()

    def _read_boundary(self, taken: dict | None = None) -> tuple[dict, dict, dict]:
        """At a phase boundary: (reads, next_reads, why). With the counters: the figures now,
        whose PEAK is the ended phase's own exact peak, the figures right after the reset (the
        next phase starts there) and dev -> why the ended phase's peak may not be exact.
        Without: one read, used for both. ``taken``: the counters' part taken earlier, at the
        boundary itself (``_take_early``)."""
        c = self.counters
        devs = self._devices() if taken is None else list(taken)
        if taken is None and c is not None and not c.installed:
            if not any(isinstance(d, int) for d in devs):
                c = None  # no CUDA device in use yet: decide at a later boundary
            elif not c.prepare():
                self.counters_note, self.counters, c = c.off, None, None
        if c is None:
            r = self._read_all()
            return r, r, {}
        reads: dict = {}
        nxt: dict = {}
        why: dict = {}
        for dev in devs:
            try:
                if taken is None:
                    got = c.boundary(dev)
                else:
                    t = taken.get(dev)
                    got = None if t is None else c.settle(dev, t)
            except Exception as e:  # never into the program
                _log(f"counters: {e!r}")
                got = None
            if got is None:
                reads[dev] = nxt[dev] = None
                continue
            reads[dev], nxt[dev], w = got
            if w:
                why[dev] = w
            if w == FIRST:  # the program's peak before gpumon followed it: phase, step unknown
                rp = self.roles.run_peak.get(dev)
                r = reads[dev]
                if r[PEAK] > 0 and (rp is None or r[PEAK] > rp["bytes"]):
                    self.roles.run_peak[dev] = {"bytes": r[PEAK], "phase": None, "step": None}
        return reads, nxt, why

    def _boundary(self, label: str, now: float | None = None, taken: dict | None = None) -> None:
        """Leave the current segment and enter ``label``. Caller holds the lock. Every step:
        the figures are read (and, with the counters, the peaks reset) at every boundary;
        ``now`` and ``taken``: a boundary whose time and counters were taken earlier."""
        self._settle()
        if label == self._label:
            return
        if self._closed is not None and not self._closed_now:
            self._report_closed()
        now = self._clock() if now is None else now
        self.timeline.phase(now, label)
        c0 = time.perf_counter()
        if self._step is None:
            self._ensure_step(now)
            reads = nxt = self._step.marks[-1][1]
            why: dict = {}
        else:
            reads, nxt, why = self._read_boundary(taken)
            self._next_reads, self._next_reads_t = nxt, now
        st = self._step
        seg = self._seg
        if seg is not None:
            self._close_segment(seg, now, reads, why)
        self._label = label
        self._seg = _Segment(label, now, nxt)
        if st.measured:
            if st.marks and st.marks[-1][2] == now:
                st.marks[-1] = (label, st.marks[-1][1], now)  # the step began here
            else:
                self._add_mark(st, label, reads, now)
        if len(st.boundaries) < MAX_BOUNDARIES:
            st.boundaries.append({
                "t": round(now - st.t0, 6), "phase": label,
                "allocated": [r[0] if r else None for r in reads.values()]})
        self._annotate(label)
        st.cost += time.perf_counter() - c0

    def _close_segment(self, seg: _Segment, now: float, reads: dict, why: dict) -> None:
        st = self._step
        label = seg.label
        st.phase_time[label] = st.phase_time.get(label, 0.0) + (now - seg.t0)
        st.phase_count[label] = st.phase_count.get(label, 0) + 1
        new_peak: set = set()
        rb = self.roles
        for dev, r1 in reads.items():
            if r1 is None:
                continue
            if self.counters is not None:
                # torch's own peak since this phase began (reset at its start): exact
                val, exact = r1[PEAK], dev not in why
                if not exact:
                    st.phase_note.setdefault(dev, why[dev])
                    if why[dev] == FIRST:  # that peak is older than the phase: its bound
                        r0 = seg.reads0.get(dev)
                        val = max(r1[0], r0[0] if r0 else 0)
            else:
                r0 = seg.reads0.get(dev)
                if r0 is None:
                    continue
                a0, p0, a1, p1 = r0[0], r0[1], r1[0], r1[1]
                if p1 > p0:
                    # torch's high-water mark rose in this phase: its maximum is the new mark
                    val, exact = p1, True
                elif p1 < p0:  # the user reset the peak stats during this phase
                    val, exact = max(a0, a1, p1), False
                    st.phase_note.setdefault(dev, "the program reset the peak counters")
                else:
                    val, exact = max(a0, a1), False
            rp = rb.run_peak.get(dev)
            if rp is None or val > rp["bytes"]:
                if exact:
                    rb.run_peak[dev] = {"bytes": val, "phase": label, "step": self.steps_done + 1}
                    new_peak.add(dev)
                elif rp is not None or self.counters is not None:
                    # higher than anything proven, in a phase not measured exactly: the run's
                    # peak is known to be at least this, its phase and step are not
                    rb.run_peak[dev] = {"bytes": val, "phase": None, "step": None}
                    rb.run_peak_roles.pop(dev, None)
            pk = st.phase_peak.setdefault(dev, {})
            ex = st.phase_exact.setdefault(dev, {})
            if label not in pk:
                pk[label], ex[label] = val, exact
            elif self.counters is not None:
                # a phase entered twice in a step (gradient accumulation): its higher figure,
                # exact only if every visit was (a lower bound may hide a higher peak)
                pk[label], ex[label] = max(val, pk[label]), exact and ex[label]
            elif val > pk[label] or (val == pk[label] and exact):
                # without the counters "exact" is where the run's high-water mark rose: no
                # later visit can exceed it without raising it again
                pk[label], ex[label] = val, exact
        if new_peak and not st.measured:
            self._measure_more = self._warm_steps  # the workload changed: replay its roles
        warm = self.steps_done < self._warm_steps
        forced = self._force_breakdown and now >= self._next_forced_t
        if warm or new_peak or forced or now >= self._next_breakdown_t:
            self._breakdown(label, reads, now, new_peak)

    def _annotate(self, label: str) -> None:
        if self._recording:
            self._open_range(label)
        elif self._rf is not None:
            self._end_range()

    # ------------------------------------------------------------------ user marks
    def mark(self, name: str) -> None:
        with self._lock:
            self._settle()
            self._maybe_close_step()
            self._auto = "other"  # a mark ends the automatic phase in progress
            if self._user:  # inside gpumon.phase(): the mark renames the block from here on
                self._user[-1] = name
            self._boundary(name)

    def push(self, name: str) -> None:
        with self._lock:
            self._settle()
            self._maybe_close_step()
            self._user.append(name)
            self._boundary(name)

    def pop(self) -> None:
        with self._lock:
            self._settle()
            if self._user:
                self._user.pop()
            self._boundary(self._user[-1] if self._user else (self._auto or "other"))

    # ------------------------------------------------------------------ breakdown
    def compute_persistent(self, pointers: dict | None = None) -> tuple[dict, int]:
        """Walk the roles' tensors. Training thread only."""
        devs = self._devices()
        return account(self.hooks.modules(), list(self.hooks.optimizers), set(devs),
                       self.torch, pointers)

    def _breakdown(self, ended: str | None, reads: dict, now: float,
                   new_peak: set = frozenset()) -> None:
        c0 = time.perf_counter()
        try:
            persistent, n = self._walk if self._walk is not None else self.compute_persistent()
        except Exception as e:  # never into the training loop
            _log(f"breakdown failed: {e!r}")
            return
        rb = self.roles
        for dev in new_peak:
            # the phase that just ended set the high-water mark: the persistent roles as they
            # are at its end, activations = the peak - those (the exact replay refines it)
            rp = rb.run_peak.get(dev)
            r = reads.get(dev)
            if rp is not None:
                rb.run_peak_roles[dev] = derive_roles(persistent.get(dev), rp["bytes"],
                                                      r[2] if r else None, None)
        devices = rb.devices_entry(reads, persistent, ended)
        cost = time.perf_counter() - c0
        if self._step is not None:
            self._step.cost -= cost  # rate-limited on its own, below: not part of the budget
        # adaptive rate limit: at most once per interval and <= BREAKDOWN_SHARE of wall time
        # (asked-for ones: <= ~0.5%)
        self._next_breakdown_t = now + max(self._interval, cost / BREAKDOWN_SHARE)
        self._next_forced_t = now + max(FORCED_MIN_INTERVAL_S, cost * 200)
        payload = {"step": self.steps_done + 1, "phase": ended, "t": self._wall(),
                   "cost_us": int(cost * 1e6), "tensors": n, "devices": devices,
                   "worst_steps": self.spikes.worst(), "spikes": list(self.spikes.spikes)}
        rb.last = payload
        self._force_breakdown = False
        waiters, self._waiters = self._waiters, []
        for ev in waiters:
            ev.set()
        self._send("breakdown", payload)

    def breakdown_now(self) -> dict:
        """A breakdown walked now. Training thread only (tests, benchmarks); the agent's
        command uses ``request_breakdown``."""
        with self._lock:
            self._settle()
        reads = self._read_all()
        persistent, n = self.compute_persistent()
        return {"step": self.steps_done + 1, "phase": self._label, "t": self._wall(),
                "tensors": n, "devices": self.roles.devices_entry(reads, persistent)}

    def request_breakdown(self, wait_s: float = BREAKDOWN_WAIT_S) -> dict:
        """For the agent's thread (``phases_breakdown``): ask the training thread for a fresh
        breakdown at its next hook and wait up to ``wait_s`` for it; without one (the program
        is paused or between steps), the last one it made. Touches no tensor: the figures were
        taken on the training thread. ``fresh``: made after this request; ``age_s``: how old."""
        fresh = False
        if wait_s > 0:  # wait 0: the last one, and nothing asked of the training thread
            ev = threading.Event()
            self._waiters.append(ev)
            self._force_breakdown = True
            fresh = ev.wait(wait_s)
        bd = self.roles.last
        if bd is None:
            return {"step": None, "phase": self._label, "t": None, "tensors": 0,
                    "devices": [], "fresh": False, "age_s": None,
                    "note": "no phase boundary seen yet: the breakdown comes with the first "
                            "forward or optimizer step"}
        out = dict(bd)
        out["fresh"] = bool(fresh)
        out["age_s"] = round(max(0.0, self._wall() - bd["t"]), 3)
        return out

    # ------------------------------------------------------------------ steps
    def _will_measure(self, index: int) -> bool:
        """Whether the step that starts with ``steps_done == index`` is measured."""
        return (self.every <= 1 or self._measure_more > 0 or index < self._warm_steps
                or index % self.every == 0)

    def _arm(self) -> dict | None:
        m = self.meter
        if m is None or m.off:
            return None
        c0 = time.perf_counter()
        try:
            return m.arm(self._read_all)
        except Exception as e:
            _log(f"exact peaks: {e!r}")
            return None
        finally:
            self._pending_cost += time.perf_counter() - c0

    def _maybe_close_step(self, now: float | None = None, defer: bool = False) -> None:
        """Close the step whose optimizer step ended: the next one starts. Its event is built
        now, or with ``defer`` (a forward's start) when that forward returns or at the next
        boundary, whichever comes first (``_report_closed``)."""
        self._settle(boundary=False)
        if self._closed is not None:
            self._report_closed()  # a forward-only step in between: reported in order
        st = self._step
        if st is None or st.pending_close_t is None:
            return
        t_end = st.pending_close_t
        self.steps_done += 1
        self.timeline.step_end(self.steps_done, t_end)
        prev = self._last_close_t
        time_s = t_end - (prev if prev is not None else st.t0)
        self._last_close_t = t_end
        nxt = st.next_measured if st.next_measured is not None \
            else self._will_measure(self.steps_done)
        self.time_total += max(0.0, time_s)
        c0 = time.perf_counter()
        exact: dict = {}
        if st.measured and st.exact and st.end_mark is not None and self.meter is not None:
            marks = [(label, reads) for label, reads, _ in st.marks[:st.end_mark + 1]]
            exact = self.meter.measure(marks, st.ptrs, nxt, self._read_all)
            st.cost += RECORD_COST_S * self.meter.entries
        elif st.measured and self.meter is not None and self.meter.following() and not nxt:
            self.meter.release()
        st.cost += time.perf_counter() - c0
        self._closed = (st, self.steps_done, t_end, time_s, exact)
        # the next step starts where this one ended
        self._next_step(t_end, st.pending_reads or st.reads0, nxt)
        self._closed_now = defer
        if not defer:
            self._report_closed()

    def _report_closed(self) -> None:
        """Build and send the closed step's event (its devices' peaks and phases, the spike
        finder, the budget). Under the lock, on the training thread or the agent's. It runs
        inside a forward's end hook or ahead of a boundary's reads: a failure costs this one
        event, never the hook's own work."""
        closed, self._closed = self._closed, None
        if closed is None:
            return
        try:
            self._send_closed(*closed)
        except Exception as e:
            _log(f"step {closed[1]}: {e!r}")

    def _send_closed(self, st: _Step, index: int, t_end: float, time_s: float,
                     exact: dict) -> None:
        c0 = time.perf_counter()
        if self.counters is not None:
            why_not = None  # each phase says (counters.py)
        else:
            base = self.counters_note or "no resettable peak counters on this device"
            m = self.meter
            if m is None or m.off:
                why_not = base + (f"; {m.off}" if m is not None and m.off else "")
            elif not st.measured:
                why_not = (f"{base}; the allocation history is replayed for one step in "
                           f"{self.every} (gpumon's time budget)")
            else:
                why_not = None if st.exact else (
                    m.note or "this step was not followed from its start")
        devs, best = self._step_devices(st, exact, why_not, index)
        if st.forwards == 0:
            self._no_forward_steps += 1
            # said at once where torch.compile has run (a forward compiled away, not a one-off
            # step: whether the last model seen is collected by now must not decide it)
            if self._no_forward_steps >= 2 or not self.hooks.roots() or self.hooks.compiled():
                self.note = self.hooks.no_forward_note()
        else:
            self._no_forward_steps = 0
            self.note = None
        tags = [k for k in st.phase_time if k not in AUTO]
        t_wall = self._wall() - (self._clock() - t_end)
        peak = best["peak"] if best else None
        peak_exact = best["peak_exact"] if best else False
        spike = self.spikes.add(index, peak, best["peak_phase"] if best else None,
                                peak_exact, tags, round(t_wall, 3))
        ev = {
            "step": index, "t": t_wall,
            "time_s": round(time_s, 6),
            "phases": {k: {"time_s": round(v, 6), "count": st.phase_count.get(k, 0)}
                       for k, v in st.phase_time.items()},
            "forwards": st.forwards, "backwards": st.backwards,
            "optimizers": [type(o).__name__ for o in st.optimizers],
            "optimizer_impl": list(st.optimizer_impl),
            "output_bytes": st.output_bytes, "autocast": st.autocast,
            "peak": peak,
            "peak_phase": best["peak_phase"] if best else None,
            "peak_exact": peak_exact,
            "peak_device": best["index"] if best else None,
            "exact_note": best["exact_note"] if best else (
                why_not or self.counters_note or "no allocator counters on this device"),
            "devices": devs, "boundaries": st.boundaries, "phases_note": self.note,
            "measured_every": self.every, "replayed": bool(exact), "tags": tags,
            "spike": spike,
            # the tracker's own time in this step so far (its bookkeeping, the counters, a
            # replay): what gpumon cost it
            "cost_us": int((st.cost + time.perf_counter() - c0) * 1e6),
        }
        self.recent_steps.append(ev)
        self.timeline.step_peak(index, peak, ev["peak_phase"], peak_exact)
        self._send("step", ev)
        st.cost += time.perf_counter() - c0
        self.cost_total += st.cost
        if st.measured:
            self._update_every(st.cost, time_s)
        elif time_s > 0:  # the price of every step (hooks, counters): the budget leaves it room
            self._u_frac = 0.95 * self._u_frac + 0.05 * min(st.cost / time_s, 1.0)

    def _step_devices(self, st: _Step, exact: dict, why_not: str | None,
                      index: int) -> tuple[list, Any]:
        """Each device's figures for the step event, and the device with the highest peak.
        With the counters every phase peak is torch's own; the step is exact when all its
        phases are, in the phase that holds the highest. The replay (when it ran) adds the
        roles at the peak moment. Without the counters: the replay's result, or a lower bound
        (exact only where torch's high-water mark rose)."""
        reads_end = st.pending_reads or {}
        devs = []
        best = None
        for dev in sorted(set(st.phase_peak) | set(exact), key=str):
            r0 = st.reads0.get(dev)
            r1 = reads_end.get(dev)
            res = exact.get(dev)
            pk = dict(st.phase_peak.get(dev, {}))
            ex = dict(st.phase_exact.get(dev, {}))
            roles = None
            if self.counters is not None and pk:
                ph = max(pk, key=lambda k: pk[k])
                peak, is_exact = pk[ph], all(ex.get(k) for k in pk)
                phase = ph if is_exact else None
                note = None if is_exact else st.phase_note.get(dev, "a phase was not exact")
                if isinstance(res, Result):
                    if res.peak == peak and res.roles is not None:
                        roles = derive_roles(res.roles, peak, r1[2] if r1 else None, None)
                    elif res.peak != peak:
                        _log(f"replay {res.peak} != counters {peak} at step {index}")
                elif is_exact:
                    got = self.roles.roles_at_end.get(ph, {}).get(dev)
                    if got is not None:
                        roles = derive_roles(got[0], peak, got[1], None)
            elif isinstance(res, Result):
                pk = dict(res.span_peaks)
                ex = {k: True for k in pk}
                peak, phase, is_exact, note = res.peak, res.phase, True, None
                roles = derive_roles(res.roles, res.peak, r1[2] if r1 else None, None) \
                    if res.roles is not None else None
            else:
                if not pk:
                    continue
                ph = max(pk, key=lambda k: (pk[k], ex.get(k, False)))
                peak, is_exact = pk[ph], bool(ex.get(ph))
                # exact only where torch's high-water mark rose: then that phase holds it
                phase = ph if is_exact else None
                note = None if is_exact else (
                    res if isinstance(res, str) else st.phase_note.get(dev) or why_not
                    or "the exact-peak meter stopped following before the step ended")
                if is_exact:
                    got = self.roles.roles_at_end.get(ph, {}).get(dev)
                    if got is not None:
                        roles = derive_roles(got[0], peak, got[1], None)
            d = {"index": dev, "peak": peak, "peak_phase": phase, "peak_exact": is_exact,
                 "phase_peaks": pk, "phase_peaks_exact": ex, "at_peak": roles,
                 "exact_note": note,
                 "start": r0[0] if r0 else None, "end": r1[0] if r1 else None}
            devs.append(d)
            if is_exact:
                self.roles.step_peak[dev] = {"bytes": peak, "phase": phase, "roles": roles,
                                             "step": index,
                                             "reserved": r1[2] if r1 else None}
                rp = self.roles.run_peak.get(dev)
                if isinstance(res, Result) and roles is not None and rp is not None \
                        and rp["step"] == index and rp["bytes"] == peak:
                    self.roles.run_peak_roles[dev] = roles  # exact at the run's peak too
            if best is None or d["peak"] > best["peak"]:
                best = d
        return devs, best

    def _update_every(self, cost: float, time_s: float) -> None:
        """Measure one step in ``every`` so that the tracker's time stays within the budget:
        with a measured step costing f of its time and the other steps u of theirs (the hooks'
        bookkeeping), one in N costs about f / N + u (an exactly replayed step of 10 ms costs
        ~30-40% of it; of 200 ms, ~10%)."""
        if self._budget is None or time_s <= 0:
            return
        f = min(cost / time_s, 1.0)
        self._cost_frac = f if self._cost_frac is None else 0.8 * self._cost_frac + 0.2 * f
        room = self._budget - self._u_frac
        if self._cost_frac <= room:
            self.every = 1
        elif room <= 0:
            self.every = MAX_EVERY
        else:
            self.every = max(1, min(MAX_EVERY, int(self._cost_frac / room) + 1))

    def _next_step(self, t0: float, reads0: dict | None, measured: bool) -> None:
        if self._measure_more > 0 and measured:
            self._measure_more -= 1
        if not measured and self.meter is not None and self.meter.following():
            self.meter.release()
        if reads0 is None:
            reads0 = self._read_all()
        nxt = _Step(t0, reads0, measured)
        if measured:
            nxt.exact = self.meter is not None and self.meter.following()
            self._add_mark(nxt, self._label, reads0, t0)
        nxt.cost = self._pending_cost
        self._pending_cost = 0.0
        self._step = nxt
        self._recording = self._recording_check is not None and self._recording_check()
        if self._recording:
            self._point_range(f"gpumon.step#{self.steps_done}")
        self.hooks.step_closed(self.steps_done)

    def _send(self, kind: str, payload: dict) -> None:
        try:
            self._emit(kind, payload)
        except Exception as e:
            _log(f"emit failed: {e!r}")

    # ------------------------------------------------------------------ agent thread
    @property
    def last_breakdown(self) -> dict | None:
        return self.roles.last

    def sample_extra(self) -> dict:
        st = self._step
        if st is not None and st.pending_close_t is not None \
                and self._clock() - st.pending_close_t > 1.0:
            with self._lock:  # the program went quiet after a step: report it
                self._maybe_close_step()
        if self._closed is not None and self._clock() - self._closed[2] > 1.0:
            with self._lock:  # stopped inside a forward (a long eval, a pause)
                self._report_closed()
        label, step = self._now_label_step()
        if label is None or not self.label_samples:
            return {}  # nothing seen yet: leave the sample's own fields alone
        return {"phase": label, "step": step}

    def _now_label_step(self) -> tuple:
        """The phase in progress and its step's number, a forward taken early included."""
        label, step = self._label, self.steps_done + 1
        early, st = self._early, self._step
        if early is not None:  # a forward began, its boundary not settled yet
            label = early[0]
            if not early[4] and st is not None and st.pending_close_t is not None:
                step += 1  # ... nor the step that ended closed
        return label, step

    def status(self) -> dict:
        if self._closed is not None or self._early is not None:
            with self._lock:  # an agent thread: the step's close, not the boundary (_settle)
                self._settle(boundary=False)
                self._report_closed()
        m = self.meter
        label, step = self._now_label_step()
        return {
            "installed": self._installed, "phase": label,
            "step": step if label is not None else None,
            "steps_done": self.steps_done, "discovery": self.hooks.discovery,
            "roots": [type(r).__name__ for r in self.roots()],
            "optimizers": [type(o).__name__ for o in list(self.hooks.optimizers)],
            "note": self.note or (self.hooks.unseen_note() if not self.steps_done else None),
            "recent_steps": list(self.recent_steps),
            "last_breakdown": self.roles.last, "measured_every": self.every,
            "exact_peaks": None if m is None else {"off": m.off, "note": m.note},
            "counters": None if self.counters is None else dict(
                self.counters.status(), forward_starts_taken_early=self.early_starts),
            "counters_note": self.counters_note,
            "worst_steps": self.spikes.worst(), "spikes": list(self.spikes.spikes),
        }

    # ------------------------------------------------------------------ snapshot annotations
    def _open_range(self, label: str) -> None:
        self._end_range()
        try:
            ops = self.torch.ops.profiler
            self._rf = ops._record_function_enter_new(f"gpumon.phase#{label}", None)
        except Exception as e:
            self._rf = None
            _log(f"annotation: {e!r}")

    def _end_range(self) -> None:
        rf, self._rf = self._rf, None
        if rf is not None:
            try:
                self.torch.ops.profiler._record_function_exit._RecordFunction(rf)
            except Exception:
                pass

    def _point_range(self, name: str) -> None:
        try:
            ops = self.torch.ops.profiler
            rf = ops._record_function_enter_new(name, None)
            ops._record_function_exit._RecordFunction(rf)
        except Exception:
            pass

    def recording_started(self) -> None:
        """Open the current phase's annotation range now (call right after starting a
        recording, so the phase in progress is annotated from the first event)."""
        with self._lock:
            self._settle(boundary=False)  # an agent thread: see _settle
            self._recording = True
            label = self._now_label_step()[0]  # a forward taken early: its own range
            if label is not None:
                self._open_range(label)
