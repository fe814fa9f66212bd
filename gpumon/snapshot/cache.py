"""A cache of loaded snapshots, as ptmem keeps one: the second `gpumon view` of a file reads its
packed columns and interned stacks back instead of unpickling it again.

What is cached is what load.py hands the analysis for a file read whole (no window): each
device's PackedTrace (its columns as raw bytes, written from the arrays; its table of
distinct stacks) and the rest of the snapshot (segments, annotations, allocator settings),
written with `marshal` (plain data only, read at C speed; it shares the frame dicts the stacks
share). A cache file is found by
the snapshot's absolute path, size and modification time, so a changed file is read again.

The folder is private: ``$GPUMON_VIEW_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpumon/view`` or
``~/.cache/gpumon/view``, made 0700 and used only while it is the user's own and writable by
no one else (marshal data is trusted as much as the folder). It keeps the MAX_FILES most
recently used entries. ``GPUMON_VIEW_CACHE=0`` turns it off. Any failure (a full disk, a
damaged entry) only means the file is read from the snapshot again. Standard library only.
"""
from __future__ import annotations

import hashlib
import marshal
import os
import stat
import sys
from array import array

from .packed import PackedTrace

VERSION = 1          # bump when what is cached changes
MIN_BYTES = 1 << 20  # smaller snapshots load faster than a cache entry is worth
MAX_FILES = 16
_COLUMNS = (("action", "b"), ("addr", "q"), ("size", "q"), ("time_us", "q"), ("fid", "i"))
_SPARSE = ("stream", "compile_context", "user_metadata", "odd_action", "category")


def _enabled() -> bool:
    return os.environ.get("GPUMON_VIEW_CACHE", "1") not in ("0", "no", "off", "")


def cache_dir() -> str:
    d = os.environ.get("GPUMON_VIEW_CACHE_DIR")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gpumon", "view")


def _private(d: str, create: bool) -> bool:
    """The folder is the user's own and no one else can write in it (made so if asked)."""
    try:
        if create:
            os.makedirs(d, 0o700, exist_ok=True)
        st = os.lstat(d)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and \
        not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _key(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_size < MIN_BYTES:
        return None
    ident = f"{VERSION}|{sys.version_info[:2]}|{os.path.abspath(path)}|{st.st_size}|" \
            f"{st.st_mtime_ns}|{st.st_ino}"
    return hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()[:32]


_MAGIC = b"GPUMONVC"


def _pack(t: PackedTrace) -> dict:
    d = {"n": len(t.action), "frames_table": t.frames_table, "skipped": t.skipped}
    for name in _SPARSE:
        d[name] = getattr(t, name)
    return d


def _unpack(d: dict, fh) -> PackedTrace:
    t = PackedTrace()
    n = d["n"]
    if type(n) is not int or n < 0:
        raise ValueError("a bad length")
    for name, code in _COLUMNS:
        col = array(code)
        col.fromfile(fh, n)     # raises EOFError when the entry is short
        setattr(t, name, col)
    t.frames_table = d["frames_table"]
    if not isinstance(t.frames_table, list) or not t.frames_table or \
            t.frames_table[0] is not None or (n and max(t.fid) >= len(t.frames_table)) or \
            (n and min(t.fid) < 0):
        raise ValueError("a bad table of stacks")
    # intern() finds a list by the ids of its frames: the table's lists, read back, are new
    for fid, fr in enumerate(t.frames_table):
        if fid and fr:
            t._fid_by_id[id(fr)] = fid
            t._fid_by_key.setdefault((id(fr[0]), id(fr[-1]), len(fr)), []).append(fid)
    t.skipped = int(d["skipped"])
    for name in _SPARSE:
        v = d[name]
        if not isinstance(v, dict):
            raise ValueError(f"a bad {name}")
        setattr(t, name, v)
    return t


def load(path: str) -> dict | None:
    """The cached snapshot of `path` (load.py's dict: device_traces as PackedTrace), or None."""
    if not _enabled():
        return None
    key = _key(path)
    d = cache_dir()
    if key is None or not _private(d, False):
        return None
    f = os.path.join(d, key + ".cache")
    try:
        with open(f, "rb") as fh:
            head = fh.read(16)
            if len(head) != 16 or head[:8] != _MAGIC:
                raise ValueError("not a cache entry")
            length = int.from_bytes(head[8:], "little")
            obj = marshal.loads(fh.read(length))
            if not isinstance(obj, dict) or obj.get("version") != VERSION:
                raise ValueError("another version")
            data = obj["data"]
            data["device_traces"] = [_unpack(t, fh) for t in obj["traces"]]
        os.utime(f)   # most recently used
        return data
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a damaged or foreign entry: read the snapshot again
        try:
            os.unlink(f)
        except OSError:
            pass
        return None


def store(path: str, data: dict) -> None:
    """Keep `data` (a whole load of `path`) for the next view of the same file. The columns go
    to the file straight from their arrays (no copy in memory); marshal writes the rest."""
    if not _enabled() or data.get("_gpumon_window"):
        return
    traces = data.get("device_traces")
    if not isinstance(traces, list) or not all(isinstance(t, PackedTrace) for t in traces):
        return
    key = _key(path)
    d = cache_dir()
    if key is None or not _private(d, True):
        return
    rest = {k: v for k, v in data.items() if k != "device_traces"}
    tmp = os.path.join(d, f".{key}.{os.getpid()}.tmp")
    try:
        blob = marshal.dumps({"version": VERSION, "data": rest,
                              "traces": [_pack(t) for t in traces]})
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(_MAGIC + len(blob).to_bytes(8, "little"))
            fh.write(blob)
            del blob
            for t in traces:
                for name, _code in _COLUMNS:
                    getattr(t, name).tofile(fh)
        os.replace(tmp, os.path.join(d, key + ".cache"))
        _trim(d)
    except Exception:  # noqa: BLE001 - no cache this time, nothing else changes
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _trim(d: str) -> None:
    entries = []
    for name in os.listdir(d):
        if name.endswith(".cache"):
            p = os.path.join(d, name)
            try:
                entries.append((os.stat(p).st_mtime, p))
            except OSError:
                pass
    entries.sort()
    for _t, p in entries[:-MAX_FILES]:
        try:
            os.unlink(p)
        except OSError:
            pass


__all__ = ["load", "store", "cache_dir"]
