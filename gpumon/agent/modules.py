"""Per-module memory, on demand: the next N training steps are measured module by module, then
every hook is gone. Runs inside the training process; standard library only at import, torch
from ``sys.modules``.

What is measured (one device: the CUDA device holding the most memory)
----------------------------------------------------------------------
For every module that ran (its path from the root module, as ``named_modules`` names it):
parameters, buffers, gradients and optimizer state (bytes of the tensors, each storage once,
walked on the training thread at each measured step's end), the activations its forward
allocated that are still live at the step's peak, what its backward allocated that is live at
the peak, the peak of its forward and of its backward above what was allocated when it began
(its transients), and what its forward left allocated when it returned (``fwd_retained``, the
figure torch's MemTracker shows as the module's activations). The step's peak is split so the
parts add up to the allocated bytes at that moment: the modules' parts, what was allocated
outside any module (the loss, autograd's own buffers), optimizer step temporaries, memory that
was live before the step began, and allocator rounding (block sizes above the requested bytes).
The module stack running at the peak (forward or backward) is named.

How (exact, cheap): the CUDA caching allocator's own allocation history (trace only, no stacks:
~0.3 us per allocation, gpumon/agent/phases/exact.py) is on during the measured steps, and
global module hooks (``register_module_forward_pre_hook``/``register_module_forward_hook``)
pin every module's enter and leave to a place in it with torch's cumulative allocation
counters. Backward enter/leave come from multi-grad hooks on the tensors of that step (module
outputs and inputs, as torch's ModTracker does): they live on autograd's graph of the measured
step only, never on a module. The history is replayed through gpumon's model of the allocator
(phases/replay.py), which gives every allocation its block size, so the parts sum to
``memory_allocated()`` at the peak to the byte. Where there is no allocation history (a CPU
device, the simulated source, the cudaMallocAsync backend) only the persistent parts
(parameters, gradients, optimizer state) are measured, and the result says so.

Invisible to the program: nothing is put on the user's modules or optimizers; the global hooks
exist from the first measured step to the last; a compiled module (``torch.compile``'s
OptimizedModule) is measured as one unit (its submodules run inside the compiled graph, where
hooks would either not run or split the graph: the hooks return at once while dynamo traces and
inside a compiled module), and the result lists such modules in ``compiled``.

Commands
--------
``modules_measure`` {"steps": N (1-16, default 1), "wait": s (0-600, default 120)} measures the
next N steps (after BASELINE_STEPS steps timed before them, and followed by one step timed
after them) and
answers the result, or ``{"state": "measuring", ...}`` if it is not done within ``wait`` (it
goes on; the result comes as an event and from ``modules_result``). One measurement at a time.
``modules_result`` -> the last result (or ``{"state": ...}``). ``modules_cancel`` stops one in
progress (its hooks are removed at the training thread's next hook).

Event ``modules`` (and the result)::

    {"ok": bool, "error": str|null, "t": unix time, "device": int|"cpu",
     "steps": N, "exact": bool,    # false: no allocation history, persistent parts only
     "note": str|null,
     "peak": int|null,             # allocated (block bytes) at the peak of the measured steps
     "peak_step": int|null,        # which measured step (1-based)
     "peak_phase": "forward"|"backward"|"optimizer"|"other"|null,
     "peak_stack": [path, ...],    # modules running at the peak, outermost first
     "at_peak": {part: bytes},     # PEAK_PARTS; sums to peak
     "modules": [{"path": str, "type": str, "calls": int,
                  "params": int, "buffers": int, "grads": int, "optimizer_state": int,
                  "act_at_peak": int, "bwd_at_peak": int,          # own (not children's)
                  "fwd_retained": int|null, "fwd_transient": int|null,
                  "bwd_transient": int|null}],                     # include children
     "compiled": [path, ...],      # measured as one unit (torch.compile)
     "step_time_s": {"before": float|null, "measured": [float], "after": float|null},
     "cost": {"hook_calls": int, "entries": int, "analysis_s": float}}

``path`` is "" for the root module (its class in ``type``); a second root is named by its
class. Activations and transients are requested bytes rounded up to 512 (what the program's
tensors hold); the difference to the blocks the allocator handed out is ``at_peak.rounding``.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from typing import Any, Callable

from gpumon.agent import history as H

MAX_STEPS = 16
DEFAULT_STEPS = 1
MAX_WAIT_S = 600.0
DEFAULT_WAIT_S = 120.0
BASELINE_STEPS = 2       # steps timed before the measured ones
MAX_MODULES = 5000       # modules reported (largest first beyond that)
MAX_MARKS = 2_000_000    # hook marks kept per measurement (a bound, never reached by a model)

PEAK_PARTS = ("parameters", "buffers", "gradients", "optimizer_state", "activations",
              "backward", "outside_forward", "outside_backward", "optimizer_temporaries",
              "other", "before_step", "rounding")
# parameters .. optimizer_state: the persistent tensors (their bytes); activations: what module
# forwards allocated; backward: what module backwards allocated (gradients of activations,
# recomputation); outside_forward/backward: allocated in forward/backward by no module (the
# loss, autograd's accumulation buffers); optimizer_temporaries: allocated inside the optimizer
# step and not its state; other: allocated between steps (data, zero_grad); before_step: live
# when the measured steps began and none of the above (the batch, tensors the program holds);
# rounding: block bytes above the requested bytes.


def _log(msg: str) -> None:
    try:
        from gpumon.agent.log import get_logger  # the agent's own log, never stdout/stderr
        get_logger().info("modules: %s", msg)
    except Exception:
        pass


class _Names:
    """Module -> path, built from the roots' ``named_modules`` (weakly keyed)."""

    def __init__(self, optimized_cls: Any) -> None:
        self._paths: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
        self._by_id: dict[int, str] = {}
        self.roots: list = []           # weakrefs
        self._root_names: set[str] = set()
        self._optimized = optimized_cls
        self.compiled: list[str] = []

    def path(self, module: Any, root: bool) -> str:
        try:
            p = self._paths.get(module)
        except TypeError:
            p = self._by_id.get(id(module))
        if p is not None:
            return p
        if not root:
            p = type(module).__name__
            self._set(module, p)
            return p
        # a new root: the first is "", later ones are named by their class
        name = "" if not self.roots else type(module).__name__
        while name in self._root_names:
            name = name + "#"
        self._root_names.add(name)
        self.roots.append(weakref.ref(module))
        for sp, sub in module.named_modules():
            if sp.startswith("_orig_mod"):  # torch.compile's wrapper: name the inner tree
                sp = sp[len("_orig_mod"):].lstrip(".")
            full = ".".join(x for x in (name, sp) if x)
            if sub is module or self._get(sub) is None:
                self._set(sub, full)
        if self._optimized is not None and isinstance(module, self._optimized):
            self.compiled.append(name)
        return name

    def _get(self, m: Any) -> str | None:
        try:
            return self._paths.get(m)
        except TypeError:
            return self._by_id.get(id(m))

    def _set(self, m: Any, p: str) -> None:
        try:
            self._paths[m] = p
        except TypeError:
            self._by_id[id(m)] = p

    def walk(self):
        """(path, module) of every module under the roots, each once."""
        seen = set()
        for ref in self.roots:
            r = ref()
            if r is None:
                continue
            for _, sub in r.named_modules():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                p = self._get(sub)
                if p is not None:
                    yield p, sub


