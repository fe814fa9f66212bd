"""Training phases, exact per-step peaks and the memory breakdown by role, measured inside the
training process. The public entry: ``install`` (by the agent), ``mark``, ``phase``, ``watch``,
``current``, ``timeline`` (for snapshot sidecars), ``uninstall``.

Standard library only at import; torch is taken from ``sys.modules`` once the program has
imported it (the agent never imports torch itself). One job per module:

* hooks.py: finding the phases with torch's hooks (optimizer step, root module forward,
  backward start and end), no change to user code.
* tracker.py: steps and phases (labels, boundaries, step events, the cost budget).
* exact.py + replay.py: each measured step's exact peak, from torch's allocation history.
* roles.py: the role accounting and the ``breakdown`` payloads.
* memory.py: what is read of the allocator (counters, history); timeline.py: the recent steps
  and phases for snapshot sidecars.

Phases
------
``forward`` runs from the root forward's start to the start of its backward (it includes the
loss computed outside the model), ``backward`` is exactly the autograd pass, ``optimizer`` the
optimizer step(s), ``eval`` a root forward under ``no_grad``/``inference_mode``; everything else
(data loading, logging, gradient clipping, zero_grad) is ``other``. ``gpumon.mark(name)`` /
``with gpumon.phase(name):`` label it yourself (inside a ``gpumon.phase`` block the label is
yours even when forward/backward run inside it). A step ends with the optimizer step(s) that
follow its forward/backward passes (gradient accumulation = several forward/backward per step;
several optimizers stepping back to back = one step); the next step starts there (its first
phase is the ``other`` of zero_grad and data loading) and the step is reported when the next
forward returns (it closes at that forward's start; the event is built once the forward's
kernels are queued), or when a mark or optimizer step starts (or after a second of quiet).
torch.compile: an
OptimizedModule wrapper works; when optimizer steps happen with no forward seen (the model
called inside a compiled function, functional calls) the step says so in ``phases_note`` and
forward/backward are "unavailable": not guessed. Nothing of gpumon stays on the model between
its calls (hooks.py).

Exact peaks, without touching the program's figures
---------------------------------------------------
gpumon never calls ``reset_peak_memory_stats``. For each step it measures, the exact-peak meter
(exact.py) reads torch's allocation history for that step (a trace-only history it turns on
at the step boundary before, if none is on) and replays it: the step's peak is what
``max_memory_allocated()`` would have said had it been reset at the step's start (block sizes,
as torch counts them), in the phase where it was reached, with the persistent roles at that
moment. The replay is checked against torch's counters at every boundary; a step that fails a
check, or that the meter could not follow (no history: the cudaMallocAsync backend, a CPU
device), reports ``peak_exact: false``, the largest figure it saw (a lower bound), no phase,
and ``exact_note`` saying why. Exact without the replay too: a phase in which torch's
high-water mark rose holds the step's peak (the new mark).

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
     "peak": int|null,           # the step's peak allocated (exact, or a lower bound)
     "peak_phase": str|null,     # where it was reached; null unless peak_exact
     "peak_exact": bool, "peak_device": int|null,
     "exact_note": str|null,     # why the peak is not exact
     "devices": [{"index": int, "peak": int, "peak_phase": str|null, "peak_exact": bool,
                  "phase_peaks": {name: int}, "phase_peaks_exact": {name: bool},
                  "at_peak": {role: int|null}|null,   # the roles at the peak (exact steps)
                  "exact_note": str|null,
                  "start": int, "end": int}],          # allocated at step start / end
     "boundaries": [{"t": s since step start, "phase": entered phase, "allocated": [int|null]}],
                    # allocated in the order of "devices"; at most 64 per step
     "phases_note": str|null,                           # why phases are partial, if they are
     "measured_every": int,     # the replay (roles at the peak) runs for 1 in this many steps
     "replayed": bool,          # this step was replayed (at_peak roles from the replay)
     "tags": [str],             # the step's phases other than forward/backward/optimizer/other
     "spike": {...}|null,       # the spike finder's entry when the step stood out (spikes.py)
     "cost_us": int}            # gpumon's own time in this step

Cost: each boundary of a measured step reads the stats of every device (~15-25 us); an exact
step adds the history's cost (~0.3 us per allocator event while it is on), a read of the
allocator's segments when the step before was not measured, the history read and its replay
(~25 ms for a 1.5B model's 11k-event step; ~3 ms for a 24-layer MLP's 1.2k events) and a walk
of the roles' tensors. The tracker times itself and keeps its time under PHASES_BUDGET (0.1%,
``GPUMON_PHASES_BUDGET``; 0 = measure every step) of the program's wall time by measuring one
step in N (the first steps and the steps after the high-water mark rose unseen are always
measured). Unmeasured steps still label samples with their phase and count steps, and send no
event. A high-water mark set during an unmeasured step is reported with
``run_peak_phase``/``run_peak_step`` null.

``breakdown`` (at phase boundaries: every boundary of the first 3 steps, when a new peak was
set, when a client asked, otherwise at most once per second and never more than ~0.02% of wall
time: every ~20 s for a 1.5B model's ~4 ms walk)::

    {"step": int, "phase": str (the phase that just ended), "t": unix time, "cost_us": int,
     "tensors": int (tensors walked),
     "devices": [{"index": int|"cpu",
                  "now": {role: int|null}, "allocated": int|null, "reserved": int|null,
                  "at_peak": {role: int|null}|null,  # the last exact step's peak
                  "peak": int|null, "peak_phase": str|null, "peak_step": int|null,
                  "peak_exact": bool,                # true when peak is set
                  "run_peak": int|null, "run_peak_phase": str|null, "run_peak_step": int|null,
                  "at_run_peak": {role: int|null}|null,  # at the run's high-water mark
                  "retries": int|null}]}

Roles (roles.py): ``parameters``, ``gradients``, ``optimizer_state`` (walked on the training
thread, deduplicated by storage), ``activations`` = allocated - those, ``allocator_cache`` =
reserved - allocated, ``non_pytorch`` = NVML process used - reserved (null when the agent has no
NVML figure: clients compute it from the samples' ``proc_used``). ``at_peak`` counts the
persistent tensors alive at the step's peak moment (exact steps); ``at_run_peak`` those of the
step that set the run's high-water mark (exact when that step was, else the persistent roles at
the end of the phase where it was set).

Commands: ``phases_status`` -> state, roots, optimizers, recent steps, last breakdown;
``phases_breakdown`` {"wait": s (0-60)} -> a breakdown taken by the training thread at its next hook
(``fresh: true``), or after ``wait`` seconds (default 1) the last one it took (``fresh:
false``, ``age_s``); ``wait`` 0 returns the last one at once and asks nothing of the training
thread. Asked-for breakdowns are taken at most every 0.2 s (and <= ~0.5% of wall) for all
clients together. The agent's thread never reads a tensor of the program.

Snapshots: ``timeline(start_us, end_us)`` gives the steps and phases for a sidecar
(timeline.py). While the CUDA allocator records a history that is not the meter's, each phase
is wrapped in a ``torch.profiler.record_function`` range named ``gpumon.phase#<name>`` and each
step end is a zero-length ``gpumon.step#<n>`` range; they land in the snapshot's
``external_annotations`` when recording uses ``global_record_annotations=True``.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any

from gpumon.agent.phases.counters import PeakCounters
from gpumon.agent.phases.memory import CudaMemory, NoMemory, TorchHistory
from gpumon.agent.phases.roles import (PERSISTENT_ROLES, ROLES, account, derive_roles,
                                       optimizer_impl)
from gpumon.agent.phases.tracker import PHASES_BUDGET, PhaseTracker

__all__ = ["PhaseTracker", "CudaMemory", "NoMemory", "TorchHistory", "account", "derive_roles",
           "optimizer_impl", "ROLES", "PERSISTENT_ROLES", "AUTO_PHASES", "install", "uninstall",
           "current", "mark", "phase", "watch", "timeline", "recording_started"]

AUTO_PHASES = ("forward", "backward", "optimizer", "eval", "other")


def _log(msg: str) -> None:
    try:
        from gpumon.agent.log import get_logger  # the agent's own log, never stdout/stderr
        get_logger().info("phases: %s", msg)
    except Exception:
        pass


_tracker: PhaseTracker | None = None
_agent: Any = None
_pending_watch: list = []
_install_lock = threading.Lock()


def _torch_ready() -> Any:
    t = sys.modules.get("torch")
    if t is None or getattr(getattr(t, "__spec__", None), "_initializing", False):
        return None  # not imported, or still importing (the agent's thread may look meanwhile)
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

    cuda = kind == "torch" and hasattr(t._C, "_cuda_memoryStats")
    memory: Any = CudaMemory(t) if cuda else NoMemory()
    counters_note = None if cuda else "no CUDA allocator counters (a CPU device or a simulated " \
        "source)"
    if cuda and os.environ.get("GPUMON_STEP_PEAKS", "1") != "0" \
            and hasattr(t._C, "_cuda_resetPeakMemoryStats"):
        # installed at the first boundary on a CUDA device (counters.py: the program's view of
        # the peaks is kept)
        memory = PeakCounters(t._C, torch_mod=t)
    elif cuda:
        counters_note = "GPUMON_STEP_PEAKS=0: the peak counters are left alone" \
            if os.environ.get("GPUMON_STEP_PEAKS", "1") == "0" else \
            f"torch {t.__version__} cannot reset its peak counters"
    history = TorchHistory(t) if cuda and os.environ.get("GPUMON_EXACT", "1") != "0" else None

    def nvml_used(dev: Any) -> int | None:
        # the torch source's latest NVML figure for this process (refreshed by the sampler)
        return getattr(source, "_nvml_proc", {}).get(dev)

    try:
        budget = float(os.environ.get("GPUMON_PHASES_BUDGET", PHASES_BUDGET))
    except ValueError:
        budget = PHASES_BUDGET
    tr = PhaseTracker(t, core.queue_event, devices, memory,
                      nvml_used=nvml_used, budget=budget, history=history)
    tr.counters_note = counters_note
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
        # runs on an agent worker thread: it only asks; the training thread walks the tensors
        tr = _ensure_tracker()
        if tr is None:
            raise core.CommandError("phases: torch is not imported in this process")
        wait = (args or {}).get("wait", 1.0)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 60:
            raise core.CommandError("phases_breakdown: wait must be a number of seconds, 0-60")
        return tr.request_breakdown(float(wait))

    core.register_command("phases_status", status_cmd)
    # the training thread takes asked-for breakdowns at most every FORCED_MIN_INTERVAL_S for all
    # clients together, so a client may ask often (a TUI refreshing, a script polling)
    core.register_command("phases_breakdown", breakdown_cmd, blocking=True, max_rate=20)
    # the run's last step ends with its optimizer step and is closed at the next hook, which
    # never comes at the end of the run: close it (and drop the meter's history) at exit
    core.register_at_exit(uninstall)
    if _ensure_tracker() is None:
        # torch not imported yet (``gpumon run`` starts the agent first): hook once the source
        # is ready (torch imported, CUDA initialised), or at the first sample, mark or watch
        when_ready = getattr(agent, "when_ready", None)
        if when_ready is not None:
            when_ready(lambda _a: _ensure_tracker())


def uninstall() -> None:
    """Remove every hook, and the exact-peak meter's history if it is on (tests;
    gpumon.stop(); detach)."""
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
    """Name the model(s) and optimizer(s) to account (roots called are found anyway)."""
    try:
        tr = current()
        if tr is None:
            _pending_watch.append((model, optimizer))
        else:
            tr.watch(model, optimizer)
    except Exception as e:
        _log(f"watch: {e!r}")


def timeline(start_us: int | None = None, end_us: int | None = None) -> dict | None:
    """The steps and phases overlapping [start_us, end_us] (unix microseconds, the clock of
    snapshot trace entries) in the sidecar format of timeline.py; None without a tracker.
    Any thread: it reads only what the tracker recorded."""
    tr = _tracker
    if tr is None:
        return None
    try:
        return tr.timeline.export(start_us, end_us)
    except Exception as e:
        _log(f"timeline: {e!r}")
        return None


def recording_started() -> None:
    """For the snapshot part: call after starting ``_record_memory_history`` so the phase in
    progress gets its annotation range at once (later phases are annotated automatically)."""
    tr = _tracker
    if tr is not None:
        try:
            tr.recording_started()
        except Exception:
            pass
