"""Finding the phases without changing the program: torch's global hooks. Every callback runs
on the thread that trains, takes the tracker's lock and tells the tracker (tracker.py) what
happened; nothing here keeps step or phase state.

The rule: nothing of gpumon lives on the program's objects between its calls. Copying,
pickling, saving, scripting, tracing, exporting and compiling a model, and code that reads
``model._forward_hooks``, see exactly what they would see without gpumon (tests/compat).

* optimizer step: torch's global optimizer step pre/post hooks (every optimizer, cheap).
* forward: ONE global module forward pre-hook, *armed* only while no root forward runs. Pre-hooks
  fire outer-first, so the first module called while armed is a root (the model, a loss module,
  ``torch.compile``'s wrapper). At that moment the hook disarms itself (every submodule then
  takes ``Module._call_impl``'s fast path: armed for every call, global hooks cost ~10% on
  Python-bound steps, FACTS.md) and puts a one-call post hook on that root, which removes
  itself as it fires at the end of the same call and re-arms the global hook. A forward with
  grad mode on is ``forward``; under ``no_grad`` / ``inference_mode`` it is ``eval``.
* backward: when a grad-enabled root forward returns, a pre-hook goes on the ``grad_fn`` of its
  output tensors (autograd nodes of this step; gone with its graph); it fires when autograd
  reaches the model's output (``loss.backward()``) and queues an engine callback
  (``queue_callback``) that fires when that backward pass ends. The global hook is disarmed
  during backward; recomputation of checkpointed modules inside backward is never a forward
  (graph task id).
* Entries go into torch's hook dicts under gpumon's own keys, never through a
  ``RemovableHandle``: handles count up from 0 process-wide, so taking one would shift the
  numbers of every hook the program registers later (``model._forward_hooks`` keys).
* torch.compile: the hook functions are plain module-level functions whose first statement
  returns while dynamo traces (``torch.compiler.is_compiling``): no graph break, no guard that
  changes. ``torch.compile(model)`` calls its wrapper eagerly, so the root is seen there and the
  hook is disarmed before dynamo runs the inner module. ``model.compile()`` in place, or a
  compiled training-step function, runs the root's call inside the compiled frame: forward and
  backward are invisible there, and the tracker says so (phases_note) instead of guessing.
  ``OptimizedModule.__call__`` warns when any global module hook exists ("hooks fire an extra
  time"); gpumon's never fires twice (it is disarmed inside the root), so the check that warns
  is given a version that does not count gpumon's entry: the program's own hooks still warn.
* strict ``torch.export`` (torch 2.11 to 2.13, its default tracer) wraps the model in a
  ``ModuleToTrace`` module and traces that wrapper's ``__call__`` instead of its ``forward`` when
  any of the four global module hook dicts is non-empty (``get_traced_fn`` in
  torch/_dynamo/convert_frame.py reads their ``len``), and then fails: the wrapper's forward is
  in dynamo's skip list. So gpumon steps aside for it: a global module *registration* hook
  (called, eagerly, when export puts the model into its wrapper; it fires only when a module is
  assigned to a module, never in a step) takes the armed pre-hook out of the dict while that
  wrapper lives, and the export traces exactly what it traces without gpumon. Its weakref
  callback re-arms as export returns (the next optimizer step does, as a backstop, once
  ``torch.compiler.is_exporting()`` is off).
"""
from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Callable

# gpumon's key in each of torch's hook dicts it uses: negative, so never a RemovableHandle id
_KEY = -0x67706D6F6E

_current: "TorchHooks | None" = None  # the installed instance (one per process)
_module_mod: Any = None               # torch.nn.modules.module, once installed


def _never_compiling() -> bool:
    return False


_is_compiling: Callable[[], bool] = _never_compiling  # torch.compiler.is_compiling, installed
# torch.compiler.is_dynamo_compiling: true only while dynamo traces (is_compiling is also true,
# eagerly, for the whole of a strict export, when the registration hook must act)
_is_dynamo_compiling: Callable[[], bool] = _never_compiling
_is_exporting: Callable[[], bool] = _never_compiling  # torch.compiler.is_exporting

# the module strict torch.export wraps the program's model in before tracing it (its class)
_EXPORT_WRAPPER = ("torch._dynamo.functional_export", "ModuleToTrace")


def _log(msg: str) -> None:
    try:
        from gpumon.agent.log import get_logger  # the agent's own log, never stdout/stderr
        get_logger().info("phases: %s", msg)
    except Exception:
        pass