class _ModuleHooks:
    """What the measurement and the snapshot annotations share: torch's global module forward
    hooks (keyword inputs included), the module path of each call, and backward enter/leave
    from multi-grad hooks on the call's output and input tensors (they belong to that step's
    autograd graph, never to a module), and the end of each backward pass. Subclasses
    implement ``_entered``, ``_left``, ``_backward(enter, path)`` and ``_pass_end``."""

    def __init__(self, torch_mod: Any) -> None:
        self.torch = torch_mod
        ev = getattr(getattr(torch_mod, "_dynamo", None), "eval_frame", None)
        self._optimized = getattr(ev, "OptimizedModule", None)
        self._in_optimized = getattr(ev, "_is_in_optimized_module", None) or (lambda: False)
        comp = getattr(torch_mod, "compiler", None)
        self._compiling = getattr(comp, "is_compiling", None) or (lambda: False)
        self._task = getattr(torch_mod._C, "_current_graph_task_id", None)
        self.names = _Names(self._optimized)
        self._tls = threading.local()
        self._mod_handles: list = []
        self._bw_task: Any = None

    def _install_module_hooks(self) -> None:
        mm = sys.modules["torch.nn.modules.module"]
        self._mod_handles.append(mm.register_module_forward_pre_hook(self._fw_pre))
        try:  # with the keyword arguments: HF modules take their inputs by keyword
            h = mm.register_module_forward_hook(self._fw_post_kw, always_call=True,
                                                with_kwargs=True)
        except TypeError:  # torch < 2.1
            h = mm.register_module_forward_hook(self._fw_post)
        self._mod_handles.append(h)
        from gpumon.agent.phases import hooks as ph  # (a compiled module counts once)
        ph.OTHER_HOOK_IDS.update(x.id for x in self._mod_handles)
        if not getattr(self, "_holds_check", False):
            ph.hold_hook_check(mm)
            self._holds_check = True

    def _remove_module_hooks(self) -> None:
        """Any thread: torch copies the global module hook tables before calling them."""
        hs, self._mod_handles = self._mod_handles, []
        mm = sys.modules.get("torch.nn.modules.module")
        from gpumon.agent.phases import hooks as ph
        for h in hs:
            ph.OTHER_HOOK_IDS.discard(h.id)
            try:
                h.remove()
                # torch's handle does not remove a with_kwargs hook's flag: left there, it
                # keeps _has_any_global_hook() true, so every module call of the program
                # would take the slow path (and a compiled module warn) for ever after
                getattr(mm, "_global_forward_hooks_with_kwargs", {}).pop(h.id, None)
            except Exception:
                pass
        if getattr(self, "_holds_check", False) and mm is not None:
            ph.release_hook_check(mm)
            self._holds_check = False

    def _skip(self, module: Any) -> bool:
        if self._compiling():
            return True
        if self._in_optimized():
            # inside a compiled module: only the compiled module itself is seen
            return self._optimized is None or not isinstance(module, self._optimized)
        return False

    def _in_bw(self) -> bool:
        try:
            return self._task is not None and self._task() != -1
        except Exception:
            return False

    def _fw_pre(self, module: Any, args: Any) -> None:
        if self._skip(module):
            return
        try:
            depth = getattr(self._tls, "depth", 0)
            self._tls.depth = depth + 1
            bw = self._in_bw()  # recomputation inside backward (activation checkpointing)
            path = self.names.path(module, root=depth == 0 and not bw)
            self._entered(module, path, depth, bw)
        except Exception as e:
            self._failed(e)

    def _fw_post_kw(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        self._fw_post(module, (args, kwargs), output)

    def _fw_post(self, module: Any, args: Any, output: Any) -> None:
        if self._skip(module):
            return
        try:
            self._tls.depth = max(0, getattr(self._tls, "depth", 1) - 1)
            path = self.names.path(module, root=False)
            bw = self._in_bw()
            if not self._left(path, bw):
                return
            if not bw and self.torch.is_grad_enabled():
                outs = _grad_tensors(output, self.torch.Tensor)
                if outs:  # its backward starts when the first output gradient comes ...
                    self._on_grads(outs, True, path, "any")
                    ins = _grad_tensors(args, self.torch.Tensor)
                    if ins:  # ... and ends when its inputs' gradients are all done
                        self._on_grads(ins, False, path, "all")
        except Exception as e:
            self._failed(e)

    def _on_grads(self, tensors: list, enter: bool, path: str, mode: str) -> None:
        me = weakref.ref(self)

        def hook(_grads: Any, me: Any = me) -> None:
            h = me()
            if h is None:
                return
            try:
                if h._backward(enter, path) and enter:
                    h._queue_pass_end()
            except Exception as e:
                h._failed(e)
        self.torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode=mode)

    def _queue_pass_end(self) -> None:
        """Once per backward pass: ``_pass_end`` when it ends (a module whose inputs need no
        gradient never sees its own backward end otherwise)."""
        tid = self._task() if self._task is not None else None
        if self._bw_task == tid:
            return
        self._bw_task = tid
        me = weakref.ref(self)

        def ended(me: Any = me) -> None:
            h = me()
            if h is not None:
                h._bw_task = None
                try:
                    h._pass_end()
                except Exception as e:
                    h._failed(e)
        self.torch.autograd.Variable._execution_engine.queue_callback(ended)

    # subclasses
    def _entered(self, module: Any, path: str, depth: int, bw: bool) -> None: ...
    def _left(self, path: str, bw: bool) -> bool: ...
    def _backward(self, enter: bool, path: str) -> bool: ...
    def _pass_end(self) -> None: ...
    def _failed(self, e: BaseException) -> None:
        _log(f"module hook: {e!r}")


