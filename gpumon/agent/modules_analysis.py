"""The per-module measurement's analysis (gpumon/agent/modules.py documents the result): replay
the allocation history of the measured steps through gpumon's allocator model, give every
allocation the module context it was made in (from the hooks' marks, pinned by torch's
allocation counters), and split the peak. Pure Python, standard library only; runs on the
training thread once, after the last measured step.
"""
from __future__ import annotations

import time
from typing import Any

from gpumon.agent.phases.replay import (FREE_DONE, SEG_ALLOC, SEG_FREE, Inconsistent,
                                        window_start)

KMIN = 512
INF = float("inf")
# context kinds
BEFORE, OTHER, FORWARD, BACKWARD, OPTIMIZER = range(5)
KIND_PHASE = {BEFORE: "other", OTHER: "other", FORWARD: "forward", BACKWARD: "backward",
              OPTIMIZER: "optimizer"}


def _r512(n: int) -> int:
    return KMIN if n < KMIN else (n + KMIN - 1) // KMIN * KMIN


class _Fenwick:
    """Live requested bytes by allocation index (suffix sums: what was allocated since an
    index and is still live)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.t = [0] * (n + 1)
        self.total = 0

    def add(self, i: int, v: int) -> None:
        self.total += v
        i += 1
        while i <= self.n:
            self.t[i] += v
            i += i & -i

    def prefix(self, i: int) -> int:  # sum of [0, i)
        s = 0
        while i > 0:
            s += self.t[i]
            i -= i & -i
        return s

    def since(self, i: int) -> int:
        return self.total - self.prefix(i)


class _Frame:
    __slots__ = ("path", "start", "max", "rec")

    def __init__(self, path: str, start: int, rec: int) -> None:
        self.path, self.start, self.max, self.rec = path, start, start, rec


def _persistent_only(meas: Any, note: str | None) -> dict:
    mods = _module_rows(meas, {}, {}, {}, {}, {})
    return {"ok": True, "error": None, "t": time.time(), "device": meas.dev,
            "steps": meas.steps, "exact": False, "note": note, "peak": None, "peak_step": None,
            "peak_phase": None, "peak_stack": [], "at_peak": None, "modules": mods,
            "compiled": list(meas.names.compiled), "_entries": 0}


def analyse(meas: Any, snap: dict | None) -> dict:
    if meas._model is None or snap is None:
        return _persistent_only(meas, meas._note)
    try:
        return _analyse(meas, snap)
    except Inconsistent as e:
        return _persistent_only(meas, f"the allocation history could not be replayed ({e}): "
                                      "parameters, gradients and optimizer state only")


def _analyse(meas: Any, snap: dict) -> dict:
    dev = meas.dev
    traces = snap.get("device_traces") or []
    trace = traces[dev] if dev < len(traces) else []
    base_a, base_f = meas._base
    end = getattr(meas, "end_counts", None)
    if end is None:
        raise Inconsistent("no counters at the measurement's end")
    i0 = window_start(trace, end[0] - base_a, end[1] - base_f)
    if i0 is None:
        raise Inconsistent("the history lost entries of the measured steps")
    entries = trace[i0:]
    model = meas._model
    marks = [(c, e) for c, e in meas.marks if c is not None]

    # allocation records: parallel lists
    r_addr: list[int] = []
    r_block: list[int] = []
    r_req: list[int] = []
    r_ctx: list[int] = []
    r_aseq: list[float] = []
    r_fseq: list[float] = []
    live: dict[int, int] = {}   # addr -> record
    for addr, size in model.live.items():
        live[addr] = len(r_addr)
        r_addr.append(addr)
        r_block.append(size)
        r_req.append(size)
        r_ctx.append(0)
        r_aseq.append(-1)
        r_fseq.append(INF)
    ctxs: list[tuple] = [(BEFORE, ())]
    ctx_ids: dict[tuple, int] = {ctxs[0]: 0}
    fen = _Fenwick(len(r_addr) + len(entries) + 1)
    for k in range(len(r_addr)):
        fen.add(k, r_req[k])

    fstack: list[_Frame] = []
    bstack: list[_Frame] = []
    in_bwd = in_opt = fwd_done = False
    step = 0
    cur = model.allocated
    seq = 0
    end_seq: dict[int, int] = {0: 0}
    # per (step, path): forward retained (sum over calls), transients (max over calls)
    retained: dict = {}
    fwd_tr: dict = {}
    bwd_tr: dict = {}
    peak = -1
    peak_seq = -1
    peak_step = None
    peak_ctx = 0
    ctx = 1

    def context() -> int:
        if in_opt:
            key = (OPTIMIZER, ())
        elif bstack:
            key = (BACKWARD, tuple(f.path for f in bstack))
        elif fstack and not in_bwd:
            key = (FORWARD, tuple(f.path for f in fstack))
        elif in_bwd:
            key = (BACKWARD, ())
        elif fwd_done:
            key = (FORWARD, ())  # after the model returned, before backward: the loss
        else:
            key = (OTHER, ())
        c = ctx_ids.get(key)
        if c is None:
            c = ctx_ids[key] = len(ctxs)
            ctxs.append(key)
        return c

    def close(stack: list, path: str, table: dict, forward: bool) -> None:
        for j in range(len(stack) - 1, -1, -1):
            if stack[j].path == path:
                break
        else:
            return
        # frames above it (whose end never came) end with it
        while len(stack) > j:
            f = stack.pop()
            key = (step + 1, f.path)
            tr = f.max - f.start
            if tr > table.get(key, -1):
                table[key] = tr
            if forward:
                retained[key] = retained.get(key, 0) + fen.since(f.rec)
            if stack:
                stack[-1].max = max(stack[-1].max, f.max)

    def apply_mark(ev: tuple) -> None:
        nonlocal in_bwd, in_opt, step, fwd_done
        kind = ev[0]
        if kind == "fwd":
            _, enter, path, bw = ev
            if bw:  # recomputation inside backward: a backward frame
                if enter:
                    bstack.append(_Frame(path, cur, len(r_addr)))
                else:
                    close(bstack, path, bwd_tr, False)
            elif enter:
                fstack.append(_Frame(path, cur, len(r_addr)))
            else:
                close(fstack, path, fwd_tr, True)
                fwd_done = not fstack
        elif kind == "bwd":
            _, enter, path = ev
            in_bwd, fwd_done = True, False
            if enter:
                if not any(f.path == path for f in bstack):
                    bstack.append(_Frame(path, cur, len(r_addr)))
            else:
                close(bstack, path, bwd_tr, False)
        elif kind == "bwend":
            while bstack:
                close(bstack, bstack[-1].path, bwd_tr, False)
            in_bwd = False
        elif kind == "opt":
            in_opt = bool(ev[1])
            if in_opt:
                fstack.clear()
                in_bwd = fwd_done = False
        elif kind == "end":
            step = ev[1]
            end_seq[step] = seq
            in_opt = fwd_done = False

    ca, cf = base_a, base_f
    mi = 0
    nm = len(marks)

    def reach() -> None:
        nonlocal mi, ctx
        changed = False
        while mi < nm and marks[mi][0][0] == ca and marks[mi][0][1] == cf:
            apply_mark(marks[mi][1])
            mi += 1
            changed = True
        if changed:
            ctx = context()

    ctx = context()
    reach()
    steps = meas.steps
    for e in entries:
        act = e.get("action")
        if act == "alloc":
            addr, size = e["addr"], e["size"]
            d = model.apply(0, addr, size)
            cur += d
            seq += 1
            k = len(r_addr)
            live[addr] = k
            r_addr.append(addr)
            r_block.append(d)
            req = _r512(size)
            r_req.append(req)
            r_ctx.append(ctx)
            r_aseq.append(seq)
            r_fseq.append(INF)
            fen.add(k, req)
            if bstack and cur > bstack[-1].max:
                bstack[-1].max = cur
            if fstack and cur > fstack[-1].max:
                fstack[-1].max = cur
            if 0 < step + 1 <= steps and cur > peak:
                peak, peak_seq, peak_step, peak_ctx = cur, seq, step + 1, ctx
            ca += 1
            reach()
        elif act == "free_requested":
            addr = e["addr"]
            d = model.apply(1, addr, e.get("size", 0))
            cur += d
            seq += 1
            k = live.pop(addr, None)
            if k is not None:
                r_fseq[k] = seq
                fen.add(k, -r_req[k])
            cf += 1
            reach()
        elif act == "free_completed":
            model.apply(FREE_DONE, e["addr"], 0)
        elif act == "segment_alloc":
            model.apply(SEG_ALLOC, e["addr"], e["size"])
        elif act == "segment_free":
            model.apply(SEG_FREE, e["addr"], e["size"])
        if mi >= nm:
            break
    if mi < nm:
        raise Inconsistent(f"the history ends before the measured steps do ({mi} of {nm} marks)")
    if peak_step is None:
        return _persistent_only(meas, "no allocation during the measured steps")

    # ---- the peak, part by part
    walk = meas.walks[peak_step - 1] if peak_step - 1 < len(meas.walks) else {}
    step_end = end_seq.get(peak_step, seq)
    from gpumon.agent.modules import PEAK_PARTS
    parts = dict.fromkeys(PEAK_PARTS, 0)
    act_peak: dict[str, int] = {}
    bwd_peak: dict[str, int] = {}
    pers_peak: dict[str, dict] = {}
    total = 0
    for k in range(len(r_addr)):
        if not (r_aseq[k] <= peak_seq < r_fseq[k]):
            continue
        block = r_block[k]
        total += block
        owners = walk.get(r_addr[k]) if r_fseq[k] > step_end else None
        if owners:
            used = 0
            for role, path, nbytes in owners:
                parts[role] += nbytes
                pp = pers_peak.setdefault(path, {})
                pp[role] = pp.get(role, 0) + nbytes
                used += nbytes
            parts["rounding"] += block - used
            continue
        kind, stack = ctxs[r_ctx[k]]
        req = min(r_req[k], block)
        parts["rounding"] += block - req
        if kind == FORWARD:
            if stack:
                parts["activations"] += req
                act_peak[stack[-1]] = act_peak.get(stack[-1], 0) + req
            else:
                parts["outside_forward"] += req
        elif kind == BACKWARD:
            if stack:
                parts["backward"] += req
                bwd_peak[stack[-1]] = bwd_peak.get(stack[-1], 0) + req
            else:
                parts["outside_backward"] += req
        elif kind == OPTIMIZER:
            parts["optimizer_temporaries"] += req
        elif kind == OTHER:
            parts["other"] += req
        else:
            parts["before_step"] += req
    note = meas._note
    if total != peak:
        note = f"the parts sum to {total} bytes where the allocator held {peak}"
    kind, stack = ctxs[peak_ctx]
    sel = peak_step

    def pick(table: dict) -> dict:
        return {p: v for (s, p), v in table.items() if s == sel}
    mods = _module_rows(meas, act_peak, bwd_peak, pick(retained), pick(fwd_tr), pick(bwd_tr))
    return {"ok": True, "error": None, "t": time.time(), "device": dev, "steps": steps,
            "exact": total == peak, "note": note, "peak": peak, "peak_step": peak_step,
            "peak_phase": KIND_PHASE[kind], "peak_stack": list(stack), "at_peak": parts,
            "modules": mods, "compiled": list(meas.names.compiled), "_entries": len(entries)}


def _module_rows(meas: Any, act_peak: dict, bwd_peak: dict, retained: dict, fwd_tr: dict,
                 bwd_tr: dict) -> list:
    from gpumon.agent.modules import MAX_MODULES
    paths = set(meas.persist) | set(meas._calls) | set(act_peak) | set(bwd_peak)
    rows = []
    for p in paths:
        pr = meas.persist.get(p, {})
        rows.append({
            "path": p, "type": meas._types.get(p, "?"), "calls": meas._calls.get(p, 0),
            "params": pr.get("parameters", 0), "buffers": pr.get("buffers", 0),
            "grads": pr.get("gradients", 0), "optimizer_state": pr.get("optimizer_state", 0),
            "act_at_peak": act_peak.get(p, 0), "bwd_at_peak": bwd_peak.get(p, 0),
            "fwd_retained": retained.get(p), "fwd_transient": fwd_tr.get(p),
            "bwd_transient": bwd_tr.get(p)})
    if len(rows) > MAX_MODULES:
        rows.sort(key=lambda r: -(r["params"] + r["grads"] + r["optimizer_state"]
                                  + r["act_at_peak"] + r["bwd_at_peak"]))
        rows = rows[:MAX_MODULES]
    rows.sort(key=lambda r: r["path"])
    return rows