# ---------------------------------------------------------------------- what torch calls
# Plain module-level functions: dynamo inlines them when it traces a call while one is in a
# hook dict, and their first statement returns there, so nothing of them reaches a graph.

def _root_pre_hook(module: Any, args: Any) -> None:
    """torch's global forward pre-hook, in the dict only while no root forward runs."""
    if _is_compiling():
        return None
    h = _current
    if h is not None:
        h._root_called(module, sys._getframe(1))
    return None


def _root_end_hook(module: Any, args: Any, output: Any) -> None:
    """On the root for one call only (always_call: also when its forward raises)."""
    if _is_compiling():
        return None
    h = _current
    if h is not None:
        h._root_returned(module, output, sys._getframe(1))
    else:  # gpumon stopped during this call
        _take_end_hook(module)
    return None


def _opt_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _is_compiling():
        return None
    h = _current
    if h is not None:
        h._opt_pre(optimizer)
    return None


def _opt_post_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _is_compiling():
        return None
    h = _current
    if h is not None:
        h._opt_post(optimizer)
    return None


def _registration_hook(module: Any, name: str, submodule: Any) -> None:
    """torch's global module registration hook: strict export putting the model into its
    wrapper is the moment gpumon's pre-hook must leave (module doc). Returns None: the
    submodule is registered as it is."""
    if _is_dynamo_compiling():
        return None
    cls = type(module)
    if cls.__name__ == _EXPORT_WRAPPER[1] and cls.__module__ == _EXPORT_WRAPPER[0]:
        h = _current
        if h is not None:
            h._export_began(module)
    return None


# ids of the global module hooks gpumon's other parts hold for a while (a per-module
# measurement, a recording's module annotations: gpumon/agent/modules.py); they count a
# compiled module once, so torch's warning about hooks firing twice is not the program's
OTHER_HOOK_IDS: set = set()
_check_holders = 0
_orig_check: Any = None


def _has_any_global_hook() -> bool:
    """torch's check (OptimizedModule.__call__ warns when it is true), not counting gpumon's
    entries: this one is disarmed inside the root, so it never fires twice as the warning
    says, and OTHER_HOOK_IDS count a compiled module once."""
    mm = _module_mod
    ours = OTHER_HOOK_IDS

    def theirs(d: Any) -> bool:
        return any(k != _KEY and k not in ours for k in d)
    return bool(theirs(mm._global_backward_pre_hooks) or theirs(mm._global_backward_hooks)
                or theirs(mm._global_forward_pre_hooks) or theirs(mm._global_forward_hooks)
                or theirs(mm._global_forward_hooks_always_called)
                or theirs(mm._global_forward_hooks_with_kwargs))


def hold_hook_check(mm: Any) -> None:
    """Answer torch's _has_any_global_hook with the version above while any part of gpumon
    holds global hooks (counted); torch's own goes back when the last lets go."""
    global _check_holders, _orig_check, _module_mod
    if _module_mod is None:
        _module_mod = mm
    if _check_holders == 0:
        orig = getattr(mm, "_has_any_global_hook", None)
        if orig is not None and orig is not _has_any_global_hook:
            _orig_check = orig
            mm._has_any_global_hook = _has_any_global_hook
    _check_holders += 1


def release_hook_check(mm: Any) -> None:
    global _check_holders, _orig_check
    _check_holders = max(0, _check_holders - 1)
    if _check_holders == 0 and _orig_check is not None:
        if getattr(mm, "_has_any_global_hook", None) is _has_any_global_hook:
            mm._has_any_global_hook = _orig_check
        _orig_check = None


def _add_node_prehook(node: Any, fn: Any, handle_cls: Any) -> None:
    """``node.register_prehook(fn)`` under gpumon's key: the handle it makes takes a number
    from the count every later hook handle of the program's continues."""
    n = getattr(handle_cls, "next_id", None)
    h = node.register_prehook(fn)
    try:
        d = h.hooks_dict_ref()
        if d is not None and h.id in d:
            d[_KEY] = d.pop(h.id)
            if n is not None and handle_cls.next_id == n + 1 == h.id + 1:
                handle_cls.next_id = n
    except Exception:
        pass


def _take_end_hook(module: Any) -> None:
    try:
        module._forward_hooks.pop(_KEY, None)
        getattr(module, "_forward_hooks_always_called", {}).pop(_KEY, None)
    except Exception:
        pass