class Measurement(_ModuleHooks):
    """One on-demand measurement (training-thread state machine driven by the global
    optimizer step hooks it registers; see the module docstring).

    ``memory.read(dev)`` and ``history`` are phases/memory.py's CudaMemory and TorchHistory
    (or fakes with their methods); ``devices()`` the devices in use; ``history`` None: no
    allocation history (persistent parts only)."""

    def __init__(self, torch_mod: Any, steps: int, devices: Callable[[], list], memory: Any,
                 history: Any, done: Callable[[dict], None],
                 clock: Callable[[], float] = time.perf_counter,
                 tensor_device: str = "cuda") -> None:
        super().__init__(torch_mod)
        self.tensor_device = tensor_device  # the device type the measured device's tensors have
        self.steps = steps
        self._devices = devices
        self.memory = memory
        self.history = history
        self._done = done
        self._clock = clock
        self.state = "waiting"        # waiting -> baseline -> measuring -> after -> done
        self.cancelled = False
        self._lock = threading.RLock()
        self._opt_handles: list = []
        self._reaper: Any = None      # a one-shot module pre-hook that removes _opt_handles
        self._in_opt_hook = False     # inside torch's iteration of the optimizer hooks
        self._opt_depth = 0
        self._t_prev: float | None = None
        self._before: float | None = None
        self._baseline_done = 0
        self._measured: list[float] = []
        self.dev: Any = None
        self.marks: list = []         # (counts, event)
        self.walks: list = []         # per step end: {addr: [(role, path, bytes)]}, persistent
        self.persist: dict = {}       # path -> {params, buffers, grads, optimizer_state}
        self.hook_calls = 0
        self._forwards_since_end = 0
        self._steps_done = 0
        self._optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._ours = False            # the allocation history is ours to stop
        self._model = None            # replay.AllocatorModel at the measurement's start
        self._base = None             # counters at that state
        self._note: str | None = None
        self._calls: dict[str, int] = {}
        self._types: dict[str, str] = {}
        self.result: dict | None = None

    # ------------------------------------------------------------------ arming
    def arm(self) -> None:
        """Any thread: the global optimizer step hooks that drive the measurement."""
        opt = sys.modules["torch.optim.optimizer"]
        self._opt_handles = [opt.register_optimizer_step_pre_hook(self._opt_pre),
                             opt.register_optimizer_step_post_hook(self._opt_post)]

    def remove_all(self) -> None:
        """Every hook goes. Module hooks at once (torch copies that dict before calling its
        hooks). The optimizer hooks not while torch iterates them (it does so over the live
        dict: removing one from inside an optimizer hook raises "OrderedDict mutated during
        iteration" in the program): then a one-shot module pre-hook removes them (and itself)
        at the next module call, and until then they do nothing."""
        self._remove_module_hooks()
        if not self._opt_handles:
            return
        if not self._in_opt_hook:
            self._remove_opt_hooks()
            return
        if self._reaper is None:
            mm = sys.modules["torch.nn.modules.module"]
            self._reaper = mm.register_module_forward_pre_hook(self._reap)
            from gpumon.agent.phases import hooks as ph  # (a compiled module counts once)
            ph.OTHER_HOOK_IDS.add(self._reaper.id)
            ph.hold_hook_check(mm)

    def _remove_opt_hooks(self) -> None:
        for h in self._opt_handles:
            try:
                h.remove()
            except Exception:
                pass
        self._opt_handles = []

    def _reap(self, module: Any, args: Any) -> None:
        if self._compiling():
            return
        try:
            self._remove_opt_hooks()
            r, self._reaper = self._reaper, None
            if r is not None:
                r.remove()
                from gpumon.agent.phases import hooks as ph
                ph.OTHER_HOOK_IDS.discard(r.id)
                ph.release_hook_check(sys.modules["torch.nn.modules.module"])
        except Exception as e:
            _log(f"removing hooks: {e!r}")

    # ------------------------------------------------------------------ optimizer hooks
    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._compiling() or self.state == "done":
            return
        try:
            with self._lock:
                self._in_opt_hook = True
                self._opt_depth += 1
                if self.cancelled:
                    self._finish_error("cancelled")
                elif self.state == "measuring" and self._opt_depth == 1:
                    self._optimizers.add(optimizer)
                    self._mark(("opt", 1))
        except Exception as e:
            self._fail(e)
        finally:
            self._in_opt_hook = False

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._compiling() or self.state == "done":
            return
        try:
            with self._lock:
                self._in_opt_hook = True
                self._opt_depth = max(0, self._opt_depth - 1)
                if self._opt_depth:
                    return
                self._step_end()
        except Exception as e:
            self._fail(e)
        finally:
            self._in_opt_hook = False

    def _step_end(self) -> None:
        now = self._clock()
        st = self.state
        if self.cancelled:
            self._finish_error("cancelled")
            return
        if st == "waiting":
            self._t_prev, self.state = now, "baseline"
        elif st == "baseline":
            # the fastest of BASELINE_STEPS steps: the first after a client connects also
            # pays for the history the agent sends it
            b = now - self._t_prev
            self._before = b if self._before is None else min(self._before, b)
            self._t_prev = now
            self._baseline_done += 1
            if self._baseline_done >= BASELINE_STEPS:
                self._begin()
        elif st == "measuring":
            if self._forwards_since_end == 0 and self._steps_done > 0:
                self._mark(("opt", 0))  # a second optimizer stepping in the same step
                return
            self._forwards_since_end = 0
            self._measured.append(now - self._t_prev)
            self._t_prev = now
            self._steps_done += 1
            self._mark(("opt", 0))
            self._mark(("end", self._steps_done))
            self.walks.append(self._walk())
            if self._steps_done >= self.steps:
                self._end()
                self._t_prev = self._clock()  # the analysis is not the next step's time
        elif st == "after":
            after = now - self._t_prev
            self.remove_all()
            self.state = "done"
            res = self.result or {}
            res.setdefault("step_time_s", {})["after"] = after
            self._done(res)

    # ------------------------------------------------------------------ measuring
    def _begin(self) -> None:
        devs = [d for d in self._devices() if isinstance(d, int)]
        reads = {}
        for d in devs:
            try:
                reads[d] = self.memory.read(d)
            except Exception:
                reads[d] = None
        live = [d for d in devs if reads.get(d)]
        self.dev = max(live, key=lambda d: reads[d][0]) if live else (
            self._devices()[0] if self._devices() else "cpu")
        if self.history is None or not isinstance(self.dev, int):
            self._note = "no allocation history on this device: parameters, gradients and " \
                         "optimizer state only"
        else:
            self._start_history()
        self._install_module_hooks()
        self.state = "measuring"
        self._mark(("end", 0))

    def _start_history(self) -> None:
        from gpumon.agent.phases.replay import AllocatorModel
        h = self.history
        try:
            why = h.unavailable()
            if why:
                self._note = why + ": parameters, gradients and optimizer state only"
                return
            with H.LOCK:
                if not h.is_on():
                    h.start()
                    self._ours = True
                    H.set_temporary(self)
                elif H.temporary():
                    # the exact-peak meter's trace-only history: ours until we are done, so
                    # it is not stopped or cleared under us (the meter reads it as it is)
                    H.take_over()
                    self._ours = True
                    H.set_temporary(self)
            for _ in range(3):
                r0 = self.memory.read(self.dev)
                snap = h.snapshot(False)
                r1 = self.memory.read(self.dev)
                if r0 is not None and r1 is not None and tuple(r0[4:6]) == tuple(r1[4:6]):
                    break
            else:
                raise RuntimeError("allocations on another thread while the allocator's state "
                                   "was read")
            if len(r1) < 6:
                raise RuntimeError("torch's counters lack the allocation counts")
            m = AllocatorModel(snap.get("segments") or [], snap.get("allocator_settings"),
                               device=self.dev)
            if m.allocated != r1[0]:
                raise RuntimeError("the allocator's state disagrees with its counters")
            self._model, self._base = m, (int(r1[4]), int(r1[5]))
        except Exception as e:
            self._note = f"the allocation history could not be used ({_line(e)}): " \
                         "parameters, gradients and optimizer state only"
            self._model = None
            self._stop_history()

    def handed_over(self) -> None:
        """history.take_over(): a recording took our history over; it is theirs to stop."""
        self._ours = False

    def _stop_history(self) -> None:
        with H.LOCK:
            if self._ours:
                self._ours = False
                H.set_temporary(None)
                try:
                    self.history.stop()
                except Exception:
                    pass

    def _counts(self) -> tuple | None:
        if self._model is None:
            return None
        r = self.memory.read(self.dev)
        return (int(r[4]), int(r[5])) if r is not None and len(r) > 5 else None

    def _mark(self, event: tuple) -> None:
        self.hook_calls += 1
        if len(self.marks) < MAX_MARKS:
            self.marks.append((self._counts(), event))

    def _entered(self, module: Any, path: str, depth: int, bw: bool) -> None:
        with self._lock:
            if self.state != "measuring":
                return
            self._types.setdefault(path, type(module).__name__)
            if depth == 0 and not bw:
                self._forwards_since_end += 1
            if not bw:
                self._calls[path] = self._calls.get(path, 0) + 1
            self._mark(("fwd", 1, path, bw))

    def _left(self, path: str, bw: bool) -> bool:
        with self._lock:
            if self.state != "measuring":
                return False
            self._mark(("fwd", 0, path, bw))
            return True

    def _backward(self, enter: bool, path: str) -> bool:
        with self._lock:
            if self.state != "measuring":
                return False
            self._mark(("bwd", 1 if enter else 0, path))
            return True

    def _pass_end(self) -> None:
        with self._lock:
            if self.state == "measuring":
                self._mark(("bwend",))

    def _failed(self, e: BaseException) -> None:
        self._fail(e)

    # ------------------------------------------------------------------ the persistent parts
    def _walk(self) -> dict:
        """Training thread, at a step's end: parameters, buffers, gradients and optimizer
        state per module (bytes), and their storages by address for the peak's attribution."""
        Tensor = self.torch.Tensor
        dev = self.dev
        seen: set = set()
        by_addr: dict = {}
        persist: dict = {}
        owner: dict = {}

        def add(role: str, path: str, t: Any) -> None:
            if not isinstance(t, Tensor):
                return
            try:
                if isinstance(dev, int) and (t.device.type != self.tensor_device or (
                        t.device.index is not None and t.device.index != dev)):
                    return
                st = t.untyped_storage()
                addr = st.data_ptr()
                nbytes = t.numel() * t.element_size()
            except Exception:
                return  # a tensor without storage (meta, some subclasses)
            key = (addr, t.storage_offset(), nbytes, role)
            if key in seen or nbytes == 0:
                return
            seen.add(key)
            persist.setdefault(path, {}).setdefault(role, 0)
            persist[path][role] += nbytes
            by_addr.setdefault(addr, []).append((role, path, nbytes))

        for path, m in self.names.walk():
            for p in m._parameters.values():
                if p is None:
                    continue
                owner.setdefault(id(p), path)
                add("parameters", path, p)
                add("gradients", path, p.grad)
            for b in m._buffers.values():
                add("buffers", path, b)
        for o in list(self._optimizers):
            for group in getattr(o, "param_groups", ()):
                for p in group.get("params", ()):
                    path = owner.get(id(p), "(no module)")
                    if path == "(no module)":
                        add("parameters", path, p)
                        add("gradients", path, getattr(p, "grad", None))
                    state = o.state.get(p) if hasattr(o, "state") else None
                    if isinstance(state, dict):
                        for v in state.values():
                            add("optimizer_state", path, v)
        self.persist = persist
        return by_addr

    # ------------------------------------------------------------------ the end
    def _end(self) -> None:
        t0 = self._clock()
        self._remove_module_hooks()
        snap = None
        if self._model is not None:
            try:
                for _ in range(3):  # no allocation on another thread between the reads
                    c0 = self._counts()
                    snap = self.history.snapshot(True)
                    self.end_counts = self._counts()
                    if c0 == self.end_counts:
                        break
                else:
                    raise RuntimeError("allocations on another thread while the history "
                                       "was read")
            except Exception as e:
                self._note = f"the allocation history could not be read: {_line(e)}"
        self._stop_history()
        from gpumon.agent.modules_analysis import analyse
        try:
            res = analyse(self, snap)
        except Exception as e:
            _log(f"analysis failed: {e!r}")
            res = _result_error(f"analysis failed: {_line(e)}")
        res["cost"] = {"hook_calls": self.hook_calls, "entries": res.pop("_entries", 0),
                       "analysis_s": round(self._clock() - t0, 6)}
        res["step_time_s"] = {"before": self._before, "measured": list(self._measured),
                              "after": None}
        self.result = res
        self.marks, self.walks, self._model = [], [], None
        self.state = "after"

    def _finish_error(self, why: str) -> None:
        self.remove_all()
        self._stop_history()
        self.marks, self.walks, self._model = [], [], None
        self.state = "done"
        self.result = _result_error(why)
        self._done(self.result)

    def _fail(self, e: BaseException) -> None:
        _log(f"hook failed: {e!r}")
        try:
            self._finish_error(f"measurement failed: {_line(e)}")
        except Exception:
            pass

    def close(self) -> None:
        """Remove everything now (agent exit; gpumon.stop), also what a finished measurement
        left for its reaper."""
        with self._lock:
            if self.state != "done":
                self._finish_error("the agent stopped")
            self._in_opt_hook = False
            self.remove_all()
            r, self._reaper = self._reaper, None
            if r is not None:
                r.remove()
                from gpumon.agent.phases import hooks as ph
                ph.OTHER_HOOK_IDS.discard(r.id)
                ph.release_hook_check(sys.modules["torch.nn.modules.module"])


