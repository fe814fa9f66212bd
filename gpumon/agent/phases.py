"""Training phases and the memory breakdown by role, measured inside the training process.

Standard library only at import; torch is taken from ``sys.modules`` once the program has
imported it (the agent never imports torch itself).

How phases are found (no change to user code)
---------------------------------------------
* optimizer step: torch's global optimizer step pre/post hooks (every optimizer, cheap).
* forward: the *root* modules (the outermost module called, nesting depth 0). Global module
  hooks cost ~10% on Python-bound steps (FACTS.md), so they only run during a short discovery
  window (the first training step, re-armed for one step when an optimizer steps whose
  parameters no known root owns); each root found gets its own pre/post hook and the global
  hooks are dropped. A root forward with grad mode on is ``forward``; under ``no_grad`` /
  ``inference_mode`` it is ``eval``.
* backward: when a grad-enabled root forward returns, a pre-hook goes on the ``grad_fn`` of
  its output tensors; it fires when autograd reaches the model's output (``loss.backward()``),
  and queues an engine callback (``queue_callback``) that fires when that backward pass ends.
  So ``forward`` runs from the root forward's start to the start of its backward (it includes
  the loss computed outside the model), ``backward`` is exactly the autograd pass.
  Recomputation of checkpointed modules inside backward is ignored (graph task id).
* everything else (data loading, logging, gradient clipping) is ``other``;
  ``gpumon.mark(name)`` / ``with gpumon.phase(name):`` label it yourself (inside a
  ``gpumon.phase`` block the label is yours even when forward/backward run inside it).
* steps: a step ends with the optimizer step(s) that follow its forward/backward passes
  (gradient accumulation = several forward/backward per step; several optimizers stepping
  back to back = one step). It is closed when the next forward, mark or step starts.
* torch.compile: ``torch.compile(model)`` works (the OptimizedModule wrapper runs eagerly);
  when optimizer steps happen with no forward seen (``model.compile()`` in place, functional
  calls), the step reports ``phases_note`` and forward/backward are "unavailable": not guessed.
  Note: dropping the discovery hooks after the first step can trigger one recompilation.

Per-phase peaks without touching the user's peak stats
------------------------------------------------------
gpumon never calls ``reset_peak_memory_stats`` (that would change what the user's
``max_memory_allocated`` returns). At each phase boundary it reads, per device, allocated and
the device's peak with one stats call (``torch._C._cuda_memoryStats``, ~15 us). The peak is a
high-water mark: if it rose during a phase, that phase's maximum is exactly the new peak
(``exact: true``). If it did not, the phase's maximum lies between the larger of its boundary
values (reported, ``exact: false``) and the all-time peak; clients refine that lower bound with
the samples taken during the phase (every sample carries ``phase`` and ``step``). The run's peak
and the phase and step where it was set are therefore always exact. If the user resets the peak
stats themselves, the drop is seen and the phase is reported inexact.

Events (``{"type": "event", "kind": ...}``)
-------------------------------------------
``step`` (one per measured step)::

    {"step": int (1-based), "t": unix time at the step's end, "time_s": float (end to end),
     "phases": {name: {"time_s": float, "count": int}},
     "forwards": int, "backwards": int, "optimizers": [class names],
     "optimizer_impl": ["fused"|"foreach"|"for-loop"|null],   # one per optimizer
     "output_bytes": int|null,   # largest float tensor a training forward returned (logits);
                                 # measured in the first steps and every 16th, else null
     "autocast": "bfloat16"|"float16"|false|null,   # autocast in that forward (false: off;
                                 # null: not measured this step)
     "peak": int|null, "peak_phase": str|null, "peak_exact": bool, "peak_device": int|null,
     "devices": [{"index": int, "peak": int, "peak_phase": str, "peak_exact": bool,
                  "phase_peaks": {name: int}, "phase_peaks_exact": {name: bool},
                  "start": int, "end": int}],          # allocated at step start / end
     "boundaries": [{"t": s since step start, "phase": entered phase, "allocated": [int|null]}],
                    # allocated in the order of "devices"; at most 64 per step
     "phases_note": str|null,                           # why phases are partial, if they are
     "measured_every": int}                             # 1 in this many steps is measured

Cost: each boundary reads the stats of every device (~15-25 us) and does some bookkeeping, ~200
us per step of five boundaries: 2% of a 10 ms step. The tracker times itself and keeps its time
under PHASES_BUDGET (0.3%, ``GPUMON_PHASES_BUDGET``; 0 = measure every step) of the program's
wall time by measuring one step in N (N <= 64; the first steps, steps while a snapshot records
and the steps after the high-water mark rose unseen are always measured). Unmeasured steps
still label samples with their phase and count steps, and send no event. A high-water mark
set during an unmeasured step is reported with ``run_peak_phase``/``run_peak_step`` null.

``breakdown`` (at phase boundaries: every boundary of the first 3 steps, when a new peak was
set, otherwise at most once per second and never more than ~0.5% of wall time)::

    {"step": int, "phase": str (the phase that just ended), "t": unix time, "cost_us": int,
     "tensors": int (tensors walked),
     "devices": [{"index": int|"cpu",
                  "now": {role: int|null}, "allocated": int|null, "reserved": int|null,
                  "at_peak": {role: int|null}|null,   # the last completed step's peak
                  "peak": int|null, "peak_phase": str|null, "peak_step": int|null,
                  "peak_exact": bool,
                  "run_peak": int|null, "run_peak_phase": str|null, "run_peak_step": int|null,
                  "at_run_peak": {role: int|null}|null,  # at the run's high-water mark
                  "retries": int|null}]}

Roles: ``parameters`` (parameters and buffers of the modules seen in forward, watched modules and
the optimizers' param_groups), ``gradients`` (``.grad``), ``optimizer_state`` (tensors in
``optimizer.state``), each deduplicated by storage; ``activations`` = allocated - those three
(activations and temporaries); ``allocator_cache`` = reserved - allocated; ``non_pytorch`` =
NVML process used - reserved (null here when the agent has no NVML figure: clients compute it
from the samples' ``proc_used``). ``at_peak`` (the last completed step's peak, a lower bound when
that step did not raise the high-water mark) and ``at_run_peak`` (the run's peak, always exact)
use the persistent roles measured at the end of the phase where the peak fell, and activations
= peak - those (so inside backward, where gradients grow, the split is approximate; the total
is exact).

Commands: ``phases_status`` -> state, roots, optimizers, recent steps, last breakdown;
``phases_breakdown`` -> a breakdown computed now.

Snapshots: while the CUDA allocator records history (``_record_memory_history``), each phase
is wrapped in a ``torch.profiler.record_function`` range named ``gpumon.phase#<name>`` and each
step end is a zero-length ``gpumon.step#<n>`` range; they land in the snapshot's
``external_annotations`` (START/END) when recording uses ``global_record_annotations=True``
(or was started on the training thread). See ``recording_started()``.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterable

ROLES = ("parameters", "gradients", "optimizer_state", "activations", "allocator_cache",
         "non_pytorch")
PERSISTENT_ROLES = ("parameters", "gradients", "optimizer_state")
AUTO_PHASES = ("forward", "backward", "optimizer", "eval", "other")

MAX_BOUNDARIES = 64
# The tracker's own time (stats reads, bookkeeping) is kept under this fraction of the
# program's wall time by measuring only one step in N when steps are short; N <= MAX_EVERY.
PHASES_BUDGET = 0.003
MAX_EVERY = 64
RECENT_STEPS = 64
DISCOVERY_MAX_ROOT_CALLS = 200  # inference-only programs: stop global hooks after this many
DISCOVERY_MAX_S = 60.0


def _log(msg: str) -> None:
    try:
        from gpumon.agent.log import get_logger  # the agent's own log, never stdout/stderr
        get_logger().info("phases: %s", msg)
    except Exception:
        pass


# ----------------------------------------------------------------------------- memory readers
class CudaMemory:
    """One ``torch._C._cuda_memoryStats`` call per device per read (no flatten)."""

    def __init__(self, torch_mod: Any) -> None:
        self._stats = torch_mod._C._cuda_memoryStats

    def read(self, dev: Any) -> tuple[int, int, int, int] | None:
        if not isinstance(dev, int):
            return None
        s = self._stats(dev)
        if not s:
            return None
        a = s["allocated_bytes"]["all"]
        return (int(a["current"]), int(a["peak"]), int(s["reserved_bytes"]["all"]["current"]),
                int(s.get("num_alloc_retries", 0)))


class NoMemory:
    def read(self, dev: Any) -> None:
        return None


# ----------------------------------------------------------------------------- role accounting
def _device_key(t: Any) -> Any:
    if t.is_cuda:
        return t.get_device()
    return t.device.type  # "cpu", "meta", "mps", ...


def _storage(t: Any) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except Exception:  # tensor subclasses without storage (some wrappers)
        try:
            return t.data_ptr(), t.numel() * t.element_size()
        except Exception:
            return None


def account(modules: Iterable[Any], optimizers: Iterable[Any], device_filter: set | None,
            torch_mod: Any) -> tuple[dict, int]:
    """Bytes per device of parameters (+buffers), gradients and optimizer state.

    Each storage is counted once (first role wins, in the order above); a storage that several
    tensors view is counted at its full size. ``device_filter``: device keys to count (CUDA
    index ints, "cpu"); None counts every device. Returns ({device: {role: bytes}}, tensors seen).
    """
    Tensor = torch_mod.Tensor
    seen: set = set()
    out: dict = {}
    n = 0

    def add(t: Any, role: str) -> None:
        nonlocal n
        n += 1
        dev = _device_key(t)
        if dev == "meta" or (device_filter is not None and dev not in device_filter):
            return
        st = _storage(t)
        if st is None:
            return
        key = (dev, st[0])
        if st[0] == 0 or key in seen:  # 0: empty storage
            return
        seen.add(key)
        d = out.get(dev)
        if d is None:
            d = out[dev] = {"parameters": 0, "gradients": 0, "optimizer_state": 0}
        d[role] += st[1]

    params: list = []
    pids: set = set()
    for m in modules:
        try:
            for p in m.parameters():
                if id(p) not in pids:
                    pids.add(id(p))
                    params.append(p)
            for b in m.buffers():
                if isinstance(b, Tensor):
                    add(b, "parameters")
        except Exception:
            continue
    opts = list(optimizers)
    for o in opts:
        try:
            for g in o.param_groups:
                for p in g["params"]:
                    if id(p) not in pids:
                        pids.add(id(p))
                        params.append(p)
        except Exception:
            continue
    for p in params:
        add(p, "parameters")
    for p in params:
        g = p.grad
        if g is not None:
            add(g, "gradients")
    for o in opts:
        try:
            states = list(o.state.values())
        except Exception:
            continue
        for st in states:
            if isinstance(st, dict):
                for v in st.values():
                    if isinstance(v, Tensor):
                        add(v, "optimizer_state")
            elif isinstance(st, Tensor):
                add(st, "optimizer_state")
    return out, n


def derive_roles(persistent: dict | None, allocated: int | None, reserved: int | None,
                 nvml_used: int | None) -> dict:
    """All six roles from the persistent three and the allocator's figures (None = unknown)."""
    p = persistent or {"parameters": 0, "gradients": 0, "optimizer_state": 0}
    roles = {k: int(p.get(k, 0)) for k in PERSISTENT_ROLES}
    known = sum(roles.values())
    roles["activations"] = max(0, allocated - known) if allocated is not None else None
    roles["allocator_cache"] = (max(0, reserved - allocated)
                                if reserved is not None and allocated is not None else None)
    roles["non_pytorch"] = (max(0, nvml_used - reserved)
                            if nvml_used is not None and reserved is not None else None)
    return roles


