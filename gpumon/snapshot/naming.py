"""Names for allocations that carry no Python frame, from what gpumon knows beside the trace.

With stacks='python' everything autograd's engine allocates in backward runs on its own
thread and has no frame at all (on the blog's loop, 5.75 GiB of gradients at the optimizer-step
peak). gpumon's sidecar says more than the trace: the phase of the training loop at every
moment (its ``timeline``), and the ``.grad`` of every parameter the optimizer stepped while the
recording was on (its ``grads``: address and size, taken on the training thread at the
optimizer-step hook). frames.stackless_name turns these into a name; this module finds them
for one device's trace. A module path (where the agent annotates modules) slots into the same
call. Plain data only: no torch, no textual.
"""
from __future__ import annotations

import bisect

from .frames import stackless_name
from .load import int_field as _i

# gpumon recorded the file with Python stacks: an allocation with no frame had no Python
# caller (C++ code: autograd's backward thread, a C++ extension, NCCL)
NO_PY_CALLER = "C++ with no Python caller"
MAX_GRAD_ENTRIES = 4_000_000  # addresses read from a sidecar, over all its steps


def sidecar_grads(sidecar: dict, device: int) -> list[tuple[int, dict[int, int], dict]]:
    """The sidecar's ``grads`` for one device: [(time_us, {.grad address: name index},
    {parameter address: name index})], each field checked (the sidecar is as untrusted as
    the pickle)."""
    g = sidecar.get("grads")
    steps = g.get("steps") if isinstance(g, dict) else None
    if not isinstance(steps, list):
        return []
    out, seen = [], 0
    for st in steps:
        if not isinstance(st, dict) or type(st.get("time_us")) is not int:
            continue
        if _i(st.get("device", device)) != device:
            continue
        ptr, name = st.get("ptr"), st.get("name")
        if not isinstance(ptr, list) or not isinstance(name, list) or len(ptr) != len(name):
            continue
        pptr = st.get("param_ptr")
        pptr = pptr if isinstance(pptr, list) and len(pptr) == len(name) else []
        seen += len(ptr) + len(pptr)
        if seen > MAX_GRAD_ENTRIES:
            break
        out.append((st["time_us"], {p: n for p, n in zip(ptr, name)
                                    if type(p) is int and type(n) is int},
                    {p: n for p, n in zip(pptr, name) if type(p) is int and type(n) is int}))
    return out


def _strings(v, cap: int = 1_000_000) -> list[str]:
    return [str(x)[:200] for x in v[:cap]] if isinstance(v, list) else []


class StacklessNamer:
    """Names the elements of one DeviceTrace that have no Python frame (see name())."""

    def __init__(self, snap, tr):
        self.tr = tr
        side = snap.sidecar if isinstance(snap.sidecar, dict) else {}
        self.phases = snap.phase_spans(tr.device)
        self._starts = [p[0] for p in self.phases]
        self.python_stacks = side.get("stacks") in ("python", "all") and \
            side.get("format") == "gpumon-snapshot-meta"
        g = side.get("grads") if isinstance(side.get("grads"), dict) else {}
        self.param_names = _strings(g.get("names"))
        self.owners = _strings(g.get("owners"))
        owner_of = g.get("owner_of")
        self.owner_of = [o if type(o) is int else -1 for o in owner_of[:len(self.param_names)]] \
            if isinstance(owner_of, list) else []
        self.grad_of: dict[int, int] = {}   # element -> parameter name index
        self.param_of: dict[int, int] = {}  # element -> parameter name index (its storage)
        self._find_grads(sidecar_grads(side, tr.device))

    def _find_grads(self, steps) -> None:
        tr = self.tr
        if not steps:
            return
        by_addr: dict[int, list[int]] = {}
        st, en, ad = tr.el_start, tr.el_end, tr.el_addr
        for j in range(len(st)):
            by_addr.setdefault(ad[j], []).append(j)
        for t, ptrs, params in steps:
            e = tr.event_at_time_us(t) if tr.n else -1
            for found, where in ((self.grad_of, ptrs), (self.param_of, params)):
                for p, k in where.items():
                    for j in by_addr.get(p, ()):
                        if st[j] <= e < en[j]:
                            found.setdefault(j, k)
                            break

    def param(self, j: int) -> str | None:
        """The parameter whose .grad element j is (its name in its module), or None."""
        k = self.grad_of.get(j)
        if k is None or not 0 <= k < len(self.param_names):
            return None
        return self.param_names[k]

    def parameter(self, j: int) -> str | None:
        """The parameter whose storage element j is, or None."""
        k = self.param_of.get(j)
        if k is None or not 0 <= k < len(self.param_names):
            return None
        return self.param_names[k]

    def _owner(self, k: int) -> str:
        o = self.owner_of[k] if 0 <= k < len(self.owner_of) else -1
        return self.owners[o] if 0 <= o < len(self.owners) else "parameters"

    def phase_at(self, i: int) -> str | None:
        if i < 0:
            return None
        k = bisect.bisect_right(self._starts, i) - 1
        if k >= 0 and self.phases[k][0] <= i <= self.phases[k][1]:
            return self.phases[k][3]
        return None

    def name(self, j: int, cpp_frames=()) -> str | None:
        """The name of element j, which has no Python frame (cpp_frames: its C++ frames, if
        the trace kept any), or None when nothing is known."""
        k = self.grad_of.get(j)
        grad = self._owner(k) if k is not None else None
        k = self.param_of.get(j)
        param = self._owner(k) if k is not None else None
        s0 = self.tr.el_start[j]
        n = stackless_name(cpp_frames, self.phase_at(s0), None, grad, param)
        if n is None and s0 >= 0 and self.python_stacks:
            n = NO_PY_CALLER
        return n


__all__ = ["StacklessNamer", "sidecar_grads", "NO_PY_CALLER"]