def _grad_tensors(obj: Any, Tensor: type, depth: int = 0) -> list:
    out: list = []
    if isinstance(obj, Tensor):
        if obj.requires_grad:
            out.append(obj)
        return out
    if depth > 3 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return out
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif hasattr(obj, "__dataclass_fields__"):
        items = [getattr(obj, f, None) for f in obj.__dataclass_fields__]
    else:
        return out
    for it in items:
        out.extend(_grad_tensors(it, Tensor, depth + 1))
        if len(out) >= 64:
            break
    return out


def _result_error(why: str) -> dict:
    return {"ok": False, "error": why, "t": time.time()}


def _line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


# ---------------------------------------------------------------------- the agent's side
_lock = threading.Lock()
_current: Measurement | None = None
_last: dict | None = None
_agent: Any = None
_cond = threading.Condition()


def _torch() -> Any:
    t = sys.modules.get("torch")
    if t is None or "torch.optim.optimizer" not in sys.modules \
            or "torch.nn.modules.module" not in sys.modules:
        return None
    return t


def start(steps: int, done: Callable[[dict], None] | None = None, torch_mod: Any = None,
          devices: Callable[[], list] | None = None, memory: Any = None,
          history: Any = "auto", tensor_device: str = "cuda") -> Measurement:
    """Arm a measurement of the next ``steps`` steps (any thread). Raises RuntimeError when
    one is in progress or torch is not imported."""
    global _current
    t = torch_mod or _torch()
    if t is None:
        raise RuntimeError("torch is not imported in this process")
    with _lock:
        if _current is not None and _current.state != "done" and not _current.cancelled:
            raise RuntimeError("a per-module measurement is already in progress")
        # (a cancelled one ends itself at the training thread's next hook; its hooks do
        # nothing until then)
        if devices is None or memory is None or history == "auto":
            d, m, h = _sources(t)
            devices = devices or d
            memory = memory if memory is not None else m
            history = h if history == "auto" else history

        def finished(res: dict) -> None:
            global _last
            with _cond:
                _last = res
                _cond.notify_all()
            if done is not None:
                done(res)
        meas = Measurement(t, steps, devices, memory, history, finished,
                           tensor_device=tensor_device)
        meas.arm()
        _current = meas
        return meas


