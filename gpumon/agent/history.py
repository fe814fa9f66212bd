"""Who has torch's CUDA allocation history (``_record_memory_history``) on, inside the process.

Three parts of gpumon read that history: a snapshot a client asked for and the OOM flight
recorder (gpumon/agent/snapshot.py), which keep it on with stacks for as long as they record,
and the exact-peak meter of the phases tracker (gpumon/agent/phases/exact.py), which turns on a
trace-only history (no stacks) for the steps it measures and off again after them. The program
may have its own on. The rules:

* Nobody turns off or clears a history it did not turn on, and nobody changes the settings of
  one that is on (max_entries, stacks): the meter reads a history that is already on as it is.
* The meter's temporary history is the only one that can be taken over: a recording that
  starts while it is on (``take_over()``, under ``LOCK``) makes it theirs, with their settings,
  and the meter will neither clear nor stop it.
* Every on/off/clear of the meter and every start of the snapshot part happens under ``LOCK``,
  so a take-over and the meter's stop can never cross.

Standard library only.
"""
from __future__ import annotations

import threading
from typing import Any

LOCK = threading.RLock()
_temporary: Any = None   # the meter whose trace-only history is on, or None


def set_temporary(owner: Any) -> None:
    """The meter's trace-only history is on (owner) or off (None). Caller holds LOCK."""
    global _temporary
    _temporary = owner


def temporary() -> bool:
    """Whether the history that is on is only the meter's trace-only one."""
    return _temporary is not None


def take_over() -> bool:
    """A recording that stays on is starting: the meter's temporary history, if it is on,
    is the caller's from now on (the meter will not clear or stop it). Returns whether there
    was one. Caller holds LOCK."""
    global _temporary
    owner, _temporary = _temporary, None
    if owner is None:
        return False
    try:
        owner.handed_over()
    except Exception:
        pass
    return True
