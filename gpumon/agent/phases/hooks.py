"""Finding the phases without changing the program: torch's hooks and the discovery of the
root modules. Every callback runs on the thread that trains, takes the tracker's lock and tells
the tracker (tracker.py) what happened; nothing here keeps step or phase state.

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
  Recomputation of checkpointed modules inside backward is ignored (graph task id).
* torch.compile: hooks return at once while dynamo traces (``torch.compiler.is_compiling``).
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Callable

DISCOVERY_MAX_ROOT_CALLS = 200  # inference-only programs: stop global hooks after this many
DISCOVERY_MAX_S = 60.0


def _log(msg: str) -> None:
    try:
        from gpumon.agent.log import get_logger  # the agent's own log, never stdout/stderr
        get_logger().info("phases: %s", msg)
    except Exception:
        pass


class TorchHooks:
    def __init__(self, tracker: Any, torch_mod: Any) -> None:
        self.tr = tracker
        self.torch = torch_mod
        self._handles: list = []
        self._global_handles: list = []
        self._tls = threading.local()
        self._roots: dict[int, tuple[Any, list]] = {}   # id -> (weakref, handles)
        self._watched: list = []                         # weakrefs of watched modules
        self.optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._covered_opts: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._root_active: Any = None
        self._root_depth = 0
        self._opt_depth = 0
        self._bwd_task: Any = None
        self.discovery = False
        self._discovery_until_step = 1
        self._discovery_calls = 0
        self._discovery_t0 = 0.0
        self.installed = False
        self._is_compiling = _pick_is_compiling(torch_mod)
        self._graph_task_id = getattr(torch_mod._C, "_current_graph_task_id", None)

    # ------------------------------------------------------------------ install / remove
    def install(self) -> None:
        opt = sys.modules["torch.optim.optimizer"]
        self._handles.append(opt.register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(opt.register_optimizer_step_post_hook(self._opt_post))
        self.start_discovery()
        self.installed = True
        for ref in list(self._watched):
            m = ref()
            if m is not None:
                self._add_root(m)

    def close(self) -> None:
        self.stop_discovery()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for _ref, hs in self._roots.values():
            for h in hs:
                h.remove()
        self._roots.clear()
        self.installed = False

    def start_discovery(self) -> None:
        if self.discovery:
            return
        mm = sys.modules["torch.nn.modules.module"]
        self._global_handles.append(mm.register_module_forward_pre_hook(self._disc_pre))
        try:
            h = mm.register_module_forward_hook(self._disc_post, always_call=True)
        except TypeError:  # torch < 2.1
            h = mm.register_module_forward_hook(self._disc_post)
        self._global_handles.append(h)
        self.discovery = True
        self._tls = threading.local()  # depth restarts at 0 (an earlier stop may leave it at 1)
        self._discovery_calls = 0
        self._discovery_t0 = self.tr._clock()
        self._discovery_until_step = self.tr.steps_done + 1

    def stop_discovery(self) -> None:
        for h in self._global_handles:
            h.remove()
        self._global_handles.clear()
        self.discovery = False

    def step_closed(self, steps_done: int) -> None:
        """The tracker closed a step: the discovery window ends after its first step."""
        if self.discovery and steps_done >= self._discovery_until_step:
            self.stop_discovery()

    def watch(self, model: Any = None, optimizer: Any = None) -> None:
        if model is not None:
            for m in (model if isinstance(model, (list, tuple)) else [model]):
                self._watched.append(weakref.ref(m))
                if self.installed:
                    self._add_root(m)
        if optimizer is not None:
            for o in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]):
                self.optimizers.add(o)

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

    def modules(self) -> list:
        """Roots and watched modules: what the role walk accounts."""
        return self.roots() + [m for m in (r() for r in self._watched) if m is not None]

    # ------------------------------------------------------------------ helpers
    def _in_backward(self) -> bool:
        if self._graph_task_id is not None:
            try:
                return self._graph_task_id() != -1
            except Exception:
                pass
        return False

    # ------------------------------------------------------------------ optimizer
    def _opt_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._is_compiling():
            return
        tr = self.tr
        try:
            with tr._lock:
                self._opt_depth += 1
                if self._opt_depth > 1:
                    return
                self.optimizers.add(optimizer)
                self._check_coverage(optimizer)
                tr.optimizer_started(optimizer)
        except Exception as e:
            _log(f"optimizer pre-hook: {e!r}")

    def _opt_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._is_compiling():
            return
        tr = self.tr
        try:
            with tr._lock:
                self._opt_depth = max(0, self._opt_depth - 1)
                if self._opt_depth:
                    return
                tr.optimizer_ended(optimizer)
        except Exception as e:
            _log(f"optimizer post-hook: {e!r}")

    def _check_coverage(self, optimizer: Any) -> None:
        if optimizer in self._covered_opts or self.discovery:
            return
        owned = set()
        for m in self.roots():
            owned.update(id(p) for p in m.parameters())
        ps = [p for g in optimizer.param_groups for p in g["params"]]
        if all(id(p) in owned for p in ps):
            self._covered_opts.add(optimizer)
        elif self._discovery_calls < DISCOVERY_MAX_ROOT_CALLS:
            self._covered_opts.add(optimizer)  # look once; re-arm discovery for one step
            self.start_discovery()

    # ------------------------------------------------------------------ module discovery
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
                    or self.tr._clock() - self._discovery_t0 > DISCOVERY_MAX_S):
                with self.tr._lock:
                    self.stop_discovery()
            if id(module) not in self._roots:
                with self.tr._lock:
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

    # ------------------------------------------------------------------ root modules
    def _root_pre(self, module: Any, args: Any) -> None:
        if self._is_compiling():
            return
        try:
            if self._in_backward():
                return  # recomputation (activation checkpointing) inside backward
            with self.tr._lock:
                if self._root_active is not None:
                    if self._root_active is module:  # called twice for one call (discovery)
                        return
                    self._root_depth += 1
                    return
                self._root_active = module
                self._root_depth = 1
                self.tr.forward_started(self.torch.is_grad_enabled())
        except Exception as e:
            _log(f"root pre-hook: {e!r}")

    def _root_post(self, module: Any, args: Any, output: Any) -> None:
        if self._is_compiling():
            return
        tr = self.tr
        try:
            if self._in_backward():
                return
            with tr._lock:
                if self._root_active is None:
                    return
                if self._root_active is not module or self._root_depth > 1:
                    self._root_depth = max(1, self._root_depth - 1)
                    return
                self._root_active = None
                self._root_depth = 0
                if tr._auto == "forward":
                    tensors = _tensors(output, self.torch.Tensor)
                    if tr.wants_output():
                        tr.note_output(tensors, self._autocast(tensors))
                    if self._arm_backward(tensors):
                        return  # forward lasts until backward starts (the loss is part of it)
                tr.set_auto("other")
        except Exception as e:
            _log(f"root post-hook: {e!r}")

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
            fn.register_prehook(self._bwd_start)
        return bool(nodes)

    def _bwd_start(self, grad_outputs: Any) -> None:
        try:
            tid = self._graph_task_id() if self._graph_task_id is not None else None
            with self.tr._lock:
                if self._bwd_task is not None and self._bwd_task == tid:
                    return None
                self._bwd_task = tid if tid is not None else True
                self.tr.backward_started()
            self.torch.autograd.Variable._execution_engine.queue_callback(self._bwd_end)
        except Exception as e:
            _log(f"backward pre-hook: {e!r}")
        return None

    def _bwd_end(self) -> None:
        try:
            with self.tr._lock:
                self._bwd_task = None
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


def _pick_is_compiling(t: Any) -> Callable[[], bool]:
    comp = getattr(t, "compiler", None)
    fn = getattr(comp, "is_compiling", None) if comp is not None else None
    if fn is not None:
        return fn
    return lambda: False