def _sources(t: Any) -> tuple:
    from gpumon.agent.phases.memory import CudaMemory, NoMemory, TorchHistory
    source = getattr(_agent, "source", None)
    kind = getattr(source, "kind", "torch")
    cuda = kind == "torch" and hasattr(t._C, "_cuda_memoryStats")

    def devices() -> list:
        if not cuda:
            return ["cpu"]
        try:
            return [int(i) for i in source.device_indices()]
        except Exception:
            return []
    return devices, (CudaMemory(t) if cuda else NoMemory()), (TorchHistory(t) if cuda else None)


def status() -> dict:
    m = _current
    if m is None or m.state == "done":
        return {"state": "idle", "last": _last}
    return {"state": m.state, "steps": m.steps, "steps_done": m._steps_done, "last": _last}


def cancel() -> bool:
    m = _current
    if m is None or m.state == "done":
        return False
    # the training thread ends it at its next hook: hooks are never removed from this thread
    # while that one may be iterating them
    m.cancelled = True
    return True


def measure_args(args: Any) -> tuple[int, float]:
    """modules_measure's arguments (any client's: checked), or ValueError in one line."""
    args = args if isinstance(args, dict) else {}
    steps = args.get("steps", DEFAULT_STEPS)
    wait = args.get("wait", DEFAULT_WAIT_S)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be an integer, 1-{MAX_STEPS}")
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_WAIT_S:
        raise ValueError(f"wait must be a number of seconds, 0-{MAX_WAIT_S:g}")
    return steps, float(wait)


