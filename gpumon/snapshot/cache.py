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

import marshal
import os
import stat
import sys
import zlib
from array import array

try:  # CPython's own SHA-256, built in: hashlib loads OpenSSL first (2 ms of a 40 ms start)
    from _sha2 import sha256 as _sha256          # 3.12+
except ImportError:
    try:
        from _sha256 import sha256 as _sha256    # 3.11
    except ImportError:
        from hashlib import sha256 as _sha256

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
    return _sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()[:32]


_MAGIC = b"GPUMONVC"


def _pack(t) -> dict:
    d = {"n": len(t.action), "frames_table": t.frames_table, "skipped": t.skipped}
    for name in _SPARSE:
        d[name] = getattr(t, name)
    return d


def _unpack(d: dict, fh):
    from .packed import PackedTrace
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
            key = (id(fr[0]), id(fr[-1]), len(fr))
            t._fid_by_key.setdefault(key, []).append(fid)
            t._note_key(key, fr, fid)
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


_deferred: list | None = None


def defer_writes() -> None:
    """Hold the entries written from now on until flush(): the interactive view writes them
    when it ends (a few ms of a cold start, and no lock held while its first screen takes
    keys)."""
    global _deferred
    _deferred = []


def flush() -> None:
    global _deferred
    todo, _deferred = _deferred or [], None
    for fn, args in todo:
        fn(*args)


def _defer(fn, *args) -> bool:
    if _deferred is None:
        return False
    _deferred.append((fn, args))
    return True


def store(path: str, data: dict) -> None:
    """Keep `data` (a whole load of `path`) for the next view of the same file. The columns go
    to the file straight from their arrays (no copy in memory); marshal writes the rest."""
    if not _enabled() or data.get("_gpumon_window"):
        return
    if _defer(store, path, dict(data)):   # (a copy: the caller takes its note out of it)
        return
    from .packed import PackedTrace
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


def _trim(d: str, suffix: str = ".cache", keep: int = MAX_FILES) -> None:
    entries = []
    for name in os.listdir(d):
        if name.endswith(suffix):
            p = os.path.join(d, name)
            try:
                entries.append((os.stat(p).st_mtime, p))
            except OSError:
                pass
    entries.sort()
    for _t, p in entries[:-keep]:
        try:
            os.unlink(p)
        except OSError:
            pass


# -- what `gpumon view FILE --summary/--json` printed ------------------------------------------
# The second `--summary` of a file prints what the first printed, without loading, replaying or
# analysing it again (most of a warm run's time; imports included: this part of the module
# imports nothing of gpumon's analysis). An entry is plain bytes, never unpickled or
# unmarshalled: a magic line, the SHA-256 of the rest, then length-prefixed UTF-8 fields (the
# full identity it was made for, then the outputs). Its identity: the snapshot's absolute path,
# size, modification time, inode and a hash of its first 64 KiB; the same of the sidecars
# gpumon would read beside it; the options that shape the summary; Python's and gpumon's
# versions and the size and modification time of every module of gpumon.snapshot and of the
# view command (an edited gpumon makes new entries). A damaged, foreign or stale entry is
# ignored, removed and written again by the run that then reads the snapshot.

_SUM_MAGIC = b"GPUMONSUMMARY1\n"
_SUM_SUFFIX = ".summary"
MAX_SUMMARIES = 64
_HEAD = 64 << 10


def _file_ident(p: str, head: bool) -> str:
    try:
        st = os.stat(p)
    except OSError:
        return "-"
    out = f"{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"
    if head:
        try:
            with open(p, "rb") as f:
                out += "|" + _sha256(f.read(_HEAD)).hexdigest()
        except OSError:
            return "-"
    return out


_code_ident_memo: list = []


def _code_ident() -> str:
    """gpumon's version and the state of the code that writes the summary."""
    if not _code_ident_memo:
        _code_ident_memo.append(_code_ident_now())
    return _code_ident_memo[0]


def _code_ident_now() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    view = os.path.join(os.path.dirname(here), "commands", "view.py")
    parts = []
    try:
        names = sorted(n for n in os.listdir(here) if n.endswith(".py"))
    except OSError:
        return "?"
    for p in [os.path.join(here, n) for n in names] + [view]:
        try:
            st = os.stat(p)
        except OSError:
            continue
        parts.append(f"{os.path.basename(p)}:{st.st_size}:{st.st_mtime_ns}")
    from gpumon import __version__
    return f"{__version__}|{sys.version_info[:3]}|" + ",".join(parts)


def summary_ident(path: str, options: str) -> str | None:
    """The full identity of the summary of `path` with `options` (None: the file is gone)."""
    ap = os.path.abspath(path)
    snap = _file_ident(ap, True)
    if snap == "-":
        return None
    root = os.path.splitext(ap)[0]
    sides = [_file_ident(c, False) for c in (ap + ".json", root + ".json")]
    return "\n".join([f"v{VERSION}", ap, snap, *sides, options, _code_ident()])


def _summary_file(ident: str) -> str:
    h = _sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return os.path.join(cache_dir(), h + _SUM_SUFFIX)


def _fields(body: bytes) -> list[bytes]:
    out, k = [], 0
    while k < len(body):
        if k + 8 > len(body):
            raise ValueError("a cut field")
        n = int.from_bytes(body[k:k + 8], "little")
        if k + 8 + n > len(body):
            raise ValueError("a cut field")
        out.append(body[k + 8:k + 8 + n])
        k += 8 + n
    return out


