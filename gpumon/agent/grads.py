"""The gradients an optimizer steps, as plain numbers for a snapshot's sidecar.

With stacks='python', everything autograd's engine allocates in backward runs on its own thread
and carries no Python frame: in the blog's loop the 5.75 GiB of gradients live at the
optimizer-step peak were "<no stack recorded>". While gpumon records a snapshot, a global
optimizer-step pre-hook (torch's own registry: nothing is placed on the program's objects)
notes, on the training thread, the address and size of every ``param.grad`` the optimizer is
about to read, and the parameter's name in its model; `gpumon view` then names those
allocations "gradients of <model>" (gpumon/snapshot/naming.py).

Sidecar format (``"grads"`` of ``<snapshot>.pickle.json``)::

    {"clock": "time_us", "names": [parameter name, ...], "owners": [model class, ...],
     "owner_of": [index into owners for each name, -1: unknown],
     "steps": [{"time_us": int, "device": int, "ptr": [int], "size": [int], "name": [int],
                "param_ptr": [int]}]}

(``ptr``/``size``: each ``.grad``; ``param_ptr``: its parameter's own storage, so the view can
call parameters parameters.)

Only integers and names are read (``data_ptr``, ``nbytes``, ``device``), on the thread that runs
the optimizer, at its hook: the agent's own thread never touches a tensor (DESIGN.md). Bounded:
the last MAX_STEPS steps, at most MAX_PARAMS gradients a step. Standard library only; torch is
taken from the objects the hook is given.
"""
from __future__ import annotations

import sys
import time
from collections import deque

MAX_STEPS = 16
MAX_PARAMS = 100_000


class GradLog:
    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type   # the allocator whose history is recorded
        self.steps: deque = deque(maxlen=MAX_STEPS)
        self.names: list[str] = []
        self.owners: list[str] = []
        self.owner_of: list[int] = []
        self._index: dict[int, int] = {}        # id(param) -> index into names
        self._named: dict[int, tuple] = {}      # id(param) -> (name, owner), from the models
        self._looked_up = False

    def _model_names(self) -> None:
        """Names of the parameters of the models gpumon's phases tracker found (its root
        modules), once per recording."""
        self._looked_up = True
        phases = sys.modules.get("gpumon.agent.phases")
        tracker = phases.current() if phases is not None else None
        roots = tracker.roots() if tracker is not None else []
        for root in roots:
            owner = type(root).__name__
            for name, p in root.named_parameters():
                self._named.setdefault(id(p), (name, owner))

    def _name(self, p, optimizer, gi: int, pi: int) -> int:
        k = self._index.get(id(p))
        if k is not None:
            return k
        if not self._looked_up:
            self._model_names()
        name, owner = self._named.get(id(p)) or (
            f"param_groups[{gi}][{pi}] {tuple(p.shape)}", f"{type(optimizer).__name__}'s "
            "parameters")
        if owner not in self.owners:
            self.owners.append(owner)
        k = self._index[id(p)] = len(self.names)
        self.names.append(name)
        self.owner_of.append(self.owners.index(owner))
        return k

    def on_step_pre(self, optimizer, *_args, **_kw) -> None:
        """At the optimizer's step pre-hook, on the training thread. Never raises."""
        try:
            t = time.time_ns() // 1000
            per_dev: dict[int, tuple[list, list, list]] = {}
            n = 0
            for gi, group in enumerate(optimizer.param_groups):
                for pi, p in enumerate(group["params"]):
                    g = p.grad
                    if g is None or g.is_sparse or g.device.type != self.device_type:
                        continue
                    n += 1
                    if n > MAX_PARAMS:
                        break
                    ptr, size, name, pptr = per_dev.setdefault(g.device.index or 0,
                                                               ([], [], [], []))
                    ptr.append(int(g.data_ptr()))
                    size.append(int(g.nbytes))
                    name.append(self._name(p, optimizer, gi, pi))
                    pptr.append(int(p.data_ptr()))
            for dev, (ptr, size, name, pptr) in per_dev.items():
                self.steps.append({"time_us": t, "device": dev, "ptr": ptr, "size": size,
                                   "name": name, "param_ptr": pptr})
        except Exception:
            pass

    def export(self) -> dict | None:
        if not self.steps:
            return None
        return {"clock": "time_us", "names": list(self.names), "owners": list(self.owners),
                "owner_of": list(self.owner_of), "steps": list(self.steps)}