# ----------------------------------------------------------------------------- the tracker
class _Segment:
    __slots__ = ("label", "t0", "reads0")

    def __init__(self, label: str, t0: float, reads0: dict) -> None:
        self.label = label
        self.t0 = t0
        self.reads0 = reads0


class _Step:
    def __init__(self, t0: float, reads0: dict) -> None:
        self.t0 = t0
        self.reads0 = reads0
        self.phase_time: dict[str, float] = {}
        self.phase_count: dict[str, int] = {}
        self.phase_peak: dict[Any, dict[str, int]] = {}
        self.phase_exact: dict[Any, dict[str, bool]] = {}
        self.boundaries: list = []
        self.forwards = 0
        self.backwards = 0
        self.optimizers: list = []          # the optimizer objects that stepped (identity)
        self.pending_close_t: float | None = None  # time of the last optimizer step end
        self.pending_reads: dict | None = None
        self.output_bytes: int | None = None  # the largest tensor a training forward returned
        self.autocast: str | bool | None = None  # that forward's autocast dtype, False: off
        self.measured = True  # False: only labels and the step count (see PHASES_BUDGET)
        self.cost = 0.0       # the tracker's own seconds spent on this step


class PhaseTracker:
    """Phase detection, step accounting and the role breakdown.

    ``emit(kind, payload)`` sends an event; ``devices()`` gives the device keys to watch (CUDA
    indices the program initialised, or "cpu"); ``memory.read(dev)`` gives (allocated, peak,
    reserved, retries) or None; ``nvml_used(dev)`` optionally gives NVML process memory.
    """

    def __init__(self, torch_mod: Any, emit: Callable[[str, dict], None],
                 devices: Callable[[], list], memory: Any = None,
                 nvml_used: Callable[[Any], int | None] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time,
                 breakdown_interval_s: float = 1.0, warm_steps: int = 3,
                 budget: float | None = None) -> None:
        self.torch = torch_mod
        self._emit = emit
        self._devices = devices
        self.memory = memory if memory is not None else NoMemory()
        self._nvml_used = nvml_used
        self._clock = clock
        self._wall = wall
        self._interval = breakdown_interval_s
        self._warm_steps = warm_steps
        self._budget = budget if budget and budget > 0 else None  # None: measure every step
        self.every = 1               # measure one step in this many
        self._cost_frac: float | None = None  # smoothed own time / step time, measured steps
        self._measure_more = 0       # measure this many next steps whatever the budget
        self._lock = threading.RLock()
        self._handles: list = []
        self._global_handles: list = []
        self._tls = threading.local()
        self._roots: dict[int, tuple[Any, list]] = {}   # id -> (weakref, handles)
        self._watched: list = []                         # weakrefs of watched modules
        self._optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._covered_opts: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._root_active: Any = None
        self._root_depth = 0
        self._opt_depth = 0
        self._bwd_task: Any = None
        self._auto = None            # current automatic phase, None before anything was seen
        self._user: list[str] = []   # gpumon.phase() stack
        self._label: str | None = None
        self._seg: _Segment | None = None
        self._step: _Step | None = None
        self.steps_done = 0
        self._last_close_t: float | None = None
        self._run_peak: dict = {}    # dev -> {"bytes", "phase", "step"}
        self._run_peak_roles: dict = {}  # dev -> roles at the run's high-water mark
        self._last_step_peak: dict = {}  # dev -> {"bytes", "phase", "exact", "step"}
        self._roles_at_end: dict[str, dict] = {}   # phase -> {dev: (persistent, reserved)}
        self._next_breakdown_t = 0.0
        self._force_breakdown = False
        self._no_forward_steps = 0
        self.note: str | None = None
        self.recent_steps: deque = deque(maxlen=RECENT_STEPS)
        self.last_breakdown: dict | None = None
        self._discovery = False
        self._discovery_until_step = 1
        self._discovery_calls = 0
        self._discovery_t0 = 0.0
        self._rf: Any = None          # open record_function range (while recording)
        self._recording_check: Callable[[], bool] | None = None
        self._installed = False
        self.label_samples = True
        t = torch_mod
        self._is_compiling = _pick_is_compiling(t)
        self._graph_task_id = getattr(t._C, "_current_graph_task_id", None)

    # ------------------------------------------------------------------ install / remove
    def install_hooks(self) -> None:
        t = self.torch
        opt = sys.modules["torch.optim.optimizer"]
        self._handles.append(opt.register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(opt.register_optimizer_step_post_hook(self._opt_post))
        self._start_discovery()
        check = getattr(t._C, "_cuda_isHistoryEnabled", None)
        if check is not None:
            def recording() -> bool:
                try:
                    return bool(t.cuda.is_initialized() and check())
                except Exception:
                    return False
            self._recording_check = recording
        self._installed = True
        for ref in list(self._watched):
            m = ref()
            if m is not None:
                self._add_root(m)

    def close(self) -> None:
        with self._lock:
            self._stop_discovery()
            for h in self._handles:
                h.remove()
            self._handles.clear()
            for _ref, hs in self._roots.values():
                for h in hs:
                    h.remove()
            self._roots.clear()
            self._end_range()
            self._installed = False

    def _start_discovery(self) -> None:
        if self._discovery:
            return
        mm = sys.modules["torch.nn.modules.module"]
        self._global_handles.append(mm.register_module_forward_pre_hook(self._disc_pre))
        try:
            h = mm.register_module_forward_hook(self._disc_post, always_call=True)
        except TypeError:  # torch < 2.1
            h = mm.register_module_forward_hook(self._disc_post)
        self._global_handles.append(h)
        self._discovery = True
        self._tls = threading.local()  # depth restarts at 0 (an earlier stop may leave it at 1)
        self._discovery_calls = 0
        self._discovery_t0 = self._clock()
        self._discovery_until_step = self.steps_done + 1

    def _stop_discovery(self) -> None:
        for h in self._global_handles:
            h.remove()
        self._global_handles.clear()
        self._discovery = False

    def watch(self, model: Any = None, optimizer: Any = None) -> None:
        if model is not None:
            for m in (model if isinstance(model, (list, tuple)) else [model]):
                self._watched.append(weakref.ref(m))
                if self._installed:
                    self._add_root(m)
        if optimizer is not None:
            for o in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]):
                self._optimizers.add(o)

    def _add_root(self, module: Any) -> None:
        key = id(module)
        if key in self._roots and self._roots[key][0]() is module:
            return
        hs = [module.register_forward_pre_hook(self._root_pre)]
        try:
            hs.append(module.register_forward_hook(self._root_post, always_call=True))
        except TypeError:
            hs.append(module.register_forward_hook(self._root_post))

        def gone(_ref: Any, key: int = key) -> None:
            self._roots.pop(key, None)
        self._roots[key] = (weakref.ref(module, gone), hs)
        self._covered_opts = weakref.WeakSet()  # coverage may change
        _log(f"root module {type(module).__name__}")

    def roots(self) -> list:
        return [m for m in (r() for r, _ in list(self._roots.values())) if m is not None]

    # ------------------------------------------------------------------ helpers
    def _in_backward(self) -> bool:
        if self._graph_task_id is not None:
            try:
                return self._graph_task_id() != -1
            except Exception:
                pass
        return False

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

    # ------------------------------------------------------------------ the boundary
    def _set_auto(self, phase: str, now: float | None = None) -> None:
        self._auto = phase
        if not self._user:
            self._boundary(phase, now)

    def _ensure_step(self, now: float | None = None) -> _Step:
        if self._step is None:
            self._step = _Step(self._clock() if now is None else now, self._read_all())
        return self._step

    def _boundary(self, label: str, now: float | None = None) -> None:
        """Leave the current segment and enter ``label``. Caller holds the lock."""
        if label == self._label:
            return
        st = self._step
        if st is not None and not st.measured:
            self._label = label
            self._annotate(label)
            return
        c0 = time.perf_counter()
        now = self._clock() if now is None else now
        reads = self._read_all()
        if self._step is None:
            self._step = _Step(now, reads)
        seg = self._seg
        if seg is not None:
            self._close_segment(seg, now, reads)
        self._label = label
        self._seg = _Segment(label, now, reads)
        st = self._step
        if len(st.boundaries) < MAX_BOUNDARIES:
            st.boundaries.append({
                "t": round(now - st.t0, 6), "phase": label,
                "allocated": [r[0] if r else None for r in reads.values()]})
        self._annotate(label)
        st.cost += time.perf_counter() - c0

    def _annotate(self, label: str) -> None:
        if self._recording_check is not None and self._recording_check():
            self._open_range(label)
        elif self._rf is not None:
            self._end_range()

    def _close_segment(self, seg: _Segment, now: float, reads: dict) -> None:
        st = self._step
        label = seg.label
        st.phase_time[label] = st.phase_time.get(label, 0.0) + (now - seg.t0)
        st.phase_count[label] = st.phase_count.get(label, 0) + 1
        new_peak: set = set()
        for dev, r1 in reads.items():
            r0 = seg.reads0.get(dev)
            if r1 is None or r0 is None:
                continue
            a0, p0, a1, p1 = r0[0], r0[1], r1[0], r1[1]
            if p1 > p0:
                val, exact = p1, True
                self._run_peak[dev] = {"bytes": p1, "phase": label, "step": self.steps_done + 1}
                new_peak.add(dev)
            elif p1 < p0:  # the user reset the peak stats during this phase
                val, exact = max(a0, a1, p1), False
            else:
                val, exact = max(a0, a1), False
            pk = st.phase_peak.setdefault(dev, {})
            ex = st.phase_exact.setdefault(dev, {})
            if label not in pk or val > pk[label] or (val == pk[label] and exact):
                pk[label] = val
                ex[label] = exact
        warm = self.steps_done < self._warm_steps
        if warm or new_peak or self._force_breakdown or now >= self._next_breakdown_t:
            self._force_breakdown = False
            self._breakdown(label, reads, now, new_peak)

    # ------------------------------------------------------------------ breakdown
    def compute_persistent(self) -> tuple[dict, int]:
        devs = self._devices()
        filt = set(devs)
        mods = self.roots() + [m for m in (r() for r in self._watched) if m is not None]
        return account(mods, list(self._optimizers), filt, self.torch)

    def _breakdown(self, ended: str, reads: dict, now: float, new_peak: set = frozenset()
                   ) -> None:
        c0 = time.perf_counter()
        try:
            persistent, n = self.compute_persistent()
        except Exception as e:  # never into the training loop
            _log(f"breakdown failed: {e!r}")
            return
        devices = []
        ends = self._roles_at_end.setdefault(ended, {})
        for dev, r in reads.items():
            per = persistent.get(dev, {"parameters": 0, "gradients": 0, "optimizer_state": 0})
            alloc = r[0] if r else None
            reserved = r[2] if r else None
            ends[dev] = (per, reserved)
            nv = None
            if self._nvml_used is not None:
                try:
                    nv = self._nvml_used(dev)
                except Exception:
                    nv = None
            entry = {"index": dev, "now": derive_roles(per, alloc, reserved, nv),
                     "allocated": alloc, "reserved": reserved,
                     "retries": r[3] if r else None}
            entry.update(self._at_peak(dev, nv))
            rp = self._run_peak.get(dev)
            if dev in new_peak and rp is not None:
                # the phase that just ended set the high-water mark: the persistent roles as
                # they are at its end, activations = the peak - those
                self._run_peak_roles[dev] = derive_roles(per, rp["bytes"], reserved, None)
            entry.update(self._run_peak_entry(dev, r, nv))
            devices.append(entry)
        cost = time.perf_counter() - c0
        if self._step is not None:
            self._step.cost -= cost  # rate-limited on its own, below: not part of the budget
        # adaptive rate limit: at most once per interval and <= ~0.5% of wall time
        self._next_breakdown_t = now + max(self._interval, cost * 200)
        payload = {"step": self.steps_done + 1, "phase": ended, "t": self._wall(),
                   "cost_us": int(cost * 1e6), "tensors": n, "devices": devices}
        self.last_breakdown = payload
        self._send("breakdown", payload)

    def _run_peak_entry(self, dev: Any, r: Any, nv: int | None) -> dict:
        rp = self._run_peak.get(dev)
        at = self._run_peak_roles.get(dev)
        if at is not None:
            at = dict(at)
            if nv is not None and at.get("non_pytorch") is None:
                at["non_pytorch"] = max(0, nv - (at["allocator_cache"] or 0) - rp["bytes"]) \
                    if at.get("allocator_cache") is not None else None
        return {"run_peak": rp["bytes"] if rp else (r[1] if r else None),
                "run_peak_phase": rp["phase"] if rp else None,
                "run_peak_step": rp["step"] if rp else None,
                "at_run_peak": at}

    def _at_peak(self, dev: Any, nv: int | None) -> dict:
        sp = self._last_step_peak.get(dev)
        if not sp or sp.get("phase") is None:
            return {"at_peak": None, "peak": None, "peak_phase": None, "peak_step": None,
                    "peak_exact": False}
        at = None
        got = self._roles_at_end.get(sp["phase"], {}).get(dev)
        if got is not None:
            per, reserved = got
            at = derive_roles(per, sp["bytes"], reserved, nv)
        return {"at_peak": at, "peak": sp["bytes"], "peak_phase": sp["phase"],
                "peak_step": sp["step"], "peak_exact": sp["exact"]}

    # ------------------------------------------------------------------ steps
    def _maybe_close_step(self, now: float | None = None) -> None:
        st = self._step
        if st is None or st.pending_close_t is None:
            return
        t_end = st.pending_close_t
        self.steps_done += 1
        prev = self._last_close_t
        time_s = t_end - (prev if prev is not None else st.t0)
        self._last_close_t = t_end
        if not st.measured:
            self._next_step(t_end, None)
            return
        c0 = time.perf_counter()
        reads_end = st.pending_reads or {}
        devs = []
        best = None
        for dev in list(st.phase_peak):
            r0 = st.reads0.get(dev)
            pk = st.phase_peak.get(dev, {})
            ex = st.phase_exact.get(dev, {})
            if not pk:
                continue
            ph = max(pk, key=lambda k: (pk[k], ex.get(k, False)))
            r1 = reads_end.get(dev)
            d = {"index": dev, "peak": pk[ph], "peak_phase": ph, "peak_exact": bool(ex.get(ph)),
                 "phase_peaks": dict(pk), "phase_peaks_exact": dict(ex),
                 "start": r0[0] if r0 else None, "end": r1[0] if r1 else None}
            devs.append(d)
            self._last_step_peak[dev] = {"bytes": pk[ph], "phase": ph,
                                         "exact": bool(ex.get(ph)), "step": self.steps_done}
            if best is None or d["peak"] > best["peak"]:
                best = d
        if st.forwards == 0:
            self._no_forward_steps += 1
            if self._no_forward_steps >= 2 or not self._roots:
                self.note = ("forward/backward unavailable: optimizer steps but no module forward "
                             "was seen (model.compile() in place, or a functional call); "
                             "only the optimizer step is measured")
        else:
            self._no_forward_steps = 0
            self.note = None
        ev = {
            "step": self.steps_done, "t": self._wall() - (self._clock() - t_end),
            "time_s": round(time_s, 6),
            "phases": {k: {"time_s": round(v, 6), "count": st.phase_count.get(k, 0)}
                       for k, v in st.phase_time.items()},
            "forwards": st.forwards, "backwards": st.backwards,
            "optimizers": [type(o).__name__ for o in st.optimizers],
            "optimizer_impl": [optimizer_impl(o) for o in st.optimizers],
            "output_bytes": st.output_bytes, "autocast": st.autocast,
            "peak": best["peak"] if best else None,
            "peak_phase": best["peak_phase"] if best else None,
            "peak_exact": best["peak_exact"] if best else False,
            "peak_device": best["index"] if best else None,
            "devices": devs, "boundaries": st.boundaries, "phases_note": self.note,
            "measured_every": self.every,
        }
        self.recent_steps.append(ev)
        self._send("step", ev)
        st.cost += time.perf_counter() - c0
        self._update_every(st.cost, time_s)
        # the next step starts where this one ended
        self._next_step(t_end, reads_end or st.reads0)

    def _update_every(self, cost: float, time_s: float) -> None:
        """Measure one step in ``every`` so that the tracker's time stays within the budget
        (steps of 10 ms with ~5 boundaries cost ~2%; steps of 100 ms and more cost <0.3%)."""
        if self._budget is None or time_s <= 0:
            return
        f = min(cost / time_s, 1.0)
        self._cost_frac = f if self._cost_frac is None else 0.8 * self._cost_frac + 0.2 * f
        self.every = max(1, min(MAX_EVERY, int(self._cost_frac / self._budget) + 1)) \
            if self._cost_frac > self._budget else 1

    def _next_step(self, t0: float, reads0: dict | None) -> None:
        measured = (self.every <= 1 or self._measure_more > 0
                    or self.steps_done < self._warm_steps or self.steps_done % self.every == 0
                    or (self._recording_check is not None and self._recording_check()))
        if self._measure_more > 0:
            self._measure_more -= 1
        if not measured:
            self._seg = None
        elif reads0 is None:  # after unmeasured steps: read where this one starts
            reads0 = self._read_all()
            self._check_missed_peak(reads0)
            self._seg = _Segment(self._label, self._clock(), reads0) \
                if self._label is not None else None
        nxt = _Step(t0, reads0 if measured else {})
        nxt.measured = measured
        self._step = nxt
        if self._recording_check is not None and self._recording_check():
            self._point_range(f"gpumon.step#{self.steps_done}")
        if self._discovery and self.steps_done >= self._discovery_until_step:
            self._stop_discovery()

    def _check_missed_peak(self, reads: dict) -> None:
        """The high-water mark rose during unmeasured steps: the run peak is known, its phase
        and step are not (null); measure the next steps, the workload changed."""
        for dev, r in reads.items():
            if r is None:
                continue
            rp = self._run_peak.get(dev)
            if rp is not None and r[1] > rp["bytes"]:
                self._run_peak[dev] = {"bytes": r[1], "phase": None, "step": None}
                self._run_peak_roles.pop(dev, None)
                self._measure_more = self._warm_steps

    def _send(self, kind: str, payload: dict) -> None:
        try:
            self._emit(kind, payload)
        except Exception as e:
            _log(f"emit failed: {e!r}")

    # ------------------------------------------------------------------ torch hooks
    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._is_compiling():
            return
        try:
            with self._lock:
                self._opt_depth += 1
                if self._opt_depth > 1:
                    return
                st = self._step
                if st is not None and st.pending_close_t is not None and any(
                        o is optimizer for o in st.optimizers):
                    self._maybe_close_step()
                self._optimizers.add(optimizer)
                self._check_coverage(optimizer)
                self._set_auto("optimizer")
                st = self._step
                if st is not None:
                    st.pending_close_t = None
        except Exception as e:
            _log(f"optimizer pre-hook: {e!r}")

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._is_compiling():
            return
        try:
            with self._lock:
                self._opt_depth = max(0, self._opt_depth - 1)
                if self._opt_depth:
                    return
                now = self._clock()
                self._set_auto("other", now)
                st = self._ensure_step(now)
                if not any(o is optimizer for o in st.optimizers):
                    st.optimizers.append(optimizer)
                st.pending_close_t = now
                seg = self._seg
                if not st.measured:
                    st.pending_reads = None
                elif seg is not None and seg.t0 == now:
                    st.pending_reads = seg.reads0
                else:
                    c0 = time.perf_counter()
                    st.pending_reads = self._read_all()
                    st.cost += time.perf_counter() - c0
        except Exception as e:
            _log(f"optimizer post-hook: {e!r}")

    def _check_coverage(self, optimizer: Any) -> None:
        if optimizer in self._covered_opts or self._discovery:
            return
        owned = set()
        for m in self.roots():
            owned.update(id(p) for p in m.parameters())
        ps = [p for g in optimizer.param_groups for p in g["params"]]
        if all(id(p) in owned for p in ps):
            self._covered_opts.add(optimizer)
        elif self._discovery_calls < DISCOVERY_MAX_ROOT_CALLS:
            self._covered_opts.add(optimizer)  # look once; re-arm discovery for one step
            self._start_discovery()

    def _disc_pre(self, module: Any, args: Any) -> None:
        if self._is_compiling():
            return
        tls = self._tls
        depth = getattr(tls, "depth", 0)
        tls.depth = depth + 1
        if depth:
            return
        try:
            if self._in_backward():
                return
            self._discovery_calls += 1
            if (self._discovery_calls > DISCOVERY_MAX_ROOT_CALLS
                    or self._clock() - self._discovery_t0 > DISCOVERY_MAX_S):
                with self._lock:
                    self._stop_discovery()
            if id(module) not in self._roots:
                with self._lock:
                    self._add_root(module)
                # the root's own pre-hook was not registered when this call began
                self._root_pre(module, args)
        except Exception as e:
            _log(f"discovery: {e!r}")

    def _disc_post(self, module: Any, args: Any, output: Any) -> None:
        if self._is_compiling():
            return
        tls = self._tls
        tls.depth = max(0, getattr(tls, "depth", 0) - 1)

    def _root_pre(self, module: Any, args: Any) -> None:
        if self._is_compiling():
            return
        try:
            if self._in_backward():
                return  # recomputation (activation checkpointing) inside backward
            with self._lock:
                if self._root_active is not None:
                    if self._root_active is module:  # called twice for one call (discovery)
                        return
                    self._root_depth += 1
                    return
                self._root_active = module
                self._root_depth = 1
                self._maybe_close_step()
                phase = "forward" if self.torch.is_grad_enabled() else "eval"
                self._set_auto(phase)
                if phase == "forward":
                    self._ensure_step().forwards += 1
        except Exception as e:
            _log(f"root pre-hook: {e!r}")

    def _root_post(self, module: Any, args: Any, output: Any) -> None:
        if self._is_compiling():
            return
        try:
            if self._in_backward():
                return
            with self._lock:
                if self._root_active is None:
                    return
                if self._root_active is not module or self._root_depth > 1:
                    self._root_depth = max(1, self._root_depth - 1)
                    return
                self._root_active = None
                self._root_depth = 0
                if self._auto == "forward":
                    tensors = _tensors(output, self.torch.Tensor)
                    if self.steps_done < self._warm_steps or self.steps_done % 16 == 0:
                        self._note_output(tensors)  # the output's size rarely changes
                    if self._arm_backward(tensors):
                        return  # forward lasts until backward starts (the loss is part of it)
                self._set_auto("other")
        except Exception as e:
            _log(f"root post-hook: {e!r}")

    def _note_output(self, tensors: list) -> None:
        st = self._step
        if st is None:
            return
        st.autocast = self._autocast(tensors)
        for t in tensors:
            try:
                if t.is_floating_point() and t.dim() >= 2 and _device_key(t) != "meta":
                    b = t.numel() * t.element_size()
                    if st.output_bytes is None or b > st.output_bytes:
                        st.output_bytes = b
            except Exception:
                continue

    def _autocast(self, tensors: list) -> str | bool | None:
        """The autocast dtype in force for this forward's device (the post-hook runs inside
        the user's `with torch.autocast(...)`), False when off, None when torch can't say."""
        torch = self.torch
        dev = tensors[0].device.type if tensors else "cuda"
        try:
            try:
                on = torch.is_autocast_enabled(dev)
                dtype = torch.get_autocast_dtype(dev) if on else None
            except TypeError:  # torch < 2.4: no device argument (CUDA's autocast)
                on = torch.is_autocast_enabled()
                dtype = torch.get_autocast_gpu_dtype() if on else None
            return str(dtype).replace("torch.", "") if on else False
        except Exception:
            return None

    def _arm_backward(self, tensors: list) -> bool:
        nodes = []
        seen = set()
        for t in tensors:
            fn = t.grad_fn
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                nodes.append(fn)
        for fn in nodes:
            fn.register_prehook(self._bwd_start)
        return bool(nodes)

    def _bwd_start(self, grad_outputs: Any) -> None:
        try:
            tid = self._graph_task_id() if self._graph_task_id is not None else None
            with self._lock:
                if self._bwd_task is not None and self._bwd_task == tid:
                    return None
                self._bwd_task = tid if tid is not None else True
                self._set_auto("backward")
                self._ensure_step().backwards += 1
            self.torch.autograd.Variable._execution_engine.queue_callback(self._bwd_end)
        except Exception as e:
            _log(f"backward pre-hook: {e!r}")
        return None

    def _bwd_end(self) -> None:
        try:
            with self._lock:
                self._bwd_task = None
                if self._auto == "backward":
                    self._set_auto("other")
        except Exception as e:
            _log(f"backward end: {e!r}")

    # ------------------------------------------------------------------ user marks
    def mark(self, name: str) -> None:
        with self._lock:
            self._maybe_close_step()
            self._auto = "other"  # a mark ends the automatic phase in progress
            if self._user:  # inside gpumon.phase(): the mark renames the block from here on
                self._user[-1] = name
            self._boundary(name)

    def push(self, name: str) -> None:
        with self._lock:
            self._maybe_close_step()
            self._user.append(name)
            self._boundary(name)

    def pop(self) -> None:
        with self._lock:
            if self._user:
                self._user.pop()
            self._boundary(self._user[-1] if self._user else (self._auto or "other"))

    # ------------------------------------------------------------------ sampler side
    def sample_extra(self) -> dict:
        st = self._step
        if st is not None and st.pending_close_t is not None \
                and self._clock() - st.pending_close_t > 1.0:
            with self._lock:  # the program went quiet after a step: report it
                self._maybe_close_step()
        label = self._label
        if label is None or not self.label_samples:
            return {}  # nothing seen yet: leave the sample's own fields alone
        return {"phase": label, "step": self.steps_done + 1}

    def status(self) -> dict:
        return {
            "installed": self._installed, "phase": self._label,
            "step": self.steps_done + 1 if self._label is not None else None,
            "steps_done": self.steps_done, "discovery": self._discovery,
            "roots": [type(m).__name__ for m in self.roots()],
            "optimizers": [type(o).__name__ for o in list(self._optimizers)],
            "note": self.note, "recent_steps": list(self.recent_steps),
            "last_breakdown": self.last_breakdown,
        }

    def breakdown_now(self) -> dict:
        reads = self._read_all()
        persistent, n = self.compute_persistent()
        devices = []
        for dev, r in reads.items():
            per = persistent.get(dev)
            nv = None
            if self._nvml_used is not None:
                try:
                    nv = self._nvml_used(dev)
                except Exception:
                    nv = None
            d = {"index": dev, "now": derive_roles(per, r[0] if r else None,
                                                   r[2] if r else None, nv),
                 "allocated": r[0] if r else None, "reserved": r[2] if r else None,
                 "retries": r[3] if r else None}
            d.update(self._at_peak(dev, nv))
            d.update(self._run_peak_entry(dev, r, nv))
            devices.append(d)
        return {"step": self.steps_done + 1, "phase": self._label, "t": self._wall(),
                "tensors": n, "devices": devices}

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
            if self._label is not None:
                self._open_range(self._label)


