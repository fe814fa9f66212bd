"""Safe loading and analysis of PyTorch memory snapshots. Imports neither torch nor textual."""
from __future__ import annotations

import os

from .analysis import DeviceTrace, Group, SegmentInfo, Snapshot, fmt_bytes, fmt_frame
from .load import SnapshotError, load_snapshot


def open_snapshot(path: str | os.PathLike, max_bytes: int | None = None,
                  progress=None) -> Snapshot:
    """Load a snapshot file safely (see load.py) with its OOM sidecar JSON, if any.
    `progress(done, total)`: bytes of the file read so far, for a progress display."""
    from .report import load_sidecar
    p = os.fspath(path)
    return Snapshot(load_snapshot(p, max_bytes, progress), p, load_sidecar(p))


__all__ = ["open_snapshot", "Snapshot", "DeviceTrace", "Group", "SegmentInfo", "SnapshotError",
           "load_snapshot", "fmt_bytes", "fmt_frame"]
