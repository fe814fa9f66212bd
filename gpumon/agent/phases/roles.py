"""Accounting by role: the bytes of parameters, gradients and optimizer state, walked on the
training thread at a hook (never elsewhere: the program frees and replaces those tensors at any
moment), and the ``breakdown`` payloads built from them.

Roles: ``parameters`` (parameters and buffers of the modules seen in forward, watched modules
and the optimizers' param_groups), ``gradients`` (``.grad``), ``optimizer_state`` (tensors in
``optimizer.state``), each deduplicated by storage; ``activations`` = allocated - those three
(activations and temporaries); ``allocator_cache`` = reserved - allocated; ``non_pytorch`` =
NVML process used - reserved.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

ROLES = ("parameters", "gradients", "optimizer_state", "activations", "allocator_cache",
         "non_pytorch")
PERSISTENT_ROLES = ("parameters", "gradients", "optimizer_state")


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
            torch_mod: Any, pointers: dict | None = None) -> tuple[dict, int]:
    """Bytes per device of parameters (+buffers), gradients and optimizer state.

    Each storage is counted once (first role wins, in the order above); a storage that several
    tensors view is counted at its full size. ``device_filter``: device keys to count (CUDA
    index ints, "cpu"); None counts every device. ``pointers``: if given, filled with
    ``{cuda index: {storage address: (role, bytes)}}`` (the exact-peak replay finds these
    blocks at the peak). Returns ({device: {role: bytes}}, tensors seen). Training thread only.
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
        if pointers is not None and isinstance(dev, int):
            pointers.setdefault(dev, {})[st[0]] = (role, st[1])

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


def optimizer_impl(o: Any) -> str | None:
    """How the optimizer steps: "fused", "foreach" or "for-loop" (torch's default for an
    unset ``foreach``: foreach when the parameters are on CUDA); None if it has no such option.
    Reads a parameter's device: training thread only."""
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


class RoleBook:
    """The role figures the tracker keeps between boundaries and the ``breakdown`` payloads.

    Everything here is plain numbers once built: what another thread may read of it
    (``last``) was made on the training thread."""

    def __init__(self, nvml_used: Callable[[Any], int | None] | None = None) -> None:
        self._nvml_used = nvml_used
        self.run_peak: dict = {}        # dev -> {"bytes", "phase", "step"}
        self.run_peak_roles: dict = {}  # dev -> roles at the run's high-water mark
        self.step_peak: dict = {}       # dev -> the last exactly measured step's peak
        self.roles_at_end: dict = {}    # phase -> {dev: (persistent, reserved)}
        self.last: dict | None = None   # the last breakdown payload

    def nvml(self, dev: Any) -> int | None:
        if self._nvml_used is None:
            return None
        try:
            return self._nvml_used(dev)
        except Exception:
            return None

    def devices_entry(self, reads: dict, persistent: dict, ended: str | None = None) -> list:
        """The ``devices`` list of a breakdown from reads taken now and roles walked now."""
        devices = []
        ends = self.roles_at_end.setdefault(ended, {}) if ended is not None else None
        for dev, r in reads.items():
            per = persistent.get(dev, {"parameters": 0, "gradients": 0, "optimizer_state": 0})
            alloc = r[0] if r else None
            reserved = r[2] if r else None
            if ends is not None:
                ends[dev] = (per, reserved)
            nv = self.nvml(dev)
            entry = {"index": dev, "now": derive_roles(per, alloc, reserved, nv),
                     "allocated": alloc, "reserved": reserved,
                     "retries": r[3] if r else None}
            entry.update(self.at_peak(dev, nv))
            entry.update(self.run_peak_entry(dev, r, nv))
            devices.append(entry)
        return devices

    def run_peak_entry(self, dev: Any, r: Any, nv: int | None) -> dict:
        rp = self.run_peak.get(dev)
        at = self.run_peak_roles.get(dev)
        if at is not None:
            at = dict(at)
            if nv is not None and at.get("non_pytorch") is None and rp is not None:
                at["non_pytorch"] = max(0, nv - (at["allocator_cache"] or 0) - rp["bytes"]) \
                    if at.get("allocator_cache") is not None else None
        return {"run_peak": rp["bytes"] if rp else (r[1] if r else None),
                "run_peak_phase": rp["phase"] if rp else None,
                "run_peak_step": rp["step"] if rp else None,
                "at_run_peak": at}

    def at_peak(self, dev: Any, nv: int | None) -> dict:
        """The last exactly measured step's peak, its phase and the roles at that moment."""
        sp = self.step_peak.get(dev)
        if not sp:
            return {"at_peak": None, "peak": None, "peak_phase": None, "peak_step": None,
                    "peak_exact": False}
        at = sp.get("roles")
        if at is not None:
            at = dict(at)
            if nv is not None and at.get("non_pytorch") is None and sp.get("reserved") is not None:
                at["non_pytorch"] = max(0, nv - sp["reserved"])
        return {"at_peak": at, "peak": sp["bytes"], "peak_phase": sp["phase"],
                "peak_step": sp["step"], "peak_exact": True}