def optimizer_impl(o: Any) -> str | None:
    """How the optimizer steps: "fused", "foreach" or "for-loop" (torch's default for an
    unset ``foreach``: foreach when the parameters are on CUDA); None if it has no such option."""
    try:
        g = o.param_groups[0]
        if g.get("fused"):
            return "fused"
        if "foreach" not in g:
            return None
        fe = g["foreach"]
        if fe is not None:
            return "foreach" if fe else "for-loop"
        ps = g["params"]
        return "foreach" if ps and ps[0].is_cuda and not g.get("differentiable") else "for-loop"
    except Exception:
        return None


def _tensors(obj: Any, Tensor: type, depth: int = 0, limit: int = 16) -> list:
    """Tensors in a module's output: a tensor, tuple/list, dict (HF ModelOutput), dataclass."""
    if isinstance(obj, Tensor):
        return [obj]
    if depth > 2 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return []
    out: list = []
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dataclass_fields__"):
        items = [getattr(obj, f, None) for f in obj.__dataclass_fields__]
    else:
        return []
    for it in items:
        out.extend(_tensors(it, Tensor, depth + 1, limit))
        if len(out) >= limit:
            break
    return out[:limit]


def _pick_is_compiling(t: Any) -> Callable[[], bool]:
    comp = getattr(t, "compiler", None)
    fn = getattr(comp, "is_compiling", None) if comp is not None else None
    if fn is not None:
        return fn
    return lambda: False