def summary_get(ident: str | None) -> list[str] | None:
    """The outputs kept for `ident` (summary_put's list), or None (no entry: make it)."""
    if ident is None or not _enabled() or not _private(cache_dir(), False):
        return None
    f = _summary_file(ident)
    try:
        with open(f, "rb") as fh:
            data = fh.read(64 << 20)
    except OSError:
        return None
    try:
        if not data.startswith(_SUM_MAGIC):
            raise ValueError("not a summary entry")
        k = len(_SUM_MAGIC)
        digest, body = data[k:k + 64], data[k + 65:]
        if data[k + 64:k + 65] != b"\n" or \
                _sha256(body).hexdigest().encode() != digest:
            raise ValueError("damaged")
        fields = [b.decode("utf-8", "surrogateescape") for b in _fields(body)]
        if not fields or fields[0] != ident:
            raise ValueError("another file's")
        try:
            os.utime(f)   # most recently used
        except OSError:
            pass
        return fields[1:]
    except (ValueError, UnicodeError):
        try:
            os.unlink(f)
        except OSError:
            pass
        return None


def summary_put(ident: str | None, outputs: list[str]) -> None:
    """Keep `outputs` (strings) for the next summary_get(ident). Never fails the caller."""
    if ident is None or not _enabled():
        return
    d = cache_dir()
    if not _private(d, True):
        return
    body = b"".join(len(b).to_bytes(8, "little") + b for b in
                    (x.encode("utf-8", "surrogateescape") for x in [ident, *outputs]))
    f = _summary_file(ident)
    tmp = f"{f}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(_SUM_MAGIC + _sha256(body).hexdigest().encode() + b"\n" + body)
        os.replace(tmp, f)
        _trim(d, _SUM_SUFFIX, MAX_SUMMARIES)
    except Exception:  # noqa: BLE001 - no cache this time, nothing else changes
        try:
            os.unlink(tmp)
        except OSError:
            pass


# -- a device's replay: what the first screen needs ----------------------------------------------
# The allocated and reserved bytes after every event, the bytes live at the start and the
# peak (the first screen and its keys need only these; the allocation elements are replayed
# when first asked for). Kept for a file whose load is cached (the same identity), with the
# code's state in the name; an entry is its CRC-32 (against damage: the folder is the user's
# own, see above; 1.4 ms less than SHA-256 for 0.6 MB), then the figures and the columns as
# raw int64, checked against each other before use (a damaged entry is removed and made again).

_REPLAY_MAGIC = b"GPUMONREPLAY2\n"


def _replay_file(path: str, device: int) -> str | None:
    key = _key(path)
    if key is None:
        return None
    h = _sha256(f"{key}|{device}|{_code_ident()}".encode()).hexdigest()[:32]
    return os.path.join(cache_dir(), h + ".replay")


def replay_get(path: str, device: int) -> tuple | None:
    """(allocated, base, peak, peak_index, reserved) of device's trace, as an earlier replay
    made them, or None."""
    if not _enabled() or not _private(cache_dir(), False):
        return None
    f = _replay_file(path, device)
    if f is None:
        return None
    try:
        with open(f, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    try:
        k = len(_REPLAY_MAGIC)
        if not data.startswith(_REPLAY_MAGIC) or \
                zlib.crc32(data[k + 4:]).to_bytes(4, "little") != data[k:k + 4]:
            raise ValueError("damaged")
        body = data[k + 4:]
        base, peak, peak_index, n = (int.from_bytes(body[i:i + 8], "little", signed=True)
                                     for i in (0, 8, 16, 24))
        if n < 0 or len(body) != 32 + 16 * n:
            raise ValueError("cut")
        allocated, reserved = array("q"), array("q")
        allocated.frombytes(body[32:32 + 8 * n])
        reserved.frombytes(body[32 + 8 * n:])
        if n and not (0 <= peak_index < n and allocated[peak_index] == peak == max(allocated)
                      and allocated.index(peak) == peak_index and min(reserved) >= 0):
            raise ValueError("inconsistent")
        if not n and peak_index != -1:
            raise ValueError("inconsistent")
        try:
            os.utime(f)
        except OSError:
            pass
        return allocated, base, peak, peak_index, reserved
    except ValueError:
        try:
            os.unlink(f)
        except OSError:
            pass
        return None


def replay_put(path: str, device: int, allocated, base: int, peak: int,
               peak_index: int, reserved) -> None:
    if not _enabled() or _defer(replay_put, path, device, allocated, base, peak, peak_index,
                                reserved):
        return
    d = cache_dir()
    f = _replay_file(path, device)
    if f is None or allocated.itemsize != 8 or reserved.itemsize != 8 or \
            len(reserved) != len(allocated) or not _private(d, True):
        return
    tmp = f"{f}.{os.getpid()}.tmp"
    try:
        body = b"".join(int(v).to_bytes(8, "little", signed=True)
                        for v in (base, peak, peak_index, len(allocated))) + \
            allocated.tobytes() + reserved.tobytes()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(_REPLAY_MAGIC + zlib.crc32(body).to_bytes(4, "little") + body)
        os.replace(tmp, f)
        _trim(d, ".replay", MAX_FILES * 2)
    except Exception:  # noqa: BLE001 - no entry this time, nothing else changes
        try:
            os.unlink(tmp)
        except OSError:
            pass


__all__ = ["load", "store", "cache_dir", "summary_ident", "summary_get", "summary_put",
           "replay_get", "replay_put"]