def install(agent: Any) -> None:
    global _agent
    from gpumon.agent import core
    _agent = agent

    def measure_cmd(args: dict, ctx: Any) -> dict:
        try:
            steps, wait = measure_args(args)
        except ValueError as e:
            raise core.CommandError(f"modules_measure: {e}") from None
        try:
            m = start(steps, done=lambda res: core.broadcast_event("modules", **res))
        except RuntimeError as e:
            raise core.CommandError(f"modules_measure: {e}") from None
        deadline = time.monotonic() + float(wait)
        with _cond:
            while m.state != "done":
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"state": m.state, "steps": steps, "steps_done": m._steps_done}
                _cond.wait(min(left, 0.5))
        return dict(m.result or {})

    def result_cmd(args: dict, ctx: Any) -> dict:
        return status()

    def cancel_cmd(args: dict, ctx: Any) -> dict:
        return {"cancelled": cancel()}

    core.register_command("modules_measure", measure_cmd, blocking=True, max_rate=2)
    core.register_command("modules_result", result_cmd)
    core.register_command("modules_cancel", cancel_cmd)
    core.register_at_exit(uninstall)


def uninstall() -> None:
    m = _current
    if m is not None:
        try:
            m.close()
        except Exception:
            pass
    annotate_stop()


# ---------------------------------------------------------------------- snapshot annotations
# While gpumon records a snapshot, module enter/leave (forward and backward) are written into
# the snapshot's sidecar (``modules``), so ``gpumon view`` can say which module made every
# allocation. Each event carries the trace's clock (unix microseconds, as the trace's
# ``time_us``) and torch's cumulative allocation counters of the recorded device, which pin it
# between two trace entries exactly (gpumon/snapshot/modules.py). Sidecar format::
#
#     "modules": {"format": 2, "clock": "time_us", "device": int|null,
#                 "paths": [str], "types": [str],         # path index -> path, class name
#                 "compiled": [path],
#                 "events": "t,a,f,code,path;...",        # one event per ';'
#                 "truncated": bool}     # the oldest events were dropped (MAX_ANNOTATIONS)
#
# ``events`` is one string (compact whatever the sidecar's indentation, and small: the sidecar
# reader takes at most 16 MiB): per event the time (us), torch's allocation and free counters
# (empty when unknown), the code and the path index; time and counters are differences from
# the event before (the first is absolute).
# code: 0 forward enter, 1 forward leave, 2 backward enter, 3 backward leave, 4 the end of a
# backward pass (path index -1). Recomputation in backward (activation checkpointing) is a
# forward inside a backward.
MAX_ANNOTATIONS = 300_000  # ~15 bytes each in the sidecar
FWD_ENTER, FWD_LEAVE, BWD_ENTER, BWD_LEAVE, BWD_END = range(5)