# ----------------------------------------------------------------------------- module API
_tracker: PhaseTracker | None = None
_agent: Any = None
_pending_watch: list = []
_install_lock = threading.Lock()


def _torch_ready() -> Any:
    t = sys.modules.get("torch")
    if t is None:
        return None
    mm = sys.modules.get("torch.nn.modules.module")
    op = sys.modules.get("torch.optim.optimizer")
    if mm is None or op is None or not hasattr(op, "register_optimizer_step_post_hook") \
            or not hasattr(mm, "register_module_forward_hook") or not hasattr(t, "autograd"):
        return None
    return t


def _ensure_tracker() -> PhaseTracker | None:
    """Create and hook the tracker once torch is imported (called from cheap places)."""
    global _tracker
    if _tracker is not None:
        return _tracker
    agent = _agent
    if agent is None:
        return None
    t = _torch_ready()
    if t is None:
        return None
    with _install_lock:
        if _tracker is not None:
            return _tracker
        try:
            _tracker = _make_tracker(agent, t)
            for m, o in _pending_watch:
                _tracker.watch(m, o)
            _pending_watch.clear()
        except Exception as e:
            _log(f"install failed: {e!r}")
            return None
    return _tracker


def _make_tracker(agent: Any, t: Any) -> PhaseTracker:
    from gpumon.agent import core
    source = getattr(agent, "source", None)
    kind = getattr(source, "kind", "torch")

    def devices() -> list:
        if kind != "torch":
            return ["cpu"]  # simulated allocator figures: account the real (CPU) model only
        try:
            return [int(i) for i in source.device_indices()]
        except Exception:
            return []

    memory = CudaMemory(t) if kind == "torch" and hasattr(t._C, "_cuda_memoryStats") \
        else NoMemory()

    def nvml_used(dev: Any) -> int | None:
        # the torch source's latest NVML figure for this process (refreshed by the sampler)
        return getattr(source, "_nvml_proc", {}).get(dev)

    try:
        budget = float(os.environ.get("GPUMON_PHASES_BUDGET", PHASES_BUDGET))
    except ValueError:
        budget = PHASES_BUDGET
    tr = PhaseTracker(t, core.queue_event, devices, memory,
                      nvml_used=nvml_used, budget=budget)
    # a simulated source scripts its own phases for its scripted memory: keep them in samples
    tr.label_samples = kind == "torch"
    tr.install_hooks()
    return tr


