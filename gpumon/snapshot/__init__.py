"""Safe loading and analysis of PyTorch memory snapshots. Imports neither torch nor textual."""
from __future__ import annotations

import os

_LAZY = {"DeviceTrace": "analysis", "Group": "analysis", "SegmentInfo": "analysis",
         "Snapshot": "analysis", "fmt_bytes": "analysis", "fmt_frame": "analysis",
         "SnapshotError": "load", "load_snapshot": "load"}


def __getattr__(name: str):
    # imported when first used: `gpumon view FILE --summary` answered from its cache
    # (cache.py) imports none of the analysis
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def open_snapshot(path: str | os.PathLike, max_bytes: int | None = None,
                  progress=None, window: int | None = None,
                  window_at: int | None = None, window_total: int | None = None) -> Snapshot:
    """Load a snapshot file safely (see load.py) with its OOM sidecar JSON, if any.
    `progress(done, total)`: bytes of the file read so far, for a progress display.
    `window`: keep at most that many events per device, around the peak or `window_at`
    (a trace longer than that is read twice; see window.py; `window_total`, the trace's length
    when known from an earlier read, saves the first pass)."""
    from .analysis import Snapshot
    from .load import load_snapshot
    from .report import load_sidecar
    p = os.fspath(path)
    side, note = load_sidecar(p, with_note=True)
    s = Snapshot(load_snapshot(p, max_bytes, progress, window, window_at,
                                  window_total), p, side)
    s.sidecar_note = note   # a file beside it that is not gpumon's sidecar, or None
    s.load_note = s.data.pop("_gpumon_note", None)   # read whole, not streamed: why
    s.open_args = {"max_bytes": max_bytes, "window": window}
    return s


__all__ = ["open_snapshot", "Snapshot", "DeviceTrace", "Group", "SegmentInfo", "SnapshotError",
           "load_snapshot", "fmt_bytes", "fmt_frame"]
