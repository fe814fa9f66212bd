"""Safe loading of torch memory snapshots (the pickles `torch.cuda.memory._dump_snapshot` writes).

A snapshot is plain data (dict, list, tuple, str, int, float, bool, None), so it is read with an
Unpickler whose `find_class` always raises: a pickle that names any class or function (the only
way a pickle can run code: GLOBAL/STACK_GLOBAL/INST/OBJ/REDUCE/EXT all need a callable that
only `find_class` can supply) is refused before anything is called. torch is never imported.
"""
from __future__ import annotations

import gzip
import io
import os
import pickle

GZIP_MAGIC = b"\x1f\x8b"
# The first byte of a pickle of a dict or list (PROTO for protocol 2+, or protocol 0/1 starts);
# used only to word the error for a file that failed to load.
_PICKLE_FIRST = set(b"\x80(}]")
DEFAULT_MAX_BYTES = 8 << 30  # a snapshot larger than this is almost surely not one


class SnapshotError(Exception):
    """A snapshot file that cannot be read; the message is one line fit for the user."""


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):  # noqa: D401 - pickle API
        raise SnapshotError(
            f"refused: the file names the Python object {module}.{name}, which a memory "
            "snapshot never does (it may be a hostile pickle); nothing in it was run")

    def persistent_load(self, pid):
        raise SnapshotError("refused: the file uses pickle persistent ids, which a memory "
                            "snapshot never does; nothing in it was run")


def loads_plain(data: bytes):
    """Unpickle bytes that must hold plain data only. Raises SnapshotError."""
    try:
        return _PlainDataUnpickler(io.BytesIO(data)).load()
    except SnapshotError:
        raise
    except EOFError:
        raise SnapshotError("the file is truncated (the pickle ends early)") from None
    except RecursionError:
        raise SnapshotError("the file nests too deeply to be a memory snapshot") from None
    except MemoryError:
        raise SnapshotError("not enough memory to load this file") from None
    except (pickle.UnpicklingError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, UnicodeDecodeError, OverflowError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SnapshotError(f"the file is corrupt or not a pickle ({msg})") from None


def read_bytes(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The file's pickle bytes (gunzipped when the file is gzip'd), with size guards."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            raise SnapshotError(
                f"{path}: {size / 2**30:.1f} GiB is larger than the {max_bytes / 2**30:.0f} GiB "
                "limit for a snapshot (GPUMON_VIEW_MAX_BYTES raises it)")
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            if head == GZIP_MAGIC:
                with gzip.GzipFile(fileobj=f) as g:
                    data = g.read(max_bytes + 1)
                if len(data) > max_bytes:
                    raise SnapshotError(f"{path}: unpacks to more than the "
                                        f"{max_bytes / 2**30:.0f} GiB limit for a snapshot")
            else:
                data = f.read()
    except SnapshotError:
        raise
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SnapshotError(f"{path}: is a directory, not a snapshot file") from None
    except PermissionError:
        raise SnapshotError(f"{path}: permission denied") from None
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise SnapshotError(f"{path}: cannot read ({e})") from None
    if not data:
        raise SnapshotError(f"{path}: the file is empty")
    return data


def max_bytes_from_env() -> int:
    v = os.environ.get("GPUMON_VIEW_MAX_BYTES")
    try:
        return int(float(v)) if v else DEFAULT_MAX_BYTES
    except ValueError:
        return DEFAULT_MAX_BYTES


def load_snapshot(path: str | os.PathLike, max_bytes: int | None = None) -> dict:
    """Load and shape-check a snapshot. Returns the dict with at least `segments` (list) and
    `device_traces` (list of lists). Raises SnapshotError with a one-line message."""
    data = read_bytes(path, max_bytes if max_bytes is not None else max_bytes_from_env())
    try:
        obj = loads_plain(data)
    except SnapshotError as e:
        if data[0] not in _PICKLE_FIRST and "names the Python object" not in str(e):
            raise SnapshotError(f"{os.fspath(path)}: not a pickle (a memory snapshot is the "
                                ".pickle file written by torch.cuda.memory._dump_snapshot)") \
                from None
        raise SnapshotError(f"{os.fspath(path)}: {e}") from None
    del data
    return normalize(obj, os.fspath(path))


def normalize(obj, where: str = "snapshot") -> dict:
    if isinstance(obj, list):  # segments only (torch.cuda.memory_snapshot() pickled by hand)
        obj = {"segments": obj, "device_traces": []}
    if not isinstance(obj, dict):
        raise SnapshotError(f"{where}: holds a {type(obj).__name__}, not a memory snapshot "
                            "(a dict with 'segments' and 'device_traces')")
    if "segments" not in obj and "device_traces" not in obj:
        keys = ", ".join(sorted(map(str, obj))[:6])
        raise SnapshotError(f"{where}: not a memory snapshot (no 'segments' or "
                            f"'device_traces'; keys: {keys})")
    segs = obj.get("segments")
    traces = obj.get("device_traces")
    if segs is None:
        segs = []
    if traces is None:
        traces = []
    if not isinstance(segs, list) or not all(isinstance(s, dict) for s in segs):
        raise SnapshotError(f"{where}: 'segments' is not a list of segment records")
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotError(f"{where}: 'device_traces' is not a list of per-device event lists")
    obj["segments"] = segs
    obj["device_traces"] = traces
    return obj