def _sample_extra() -> dict:
    tr = _tracker if _tracker is not None else _ensure_tracker()
    if tr is None:
        return {}
    return tr.sample_extra()


def install(agent: Any) -> None:
    """Called by the core agent at start. Cheap when torch is not (yet) imported."""
    global _agent
    if os.environ.get("GPUMON_PHASES", "1") == "0":
        return
    from gpumon.agent import core
    _agent = agent
    core.register_sample_extra(_sample_extra)

    def status_cmd(args: dict, ctx: Any) -> dict:
        tr = _ensure_tracker()
        if tr is None:
            return {"installed": False, "reason": "torch is not imported in this process"}
        return tr.status()

    def breakdown_cmd(args: dict, ctx: Any) -> dict:
        tr = _ensure_tracker()
        if tr is None:
            raise core.CommandError("phases: torch is not imported in this process")
        return tr.breakdown_now()

    core.register_command("phases_status", status_cmd)
    core.register_command("phases_breakdown", breakdown_cmd, blocking=True)
    if _ensure_tracker() is None:
        # torch not imported yet (``gpumon run`` starts the agent first): hook once the source
        # is ready (torch imported, CUDA initialised), or at the first sample, mark or watch
        when_ready = getattr(agent, "when_ready", None)
        if when_ready is not None:
            when_ready(lambda _a: _ensure_tracker())


