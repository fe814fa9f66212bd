"""Leaks across training steps: memory still live N steps after the step that allocated it,
grouped by where it was allocated.

Steps are cut at the ends of optimizer steps (torch's `Optimizer.step` annotations, or the
sidecar's phases timeline: Snapshot.step_boundaries). An allocation made in step s "survives"
when it is still live at the end of step s + N. A place that leaves survivors in two or more
steps grows step over step: a leak candidate (a loss kept with its graph, a list of tensors, a
cache without a bound). A place whose survivors all come from one step (the optimizer's state,
made at the first step) is long-lived, not growing, and is listed apart."""
from __future__ import annotations

import bisect
import json

from .analysis import Snapshot, fmt_bytes


def _long_lived_kind(tr, j: int, params: set) -> str:
    """What a long-lived allocation most likely is: "parameters" (an address the agent saw as
    a parameter's, or made in a module's __init__/_apply, torch.nn.Parameter), "optimizer
    state" (made inside torch.optim), else "" (a cache, a buffer, something kept)."""
    if tr.el_addr[j] in params:
        return "parameters"
    for fn, _line, name in tr.frames(tr.el_fid[j]):
        f = fn.replace("\\", "/")
        if "/torch/optim/" in f:
            return "optimizer state"
        if ("/torch/nn/modules/" in f and name in ("__init__", "_apply", "reset_parameters")) \
                or f.endswith("/torch/nn/parameter.py"):
            return "parameters"
    return ""


def _param_addrs(snap: Snapshot, device: int) -> set:
    """The parameters' addresses the agent noted at the optimizer steps (sidecar grads)."""
    g = snap.sidecar.get("grads") if isinstance(snap.sidecar, dict) else None
    steps = g.get("steps") if isinstance(g, dict) else None
    out: set = set()
    for st in steps if isinstance(steps, list) else ():
        if isinstance(st, dict) and st.get("device", device) == device and \
                isinstance(st.get("param_ptr"), list):
            out.update(p for p in st["param_ptr"][:1_000_000] if type(p) is int)
    return out


def leaks(snap: Snapshot, device: int | None = None, after: int = 1, by: str = "line",
          top: int = 20) -> dict:
    tr = snap.trace(device)
    bounds = [e for e, _ in snap.step_boundaries(tr.device)]
    after = max(1, after)
    out = {"device": tr.device, "steps": len(bounds), "after": after, "growing": [],
           "bounded": [], "long_lived": [], "checked_steps": 0}
    # a step s can be judged when the end of step s + after is in the trace
    judged = len(bounds) - after
    if judged <= 0:
        out["note"] = (f"needs at least {after + 1} optimizer-step ends in the trace "
                       f"(found {len(bounds)})")
        return out
    out["checked_steps"] = judged
    groups: dict[str, dict] = {}
    st, en, sz = tr.el_start, tr.el_end, tr.el_size
    nb = len(bounds)
    for j in range(len(st)):
        s0 = st[j]
        if s0 < 0:
            continue
        s = bisect.bisect_left(bounds, s0)   # step index: events up to bounds[0] are step 0
        if s >= judged:
            continue
        if en[j] <= bounds[s + after]:
            continue  # freed in time
        key, fr = tr.element_where(j, by)
        g = groups.get(key)
        if g is None:
            g = groups[key] = {"where": key, "per_step": [0] * judged, "count": 0,
                               "live_at_end": 0, "stack": j, "window": None, "oldest": 0}
        g["per_step"][s] += sz[j]
        g["count"] += 1
        if en[j] >= tr.n:
            g["live_at_end"] += sz[j]
            g["oldest"] = max(g["oldest"], nb - s)       # step ends it has lived through
        else:   # freed after surviving: how many step ends it was kept through
            life = bisect.bisect_left(bounds, en[j]) - s
            g["window"] = life if g["window"] is None else max(g["window"], life)
    params = _param_addrs(snap, tr.device)
    for g in groups.values():
        j = g.pop("stack")
        g["bytes"] = sum(g["per_step"])
        g["steps_leaking"] = sum(1 for b in g["per_step"] if b)
        g["example_stack"] = [f"{f[0]}:{f[1]} {f[2]}" for f in tr.reading_order(tr.el_fid[j])][:8]
        w, oldest = g.pop("window"), g.pop("oldest")
        if g["steps_leaking"] < 2:
            g["kind"] = _long_lived_kind(tr, j, params)
            out["long_lived"].append(g)
        elif w is not None and oldest <= w and w + 1 < nb:
            # kept a bounded number of steps, then freed (a deque(maxlen=N), a window of
            # recent losses): what it holds stops growing once the window is full
            g["kept_steps"] = w
            out["bounded"].append(g)
        else:
            out["growing"].append(g)
    if out["bounded"]:   # what each window holds at the end, its newest entries included
        held = {g["where"]: g for g in out["bounded"]}
        for g in held.values():
            g["live_at_end"] = 0
        for j in tr.live_elements(tr.n - 1):
            g = held.get(tr.element_where(j, by)[0])
            if g is not None:
                g["live_at_end"] += sz[j]
    for k in ("growing", "bounded", "long_lived"):
        out[k].sort(key=lambda g: (-g["bytes"], g["where"]))
        out[k] = out[k][:top]
    return out


def leaks_text(d: dict) -> str:
    if d.get("note"):
        return f"leaks: cannot tell: {d['note']}\n"
    lines = [f"memory still live {d['after']} step(s) after the step that allocated it "
             f"({d['checked_steps']} of {d['steps']} steps checked):"]
    if not d["growing"]:
        lines.append("  nothing grows step over step")
    else:
        lines.append("growing step over step (leak candidates), bytes left behind by each step:")
        for g in d["growing"]:
            per = " ".join(fmt_bytes(b) for b in g["per_step"][:8])
            more = " ..." if len(g["per_step"]) > 8 else ""
            lines.append(f"  {fmt_bytes(g['bytes']):>11} {g['count']:>5}x  {g['where']}")
            lines.append(f"  {'':>11}        per step: {per}{more}; still live at the end "
                         f"{fmt_bytes(g['live_at_end'])}")
    if d.get("bounded"):
        lines.append("bounded retention, not a leak (kept a few steps, then freed: it stops "
                     "growing):")
        for g in d["bounded"]:
            lines.append(f"  {fmt_bytes(g['live_at_end']):>11} {g['count']:>5}x  {g['where']}"
                         f"  (each kept {g['kept_steps']} steps; live at the end)")
    if d["long_lived"]:
        lines.append("long-lived, made in one step only:")
        for g in d["long_lived"]:
            kind = f"  [{g['kind']}]" if g.get("kind") else ""
            lines.append(f"  {fmt_bytes(g['bytes']):>11} {g['count']:>5}x  {g['where']}{kind}")
    return "\n".join(lines) + "\n"


def leaks_json(d: dict) -> str:
    return json.dumps(d, indent=2)


__all__ = ["leaks", "leaks_text", "leaks_json"]