class Annotator(_ModuleHooks):
    """Module enter/leave for a snapshot recording, into a bounded array (installed and
    removed from any thread: torch copies the global module hook tables before calling them)."""

    def __init__(self, torch_mod: Any, device: Any, memory: Any) -> None:
        from array import array
        super().__init__(torch_mod)
        self.device = device
        self.memory = memory
        self.on = False
        self.ev = array("q")
        self.truncated = False
        self._index: dict[str, int] = {}
        self.paths: list[str] = []
        self.types: list[str] = []

    def start(self) -> None:
        self.on = True
        self._install_module_hooks()

    def stop(self) -> None:
        self.on = False
        self._remove_module_hooks()

    def _log_event(self, code: int, path: str | None) -> None:
        pi = -1
        if path is not None:
            pi = self._index.get(path, -1)
            if pi < 0:
                pi = self._index[path] = len(self.paths)
                self.paths.append(path)
                self.types.append("")
        c = None
        if self.memory is not None and isinstance(self.device, int):
            try:
                r = self.memory.read(self.device)
                c = (int(r[4]), int(r[5])) if r is not None and len(r) > 5 else None
            except Exception:
                c = None
        t_us = time.time_ns() // 1000
        ev = self.ev
        if len(ev) >= 5 * MAX_ANNOTATIONS:
            del ev[:5 * (MAX_ANNOTATIONS // 10)]  # drop the oldest tenth at once
            self.truncated = True
        ev.extend((t_us, -1 if c is None else c[0], -1 if c is None else c[1], code, pi))

    def _entered(self, module: Any, path: str, depth: int, bw: bool) -> None:
        if self.on:
            self._log_event(FWD_ENTER, path)
            i = self._index[path]
            if not self.types[i]:
                self.types[i] = type(module).__name__

    def _left(self, path: str, bw: bool) -> bool:
        if self.on:
            self._log_event(FWD_LEAVE, path)
        return self.on

    def _backward(self, enter: bool, path: str) -> bool:
        if self.on:
            self._log_event(BWD_ENTER if enter else BWD_LEAVE, path)
        return self.on

    def _pass_end(self) -> None:
        if self.on:
            self._log_event(BWD_END, None)

    def export(self, first_us: int | None = None, last_us: int | None = None) -> dict:
        ev = self.ev
        lo = (first_us - 1000) if first_us is not None else None
        hi = (last_us + 1000) if last_us is not None else None
        out = []
        pt = pa = pf = 0
        for i in range(0, len(ev), 5):
            t, a, f, code, pi = ev[i:i + 5]
            if (lo is not None and t < lo) or (hi is not None and t > hi):
                continue
            if a < 0:
                ac = fc = ""
            else:
                ac, fc = str(a - pa), str(f - pf)
                pa, pf = a, f
            out.append(f"{t - pt},{ac},{fc},{code},{pi}")
            pt = t
        return {"format": 2, "clock": "time_us",
                "device": self.device if isinstance(self.device, int) else None,
                "paths": list(self.paths), "types": list(self.types),
                "compiled": list(self.names.compiled), "events": ";".join(out),
                "truncated": self.truncated}


_annotator: Annotator | None = None


def annotate_start() -> None:
    """The snapshot part starts a recording: log module enter/leave until annotate_stop.
    Never raises."""
    global _annotator
    try:
        t = _torch()
        if t is None or os.environ.get("GPUMON_MODULE_ANNOTATIONS", "1") == "0":
            return
        if _annotator is not None:
            _annotator.stop()
        devices, memory, _h = _sources(t)
        devs = devices()
        dev = devs[0] if devs else None
        if isinstance(dev, int):
            try:
                dev = int(t.cuda.current_device()) if t.cuda.is_initialized() else dev
            except Exception:
                pass
        a = Annotator(t, dev, memory)
        a.start()
        _annotator = a
    except Exception as e:
        _log(f"annotate_start: {e!r}")


def annotate_stop(first_us: int | None = None, last_us: int | None = None) -> dict | None:
    """Stop logging; the sidecar's ``modules`` over [first_us, last_us], or None."""
    global _annotator
    a, _annotator = _annotator, None
    if a is None:
        return None
    try:
        a.stop()
        return a.export(first_us, last_us)
    except Exception as e:
        _log(f"annotate_stop: {e!r}")
        return None