def uninstall() -> None:
    """Remove every hook (tests; gpumon.stop())."""
    global _tracker, _agent
    tr, _tracker, _agent = _tracker, None, None
    if tr is not None:
        tr.close()


def current() -> PhaseTracker | None:
    return _tracker if _tracker is not None else _ensure_tracker()


def mark(name: str) -> None:
    """Start a user phase ``name`` now; it lasts until the next forward/backward/optimizer
    step or mark. No-op without an agent."""
    try:
        tr = current()
        if tr is not None:
            tr.mark(str(name))
    except Exception as e:
        _log(f"mark: {e!r}")


@contextlib.contextmanager
def phase(name: str):
    """``with gpumon.phase("checkpoint"): ...``: everything inside is labelled ``name``."""
    tr = None
    try:
        tr = current()
        if tr is not None:
            tr.push(str(name))
    except Exception as e:
        tr = None
        _log(f"phase: {e!r}")
    try:
        yield
    finally:
        if tr is not None:
            try:
                tr.pop()
            except Exception as e:
                _log(f"phase exit: {e!r}")


def watch(model: Any = None, optimizer: Any = None) -> None:
    """Name the model(s) and optimizer(s) to account, instead of relying on discovery."""
    try:
        tr = current()
        if tr is None:
            _pending_watch.append((model, optimizer))
        else:
            tr.watch(model, optimizer)
    except Exception as e:
        _log(f"watch: {e!r}")


def recording_started() -> None:
    """For the snapshot part: call after starting ``_record_memory_history`` so the phase in
    progress gets its annotation range at once (later phases are annotated automatically)."""
    tr = _tracker
    if tr is not None:
        try:
            tr.recording_started()
        except Exception:
            pass
