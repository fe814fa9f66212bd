"""The spike finder's verdicts (gpumon/agent/phases/spikes.py finds them, over every step) as
clients show them: "step 4,102 (eval) peaked at +3.1 GiB in forward". Pure data.

An entry (a step event's ``spike``; ``spikes`` and ``worst_steps`` of a breakdown event)::

    {"step": int, "peak": int, "above": int|null (bytes over the steady state), "steady":
     int|null, "phase": str|null (null unless exact), "exact": bool, "tags": [str], "t": float}
"""
from __future__ import annotations

from typing import Any


def _h(n: int) -> str:
    v = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            s = f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
            return ("-" if n < 0 else "") + s
        v /= 1024
    return str(n)


def describe(e: dict) -> str:
    """'step 4,102 (eval) peaked at +3.1 GiB in forward'; a step whose peak is a lower bound
    names no phase ('peaked at >= +3.1 GiB, phase unknown')."""
    tags = f" ({', '.join(e['tags'])})" if e.get("tags") else ""
    above = e.get("above")
    amount = f"+{_h(above)}" if above is not None else _h(e["peak"])
    if e.get("exact") and e.get("phase"):
        where = f" in {e['phase']}"
    else:
        amount, where = ">= " + amount, ", phase unknown"
    return f"step {e['step']:,}{tags} peaked at {amount}{where}"


def from_wire(items: Any) -> list[dict]:
    """Spike entries from an event, keeping only well-formed ones (client side)."""
    out = []
    for e in items if isinstance(items, list) else []:
        if isinstance(e, dict) and type(e.get("step")) is int and \
                isinstance(e.get("peak"), int):
            out.append(e)
    return out