class TorchHooks:
    def __init__(self, tracker: Any, torch_mod: Any) -> None:
        self.tr = tracker
        self.torch = torch_mod
        self._mm: Any = None
        self._om: Any = None
        self._roots: dict[int, Any] = {}   # id -> weakref of each root seen
        self._watched: list = []           # weakrefs of watched modules
        self.optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._active: Any = None           # weakref of the root whose call runs (end hook on it)
        self._active_frames: tuple = ()    # ids of the frames that ran its pre-hook
        self._pre_index = 0                # gpumon's place among the global pre-hooks
        self._bwd_disarmed = False
        self._opt_depth = 0
        self._bwd_task: Any = None
        self._pid = os.getpid()
        self._holds_check = False  # hold_hook_check taken by install
        self._aside: Any = None    # weakref of strict export's wrapper while gpumon steps aside
        self._handle_cls = getattr(getattr(torch_mod, "utils", None), "hooks", None)
        self._handle_cls = getattr(self._handle_cls, "RemovableHandle", None)
        self.installed = False
        self._graph_task_id = getattr(torch_mod._C, "_current_graph_task_id", None)
        self._jit_tracing = getattr(torch_mod._C, "_get_tracing_state", None)
        fx = getattr(getattr(torch_mod, "fx", None), "_symbolic_trace", None)
        self._fx_tracing = getattr(fx, "is_fx_symbolic_tracing", None)

    # ------------------------------------------------------------------ install / remove
    def install(self) -> None:
        global _current, _is_compiling, _is_dynamo_compiling, _is_exporting, _module_mod
        if _current is not None and _current is not self:
            _current.close()
        self._mm = mm = sys.modules["torch.nn.modules.module"]
        self._om = om = sys.modules["torch.optim.optimizer"]
        _is_compiling = _pick_is_compiling(self.torch)
        _is_dynamo_compiling = _pick_is_compiling(self.torch, "is_dynamo_compiling")
        _is_exporting = _pick_is_compiling(self.torch, "is_exporting")
        _module_mod = mm
        self._pid = os.getpid()
        om._global_optimizer_pre_hooks[_KEY] = _opt_pre_hook
        om._global_optimizer_post_hooks[_KEY] = _opt_post_hook
        registration = getattr(mm, "_global_module_registration_hooks", None)
        if registration is not None:
            registration[_KEY] = _registration_hook
        if not self._holds_check:
            hold_hook_check(mm)
            self._holds_check = True
        _current = self
        self._arm()
        self.installed = True

    def close(self) -> None:
        global _current
        if self._mm is None:
            return
        self._disarm()
        self._om._global_optimizer_pre_hooks.pop(_KEY, None)
        self._om._global_optimizer_post_hooks.pop(_KEY, None)
        getattr(self._mm, "_global_module_registration_hooks", {}).pop(_KEY, None)
        self._aside = None
        if self._holds_check:
            release_hook_check(self._mm)
            self._holds_check = False
        m = self._active() if self._active is not None else None
        if m is not None:
            _take_end_hook(m)
        self._active, self._active_frames = None, ()
        if _current is self:
            _current = None
        self.installed = False

    def _arm(self) -> None:
        d = self._mm._global_forward_pre_hooks
        if _KEY in d:
            return
        if self._aside is not None and self._aside() is not None:
            return  # a strict export runs: stay out of its way until its wrapper is gone
        d[_KEY] = _root_pre_hook
        if self._pre_index < len(d) - 1:
            # back to its place among the program's own global pre-hooks (dynamo guards on
            # this dict's keys, in order): rare, only with hooks of the program's own
            items = list(d.items())
            items.insert(self._pre_index, items.pop())
            d.clear()
            d.update(items)

    def _disarm(self) -> None:
        d = self._mm._global_forward_pre_hooks if self._mm is not None else {}
        if _KEY in d:
            self._pre_index = 0 if len(d) == 1 else list(d).index(_KEY)
            del d[_KEY]

    def _export_began(self, wrapper: Any) -> None:
        """Strict export wrapped a model: out of the dict until the wrapper is gone."""
        try:
            with self.tr._lock:
                if os.getpid() != self._pid:
                    return
                self._disarm()
                self._aside = weakref.ref(wrapper, self._export_ended)
                _log("strict torch.export began: the forward hook steps aside until it ends")
        except Exception as e:
            _log(f"export began: {e!r}")

    def _export_ended(self, ref: Any) -> None:
        """The wrapper was freed (export returned or raised and its traceback went)."""
        try:
            with self.tr._lock:
                if self._aside is not ref:
                    return
                self._aside = None
                if self.installed and self._active is None and not self._bwd_disarmed:
                    self._arm()
        except Exception as e:
            _log(f"export ended: {e!r}")

    @property
    def armed(self) -> bool:
        return self._mm is not None and _KEY in self._mm._global_forward_pre_hooks

    @property
    def discovery(self) -> bool:
        """Installed and no root module seen yet."""
        return self.installed and not self._roots

    def step_closed(self, steps_done: int) -> None:
        """The tracker closed a step (nothing to do: roots are found at every call)."""

    def watch(self, model: Any = None, optimizer: Any = None) -> None:
        if model is not None:
            for m in (model if isinstance(model, (list, tuple)) else [model]):
                self._watched.append(weakref.ref(m))
        if optimizer is not None:
            for o in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]):
                self.optimizers.add(o)

    def _note_root(self, module: Any) -> None:
        key = id(module)
        ref = self._roots.get(key)
        if ref is not None and ref() is module:
            return

        def gone(_ref: Any, key: int = key) -> None:
            self._roots.pop(key, None)
        self._roots[key] = weakref.ref(module, gone)
        _log(f"root module {type(module).__name__}")

    def roots(self) -> list:
        return [m for m in (r() for r in list(self._roots.values())) if m is not None]

    def modules(self) -> list:
        """Roots and watched modules: what the role walk accounts."""
        return self.roots() + [m for m in (r() for r in self._watched) if m is not None]

    # ------------------------------------------------------------------ what can't be seen
    def compiled(self) -> bool:
        """torch.compile has compiled something in this process (read from dynamo's counters,
        never creating a key in them; no import)."""
        utils = sys.modules.get("torch._dynamo.utils")
        counters = getattr(utils, "counters", None)
        try:
            stats = counters.get("stats") if counters is not None else None
            return bool(stats and stats.get("unique_graphs", 0) > 0)
        except Exception:
            return False

    def no_forward_note(self) -> str:
        """Why optimizer steps come with no forward."""
        if self.compiled():
            return ("forward/backward unavailable: optimizer steps but no module forward was "
                    "seen; the model runs inside a compiled function (torch.compile of the "
                    "code that calls it: gpumon's hooks are compiled away there, it never "
                    "changes the program to see them); only the optimizer step is measured")
        return ("forward/backward unavailable: optimizer steps but no module forward was seen "
                "(a functional call, or a model called outside torch.nn's Module.__call__); "
                "only the optimizer step is measured")

    def unseen_note(self) -> str | None:
        """Why no step has been seen at all, when gpumon can tell."""
        if self.compiled():
            return ("no training step seen yet: if the whole training step runs compiled "
                    "(torch.compile of a function holding forward, backward and the optimizer "
                    "step), gpumon's hooks are compiled away and it cannot see its phases "
                    "(it never changes the program to see them); the memory figures still come")
        return None

    # ------------------------------------------------------------------ helpers
    def _in_backward(self) -> bool:
        if self._graph_task_id is not None:
            try:
                return self._graph_task_id() != -1
            except Exception:
                pass
        return False

    def _recover(self) -> None:
        """Called at each optimizer step: a root call that never returned (KeyboardInterrupt
        or SystemExit in forward: torch runs always_call hooks only for Exception), or a
        backward that never ended (an error the program caught), left the hook disarmed."""
        if self._aside is not None and not _is_exporting():
            self._aside = None  # the export is over; its wrapper is kept (a stored traceback)
        ref = self._active
        if ref is not None:
            m = ref()
            f = sys._getframe()
            while f is not None and id(f) not in self._active_frames:
                f = f.f_back
            if m is not None and f is not None:
                return  # the root's call still runs (an optimizer stepped inside it)
            if m is not None:
                _take_end_hook(m)
            self._active, self._active_frames = None, ()
        if self._bwd_disarmed and not self._in_backward():
            self._bwd_disarmed = False
            self._bwd_task = None
        if not self._bwd_disarmed:
            self._arm()

    # ------------------------------------------------------------------ optimizer
    def _opt_pre(self, optimizer: Any) -> None:
        tr = self.tr
        try:
            with tr._lock:
                self._opt_depth += 1
                if self._opt_depth > 1:
                    return
                if not self.armed:
                    self._recover()
                self.optimizers.add(optimizer)
                tr.optimizer_started(optimizer)
        except Exception as e:
            _log(f"optimizer pre-hook: {e!r}")

    def _opt_post(self, optimizer: Any) -> None:
        tr = self.tr
        try:
            with tr._lock:
                self._opt_depth = max(0, self._opt_depth - 1)
                if self._opt_depth:
                    return
                tr.optimizer_ended(optimizer)
        except Exception as e:
            _log(f"optimizer post-hook: {e!r}")

    # ------------------------------------------------------------------ root modules
    def _root_called(self, module: Any, frame: Any) -> None:
        try:
            if os.getpid() != self._pid:
                self._disarm()  # a forked child (DataLoader worker): gpumon is not in it
                return
            if self._in_backward():
                return  # recomputation (activation checkpointing) inside backward
            jt = self._jit_tracing
            if (jt is not None and jt()) or (self._fx_tracing is not None and self._fx_tracing()):
                return  # jit.trace / fx running the model to record it: not a training forward
            with self.tr._lock:
                if self._active is not None:
                    return  # another thread's root call runs
                module._forward_hooks[_KEY] = _root_end_hook
                always = getattr(module, "_forward_hooks_always_called", None)
                if always is not None:
                    always[_KEY] = True
                self._disarm()
                self._active = weakref.ref(module)
                self._active_frames = (id(frame), id(frame.f_back))
                self._note_root(module)
                self.tr.forward_started(self.torch.is_grad_enabled())
        except Exception as e:
            _log(f"root pre-hook: {e!r}")

    def _root_returned(self, module: Any, output: Any, frame: Any) -> None:
        tr = self.tr
        try:
            with tr._lock:
                ref = self._active
                if ref is not None and ref() is module and id(frame) not in self._active_frames:
                    return  # the root called again inside its own call, or from another thread
                _take_end_hook(module)
                if ref is None or ref() is not module:
                    return  # left from a call that never returned
                self._active, self._active_frames = None, ()
                self._arm()
                tr.forward_returned()
                if tr._auto == "forward":
                    tensors = _tensors(output, self.torch.Tensor)
                    if tr.wants_output():
                        tr.note_output(tensors, self._autocast(tensors))
                    if self._arm_backward(tensors):
                        return  # forward lasts until backward starts (the loss is part of it)
                tr.set_auto("other")
        except Exception as e:
            _log(f"root end hook: {e!r}")

    def _autocast(self, tensors: list) -> str | bool | None:
        """The autocast dtype in force for this forward's device (the end hook runs inside
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

    # ------------------------------------------------------------------ backward
    def _arm_backward(self, tensors: list) -> bool:
        nodes = []
        seen = set()
        for t in tensors:
            fn = t.grad_fn
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                nodes.append(fn)
        for fn in nodes:
            _add_node_prehook(fn, self._bwd_start, self._handle_cls)
        return bool(nodes)

    def _bwd_start(self, grad: Any) -> None:  # Ctrl-C in backward() lands here; not a gpumon error
        try:
            tid = self._graph_task_id() if self._graph_task_id is not None else None
            with self.tr._lock:
                if self._bwd_task is not None and self._bwd_task == tid:
                    return None
                self._bwd_task = tid if tid is not None else True
                if self._active is None:
                    # no root forward inside backward: recomputed modules take the fast path
                    self._disarm()
                    self._bwd_disarmed = True
                self.tr.backward_started()
            self.torch.autograd.Variable._execution_engine.queue_callback(self._bwd_end)
        except Exception as e:
            _log(f"backward pre-hook: {e!r}")
        return None

    # _bwd_start and _bwd_end are the first Python code run after parts of backward's C++: a
    # Ctrl-C pressed meanwhile is raised at their def line (its comment is what the traceback
    # prints with it).
    def _bwd_end(self) -> None:  # Ctrl-C in backward() lands here; not a gpumon error
        try:
            with self.tr._lock:
                self._bwd_task = None
                if self._bwd_disarmed:
                    self._bwd_disarmed = False
                    if self._active is None and self.installed:
                        self._arm()
                self.tr.backward_ended()
        except Exception as e:
            _log(f"backward end: {e!r}")


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


def _pick_is_compiling(t: Any, name: str = "is_compiling") -> Callable[[], bool]:
    comp = sys.modules.get("torch.compiler") or getattr(t, "compiler", None)
    fn = getattr(comp, name, None) if comp is not None else None
    if fn is not None:
        return fn
    return _never_compiling
