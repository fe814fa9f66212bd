"""Safe loading of torch memory snapshots (the pickles `torch.cuda.memory._dump_snapshot` writes).

A snapshot is plain data (dict, list, tuple, str, int, float, bool, None), so it is read with an
Unpickler whose `find_class` always raises: a pickle that names any class or function (the only
way a pickle can run code: GLOBAL/STACK_GLOBAL/INST/OBJ/REDUCE/EXT all need a callable that
only `find_class` can supply) is refused before anything is called. torch is never imported.

Torch's own files are streamed (`_stream_load`, below): the same restricted Unpickler reads a
rewritten byte stream and each device's trace events are packed into columns (PackedTrace) as
they arrive, so the file is never in memory whole and no event dict outlives its 64 KiB chunk.
"""
from __future__ import annotations

import gc
import gzip
import io
import os
import pickle
import re
from contextlib import contextmanager
from itertools import repeat

from .packed import PackedTrace

GZIP_MAGIC = b"\x1f\x8b"
# The first byte of a pickle of a dict or list (PROTO for protocol 2+, or protocol 0/1 starts);
# used only to word the error for a file that failed to load.
_PICKLE_FIRST = set(b"\x80(}]")


def _opcodes() -> set:
    """The first bytes of pickle's opcodes (pickletools is imported only for a file that the
    stream could not read: every view would pay for it)."""
    import pickletools
    return {op.code.encode("latin-1")[0] for op in pickletools.opcodes}
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


# -- budgets relative to the file's size ------------------------------------------------------
# A plain-data pickle cannot run code, but a small one can still ask for a lot: a gzip of zeros
# unpacks to a thousand times its size, a stream of NONE opcodes costs 8 bytes of memory per
# byte, and a few BINGETs of the same list make a 40 KB file a tree of billions of entries
# for whatever walks it (the analysis). Each is bounded relative to the file's size, and the
# loader says in one line which bound it stopped at.
GZIP_MAX_RATIO = 256        # a gzip'd snapshot unpacks to at most this many times its size
RSS_MIN = 1 << 30           # the load may always grow the process by this much
RSS_PER_BYTE = 64           # ... or by this many bytes per byte of the file on disk
RSS_AVAILABLE = 0.8         # and never past this share of the memory available at its start
TREE_MIN = 4_000_000        # entries (list items, dict values) counted once per reference
TREE_PER_BYTE = 16          # ... or this many per byte of pickle
MAX_DEPTH = 100             # a snapshot nests ~8 deep (dict, list, dict, blocks, frames, frame)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class _BudgetError(SnapshotError):
    """A bound of the file's budget was reached: the answer, whichever way it is read."""


class _Budget:
    """The bytes a load has read (unpacked) and the memory it has taken, against the file's
    size: a gzip unpacks to at most GZIP_MAX_RATIO times its size; the process grows by at
    most RSS_PER_BYTE per byte of the file (RSS_MIN at least), and never past RSS_AVAILABLE of
    the memory available when the load began."""

    def __init__(self, path: str, size: int, gz: bool) -> None:
        self.path, self.size, self.gz = path, size, gz
        self.rss0 = _rss()
        self.rss_max = max(RSS_MIN, RSS_PER_BYTE * size)
        avail = _available()
        if avail:
            self.rss_max = min(self.rss_max, max(256 << 20, int(RSS_AVAILABLE * avail)))
        self.next_check = 0

    def read(self, total: int) -> None:
        if self.gz and total > max(64 << 20, GZIP_MAX_RATIO * self.size):
            raise _BudgetError(
                f"{self.path}: unpacks to more than {GZIP_MAX_RATIO} times its size "
                f"({self.size / 2**20:.1f} MiB gzip'd): not a memory snapshot (a gzip bomb?)")
        if total >= self.next_check and self.rss0:
            self.next_check = total + (1 << 20)
            grown = _rss() - self.rss0
            if grown > self.rss_max:
                raise _BudgetError(
                    f"{self.path}: stopped after {total / 2**20:.0f} MiB of pickle: loading "
                    f"it had taken {grown / 2**30:.1f} GiB of memory, the most a "
                    f"{self.size / 2**20:.1f} MiB file may (a hostile pickle, or a snapshot "
                    "too big for this machine's free memory)")


def check_tree(obj, nbytes: int, where: str = "snapshot") -> int:
    """Count what a walk of `obj` would visit: every list item and dict value, a container
    referred to N times counted N times (shared references), at most TREE_PER_BYTE per byte
    of pickle (TREE_MIN at least), nesting at most MAX_DEPTH, no cycle. Returns the count;
    raises SnapshotError in one line. Each container is looked at once (its size is
    remembered), so the check costs the file's size, not the tree's."""
    limit = max(TREE_MIN, TREE_PER_BYTE * nbytes)

    def too_many() -> SnapshotError:
        return SnapshotError(
            f"{where}: refers to its own lists so often that reading it means visiting more "
            f"than {limit:,} entries ({TREE_PER_BYTE} per byte of the file): not a memory "
            "snapshot (stopped before walking it)")

    if type(obj) not in (list, dict, tuple):
        return 0
    sizes: dict = {}      # id -> entries below it, each counted once per reference
    open_: set = set()    # ids on the current path (a cycle refers back to one)
    stack: list = [(obj, None)]
    while stack:
        o, it = stack[-1]
        if it is None:
            if len(stack) > MAX_DEPTH:
                raise SnapshotError(f"{where}: nests deeper than {MAX_DEPTH} levels: not a "
                                    "memory snapshot")
            open_.add(id(o))
            sizes[id(o)] = len(o)
            it = iter(o.values()) if type(o) is dict else iter(o)
            if type(o) is list and o:
                # at C speed when every item is a container seen before (a stack's list of
                # frame dicts, most of them shared): the same sum the loop below makes
                ids = list(map(id, o))
                try:
                    below = sum(map(sizes.__getitem__, ids))
                except KeyError:
                    pass
                else:
                    if not open_.isdisjoint(ids):
                        raise SnapshotError(f"{where}: a list or dict of the file contains "
                                            "itself: not a memory snapshot")
                    sizes[id(o)] += below
                    if sizes[id(o)] > limit:
                        raise too_many()
                    it = iter(())
            stack[-1] = (o, it)
        down = False
        for c in it:
            t = type(c)
            if t is list or t is dict or t is tuple:
                j = id(c)
                if j in open_:
                    raise SnapshotError(f"{where}: a list or dict of the file contains itself: "
                                        "not a memory snapshot")
                if j not in sizes:
                    stack.append((c, None))
                    down = True
                    break
                n = sizes[id(o)] = sizes[id(o)] + sizes[j]
                if n > limit:
                    raise too_many()
        if down:
            continue
        stack.pop()
        open_.discard(id(o))
        if stack:
            p = id(stack[-1][0])
            n = sizes[p] = sizes[p] + sizes[id(o)]
            if n > limit:
                raise too_many()
        elif sizes[id(o)] > limit:
            raise too_many()
    return sizes.get(id(obj), 0)


class _Counted(io.RawIOBase):
    """A file's (unpacked) bytes as a raw stream, counted against the limit and the budget."""

    def __init__(self, f, path: str, limit: int, budget: _Budget) -> None:
        self.f, self.path, self.limit, self.budget = f, path, limit, budget
        self.total = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.f.read(len(b))
        n = len(data)
        b[:n] = data
        self.total += n
        if self.total > self.limit:
            raise _BudgetError(f"{self.path}: unpacks to more than the "
                               f"{self.limit / 2**30:.0f} GiB limit for a snapshot")
        self.budget.read(self.total)
        return n


class _Capped(io.BufferedReader):
    """A pickle opcode announces how many bytes follow (FRAME, BINBYTES8: up to 2**64):
    never ask for more than the file can hold, so a 9-byte file cannot make a 2 GiB read."""

    cap = 0

    def read(self, n=-1):
        if n is None or n < 0 or n > self.cap:
            n = self.cap
        return super().read(n)


def _plain_load(path: str, limit: int):
    """The whole file's object, unpickled from the file as it is read (never held whole in
    memory), under the budget: (object, pickle bytes read). Raises SnapshotError."""
    not_pickle = SnapshotError(f"{path}: not a pickle (a memory snapshot is the .pickle file "
                               "written by torch.cuda.memory._dump_snapshot)")
    looks = True
    try:
        size = os.path.getsize(path)
        if size > limit:
            raise SnapshotError(
                f"{path}: {size / 2**30:.1f} GiB is larger than the {limit / 2**30:.0f} GiB "
                "limit for a snapshot (GPUMON_VIEW_MAX_BYTES raises it)")
        with open(path, "rb") as raw:
            gz = raw.read(2) == GZIP_MAGIC
            raw.seek(0)
            f = gzip.GzipFile(fileobj=raw) if gz else raw
            counted = _Counted(f, path, limit, _Budget(path, size, gz))
            buf = _Capped(counted, 1 << 20)
            buf.cap = min(limit, max(64 << 20, GZIP_MAX_RATIO * size) if gz else size) + 1
            head = bytes(buf.peek(2)[:2])
            if not head:
                raise SnapshotError(f"{path}: the file is empty")
            # the first byte must be a pickle opcode (PROTO: of a protocol pickle knows):
            # anything else is refused at its first bytes, not after reading gigabytes of it
            if head[0] not in _opcodes() or (head[0] == 0x80 and (
                    len(head) < 2 or head[1] > pickle.HIGHEST_PROTOCOL)):
                raise not_pickle
            looks = head[0] in _PICKLE_FIRST
            obj = _PlainDataUnpickler(buf).load()
            return obj, counted.total
    except _BudgetError:
        raise
    except SnapshotError as e:
        if str(e).startswith(path):
            raise
        if not looks and "names the Python object" not in str(e):
            raise not_pickle from None
        raise SnapshotError(f"{path}: {e}") from None  # refused by find_class
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SnapshotError(f"{path}: is a directory, not a snapshot file") from None
    except PermissionError:
        raise SnapshotError(f"{path}: permission denied") from None
    except EOFError:
        if not looks:
            raise not_pickle from None
        raise SnapshotError(f"{path}: the file is truncated (the pickle ends early)") from None
    except RecursionError:
        raise SnapshotError(f"{path}: the file nests too deeply to be a memory snapshot") \
            from None
    except MemoryError:
        if not looks:
            raise not_pickle from None
        raise SnapshotError(f"{path}: not enough memory to load this file") from None
    except (OSError, gzip.BadGzipFile) as e:
        raise SnapshotError(f"{path}: cannot read ({e})") from None
    except Exception as e:  # noqa: BLE001 - pickle's own errors: one line, never a traceback
        if not looks:
            raise not_pickle from None
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SnapshotError(f"{path}: the file is corrupt or not a pickle ({msg})") from None


def int_field(v) -> int:
    """An int from a field that should be one (defensive: old or odd dumps); 0 when it is not."""
    if type(v) is int:
        return v
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
        return 0


@contextmanager
def gc_paused():
    """The cyclic garbage collector off while a file's plain data is built and replayed: the
    objects made are tens of thousands of dicts and lists with no cycles among them, and each
    collection the allocation count sets off walks them all again (measured: 8% of an 8 MB
    file's load and replay). Back on afterwards, as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load_snapshot(path: str | os.PathLike, max_bytes: int | None = None,
                  progress=None, window: int | None = None, window_at: int | None = None,
                  window_total: int | None = None) -> dict:
    """Load and shape-check a snapshot. Returns the dict with at least `segments` (list) and
    `device_traces` (a list with one PackedTrace or list of event dicts per device). Raises
    SnapshotError with a one-line message.

    Torch's files (pickle protocol 4+) are read by `_stream_load`, which packs the trace events
    while they are unpickled; anything it does not expect, and every error, goes to the plain
    whole-file load, which then decides (so both give the same answer, only faster and in less
    memory when the stream works). `progress(done, total)` is called as the file is read
    (bytes of the file on disk, gzip'd or not).

    `window`: keep at most this many events of a device's trace, those around its peak (or
    around event `window_at`), read in a second pass with what the rest of the trace says
    about them (window.py): memory then stays bounded however long the trace. Only torch's
    layout is read this way; a file the stream cannot read is loaded whole."""
    with gc_paused():
        return _load_snapshot(os.fspath(path), max_bytes, progress, window, window_at,
                              window_total)


def _load_snapshot(path: str, max_bytes, progress, window, window_at, window_total) -> dict:
    from . import cache
    limit = max_bytes if max_bytes is not None else max_bytes_from_env()
    try:
        small = os.path.getsize(path) <= limit   # the limits hold for a cached file too
    except OSError:
        small = False
    cached = cache.load(path) if small else None
    if cached is not None and (not window or all(len(t) <= window
                                                 for t in cached["device_traces"])):
        return normalize(cached, path)
    obj = _read_snapshot(path, max_bytes, progress, window, window_at, window_total)
    cache.store(path, obj)
    return obj


def _read_snapshot(path: str, max_bytes, progress, window, window_at, window_total) -> dict:
    limit = max_bytes if max_bytes is not None else max_bytes_from_env()
    meta: dict = {}
    try:
        if window:
            obj = _stream_windowed(path, limit, progress, window, window_at, window_total, meta)
        else:
            obj = _stream_load(path, limit, progress, meta=meta)
    except _BudgetError:
        raise  # the plain load would stop at the same bound, after as much work
    except Exception:  # noqa: BLE001 - the plain load below decides (and words the error)
        obj = None
    whole = obj is None
    if whole:
        obj, meta["bytes"] = _plain_load(path, limit)
    check_tree(obj, meta.get("bytes", 0), path)
    obj = normalize(obj, path)
    # the stream packs each event as it is read; event lists it could not find (not
    # memoized where torch's pickler memoizes them: another writer) come back whole
    if whole or any(type(t) is list and t for t in obj["device_traces"]):
        n = sum(len(t) for t in obj["device_traces"])
        if n > WHOLE_LOAD_NOTE_EVENTS or meta.get("bytes", 0) > WHOLE_LOAD_NOTE_BYTES:
            cap = _Budget(path, os.path.getsize(path), False).rss_max
            obj["_gpumon_note"] = (
                f"{os.path.basename(path)}: not laid out as torch's pickler writes it (its "
                f"event lists are not memoized where the streaming reader finds them), so all "
                f"{n:,} events were read whole" + (", the window too" if window else "")
                + f": slower and in more memory (at most {cap / 2**30:.1f} GiB) than a file "
                "torch wrote; re-save it with pickle.dump to read it streamed")
    return obj


# A whole load of a file this large is said (the stream reads torch's layout in a fraction of
# the memory and time: a 10M-event file written by another pickler took 235 s and 7.5 GB whole)
WHOLE_LOAD_NOTE_EVENTS = 200_000
WHOLE_LOAD_NOTE_BYTES = 32 << 20


# -- the streaming load ----------------------------------------------------------------------
#
# pickle.load of a trace builds every event dict before the caller sees any (and the Unpickler's
# memo keeps each one alive even if the list let go). `_stream_load` runs the same C Unpickler
# (the same _PlainDataUnpickler: nothing but plain data can come out) on a rewritten byte
# stream, fed through `_Stream.peek/read`:
#   - the FRAME opcodes (protocol 4's read-ahead hints) are dropped, so the stream may be
#     changed;
#   - the objects made once per event (the event dict, an empty `frames` list, the string "N/A"
#     of compile_context) are memoized as None instead: `X MEMOIZE` becomes
#     `X NONE MEMOIZE POP`, so the memo numbering is unchanged and nothing later can refer to
#     them (torch never refers to them again);
#   - the stream stops at the start of each device's event list, where the memo tells which
#     list object it is; every time the Unpickler asks for more input, the events appended to
#     those lists so far are moved into a PackedTrace and the list is emptied.
# So at most one chunk's event dicts exist at a time. The patterns are found with bytes.find
# and bytes.replace (C speed); one that falls across a chunk boundary is simply not rewritten
# (that object stays in the memo, as with pickle.load). Where the stream is not torch's
# layout (protocol < 4, a list that is not where device_traces says, a probe that does not
# land on an opcode boundary), _Stop sends the file to the plain load.

_CHUNK = 64 << 10  # 64 KiB: ~1,100 events, ~0.4 MiB of dicts at a time
_KEEP = 64         # longer than any pattern looked for
_FIRST_EVENT = b"]\x94(}\x94(\x8c\x06action\x94"   # a list, MARK, {"action": ... (first time)


class _Stop(Exception):
    """The stream is not the layout this loader expects; the plain load takes over."""


class _SharedFrames(_Stop):
    """An event's frame list is one an earlier event had: read again, keeping frame lists."""


def _dget(e, k, d):
    return e.get(k, d) if type(e) is dict else d


def _get(idx: int) -> bytes:
    """The BINGET/LONG_BINGET the pickler writes for memo index idx."""
    return b"h" + bytes([idx]) if idx < 256 else b"j" + idx.to_bytes(4, "little")


def _source(path: str, limit: int, progress=None, meta: dict | None = None):
    """The file's pickle bytes in pieces (gunzipped), FRAME headers removed; meta["bytes"]:
    how many were read."""
    size = os.path.getsize(path)
    if size > limit:
        raise _Stop
    meta = {} if meta is None else meta
    with open(path, "rb") as raw:
        gz = raw.read(2) == GZIP_MAGIC
        raw.seek(0)
        f = gzip.GzipFile(fileobj=raw) if gz else raw
        budget = _Budget(path, size, gz)
        total = 0

        def read(n):
            nonlocal total
            b = f.read(n)
            total += len(b)
            if total > limit:
                raise _Stop
            meta["bytes"] = total
            budget.read(total)
            if progress is not None:
                try:
                    progress(raw.tell(), size)
                except Exception:  # noqa: BLE001 - a display must never break the load
                    pass
            return b
        head = read(2)
        if len(head) < 2 or head[0] != 0x80 or head[1] < 4:
            raise _Stop  # protocol 0-3: no MEMOIZE/FRAME; the plain load reads it
        yield head
        while True:
            h = read(9)
            if len(h) < 9 or h[0] != 0x95:
                # no more frames (or an unframed opcode): the rest as it is
                yield h
                while True:
                    b = read(_CHUNK)
                    if not b:
                        return
                    yield b
            left = int.from_bytes(h[1:], "little")
            while left:
                b = read(min(left, _CHUNK))
                if not b:
                    return  # truncated: the Unpickler will say so
                left -= len(b)
                yield b


class _Stream:
    """The rewritten stream, as a file with peek/read/readline for the C Unpickler."""

    def __init__(self, pieces, make_trace=None, frames_rewrite=True):
        self._pieces = pieces
        self.make_trace = make_trace or (lambda k: PackedTrace())
        self.frames_rewrite = frames_rewrite
        self._raw = b""
        self._eof = False
        self.buf = memoryview(b"")
        self.pos = 0
        self.up = None
        self.lists: list[tuple[list, PackedTrace]] = []
        self.g_action: bytes | None = None
        self._first: int = -1        # memo index of the first event dict
        self._want_keys = False
        # (pattern, replacement): bytes, or a compiled regex for a group of patterns that
        # share a prefix (one scan instead of one per pattern: that prefix is in every event)
        self._repl: list[tuple] = []
        self._next_list = None
        self._probe = None

    # -- file interface (what _pickle.Unpickler calls) ---------------------------------------
    def peek(self, n=0):
        if self.pos >= len(self.buf):
            self._advance(True)
        return self.buf[self.pos:]

    def read(self, n=-1):
        end = self.pos + n
        if end <= len(self.buf):
            out = self.buf[self.pos:end]
            self.pos = end
            return out
        parts = [bytes(self.buf[self.pos:])]
        need = n - len(parts[0])
        while need > 0:
            self._advance(False)
            if not len(self.buf):
                break
            take = self.buf[:need]
            parts.append(bytes(take))
            self.pos = len(take)
            need -= len(take)
        return b"".join(parts)

    def readline(self):
        parts = []
        while True:
            i = bytes(self.buf[self.pos:]).find(b"\n")
            if i >= 0:
                parts.append(bytes(self.buf[self.pos:self.pos + i + 1]))
                self.pos += i + 1
                return b"".join(parts)
            parts.append(bytes(self.buf[self.pos:]))
            self._advance(False)
            if not len(self.buf):
                return b"".join(parts)

    # -- chunks ------------------------------------------------------------------------------
    def drain(self):
        for lst, packed in self.lists:
            if lst:
                items = lst[:]
                del lst[:]
                if self.frames_rewrite:
                    try:
                        frames = list(map(dict.get, items, repeat("frames"), repeat(0)))
                    except TypeError:  # an event that is not a dict (PackedTrace skips it)
                        frames = list(map(_dget, items, repeat("frames"), repeat(0)))
                    if frames.count(None):
                        raise _SharedFrames
                skipped = packed.skipped
                packed.add(items)
                if packed.skipped != skipped and any(e is None for e in items):
                    # an event referred to twice (torch never does): it came back as the None
                    # memoized in its place, where pickle.load would give the dict again
                    raise _Stop

    def _advance(self, at_boundary: bool):
        self.drain()
        while True:
            if self._probe is not None:
                if not at_boundary:
                    raise _Stop  # the cut was not between two opcodes
                probe, self._probe = self._probe, None
                probe()
            raw = self._raw
            while len(raw) < _CHUNK + _KEEP and not self._eof:
                try:
                    raw += next(self._pieces)
                except StopIteration:
                    self._eof = True
            cut, probe = self._cut(raw)
            if cut == 0 and probe is not None:
                self._raw = raw
                self._probe = probe
                continue
            break
        chunk, self._raw = raw[:cut], raw[cut:]
        for old, new in self._repl:
            chunk = old.sub(new, chunk)
        self._probe = probe
        self.buf = memoryview(chunk)
        self.pos = 0

    def _add_repl(self, old: bytes, new: bytes) -> None:
        """Replace `old` by `new` in every chunk from now on. As a regex: in pickle bytes
        (many NULs, patterns ending in NULs) re's literal search is 3-9x faster than
        bytes.replace/find (CPython 3.11: 28 against 249 us for 64 KiB)."""
        self._repl.append((re.compile(re.escape(old)), new.replace(b"\\", b"\\\\")))

    def _cut(self, raw: bytes):
        """Where this chunk ends, and the probe to run when the Unpickler gets there."""
        # without a probe point, keep the last _KEEP bytes for the next chunk: a pattern that
        # starts before the cut is then always seen whole
        rest = len(raw) if self._eof else len(raw) - _KEEP
        if self.g_action is None:
            k = raw.find(_FIRST_EVENT)
            if k >= 0:
                return k + 2, self._probe_first
            return rest, None
        best, probe = -1, None
        if self._next_list is None:   # (a regex: see _add_repl)
            self._next_list = re.compile(re.escape(b"]\x94(}\x94(" + self.g_action))
        m = self._next_list.search(raw)
        k = m.start() if m else -1
        if k >= 0:
            best, probe = k + 2, self._probe_list
        if self._want_keys:
            k = raw.find(b"}\x94(" + self.g_action)
            if k >= 0 and (best < 0 or k < best):
                best, probe = k, self._probe_keys
        if best >= 0:
            return best, probe
        return rest, None

    # -- probes: the Unpickler has just executed everything before the cut -----------------
    def _new_list(self):
        memo = self.up.memo.copy()
        n = len(memo)
        lst = memo.get(n - 1)
        if type(lst) is not list or lst:
            raise _Stop
        self.lists.append((lst, self.make_trace(len(self.lists))))
        return n

    def _probe_first(self):
        n = self._new_list()
        self._first = n          # the event dict's MEMOIZE comes next, then "action"'s
        self.g_action = _get(n + 1)
        self._want_keys = True
        # from here on each event dict is memoized as None
        self._add_repl(b"}\x94(" + self.g_action, b"}N\x940(" + self.g_action)

    def _probe_list(self):
        self._new_list()

    def _probe_keys(self):
        """The first event is complete: learn the memo numbers of its keys."""
        self._want_keys = False
        memo = self.up.memo.copy()
        ev = memo.get(self._first)
        if type(ev) is not dict or ev.get("action") is None:
            raise _Stop
        idx = {id(v): k for k, v in memo.items()}
        keys = {k: idx[id(k)] for k in ev if type(k) is str and id(k) in idx}
        if "frames" in keys:
            g = _get(keys["frames"])
            if self.frames_rewrite and (g + b"h" in self._raw or g + b"j" in self._raw):
                # an event's frames are a list read before (BINGET): torch's own files share
                # an alloc's frame list with its free's. Keep them from the start (found later,
                # the file is read again: _SharedFrames, ~10 ms on an 8 MiB file)
                self.frames_rewrite = False
            if self.frames_rewrite:
                # torch writes a new frame list per event (stacks='all'): memoized, every one
                # would stay alive in the memo; memoize None instead. A file that refers to a
                # list again (that event's frames come back None) is read again without this.
                self._add_repl(g + b"]\x94(", g + b"]N\x940(")
            # then the empty lists (all that is left of g]MEMOIZE once the above ran): g]MEMOIZE
            # followed by "u" or the next key; one regex scan, not one replace per key
            nxt = [b"u"] + [_get(i) for k, i in keys.items() if k != "frames"]
            empty = re.compile(re.escape(g + b"]\x94") + b"(?=" + b"|".join(map(re.escape, nxt))
                               + b")")
            self._repl.append((empty, (g + b"]N\x940").replace(b"\\", b"\\\\")))
        if "compile_context" in keys:
            g = _get(keys["compile_context"])
            self._add_repl(g + b"\x8c\x03N/A\x94", g + b"\x8c\x03N/AN\x940")


def _stream_load(path: str, limit: int, progress=None, make_trace=None,
                 meta: dict | None = None):
    """The snapshot with its device traces packed, or None when it is not in torch's layout
    (the caller then loads it whole). Raises on any error; the caller retries the plain way.
    `make_trace(k)`: what packs the k-th event list (a PackedTrace, or a window.WindowTrace);
    the traces made are in obj["_traces"] as (device index, trace) while the caller needs
    them."""
    try:
        return _stream_load_once(path, limit, progress, make_trace, True, meta)
    except _SharedFrames:
        return _stream_load_once(path, limit, progress, make_trace, False, meta)


def _stream_load_once(path, limit, progress, make_trace, frames_rewrite, meta=None):
    pieces = _source(path, limit, progress, meta)
    st = _Stream(pieces, make_trace, frames_rewrite)
    try:
        up = _PlainDataUnpickler(st)
        st.up = up
        obj = up.load()
        st.drain()
        del up
        st.up = None
    finally:
        pieces.close()
    if not st.lists:
        return obj  # nothing was rewritten: exactly what pickle.load gives
    traces = obj.get("device_traces") if isinstance(obj, dict) else None
    if not isinstance(traces, list):
        raise _Stop
    made = []
    for lst, packed in st.lists:
        for i, t in enumerate(traces):
            if t is lst:
                traces[i] = getattr(packed, "packed", packed)
                made.append((i, packed))
                break
        else:
            raise _Stop  # an event list outside device_traces: not torch's layout
    if make_trace is not None:
        obj["_traces"] = made
    return obj


def _stream_windowed(path: str, limit: int, progress, window: int, at: int | None,
                     total: int | None = None, meta: dict | None = None):
    """Read a file whose traces may be longer than `window` events: see window.py. `total`
    with `at`: the trace's length, known from an earlier read (of its busiest device): the
    first pass is skipped."""
    from .window import WindowTrace, remember_pairs, remembered_pairs, window_bounds
    bounds = {}
    if at is not None and total and total > window:
        # the first pass of an earlier read of this file noted where free pairs are
        bounds[0] = (window_bounds(total, window, at, remembered_pairs(path, total)), total, -1)
    else:
        obj = _stream_load(path, limit, progress, lambda k: WindowTrace(0, window, tally=True),
                           meta)
        made = obj.pop("_traces", []) if isinstance(obj, dict) else []
        long = {k: w for k, (_i, w) in enumerate(made) if w.n > window}
        if not long:
            return obj
        for k, w in long.items():
            c = w.tally.peak_index() if at is None else max(0, min(at, w.n - 1))
            bounds[k] = (window_bounds(w.n, window, c, w.tally), w.n, w.tally.peak_index())
            remember_pairs(path, w.n, w.tally)
        del obj, made, long
    if progress is not None and hasattr(progress, "phase"):
        progress.phase("reading the window")
    obj = _stream_load(path, limit, progress, lambda k: WindowTrace(
        *(bounds[k][0] if k in bounds else (0, 1 << 62)), seeder=k in bounds), meta)
    made = obj.pop("_traces", [])
    info = {}
    segs = obj.get("segments") if isinstance(obj.get("segments"), list) else []
    for k, (dev, w) in enumerate(made):
        if k not in bounds:
            continue
        (lo, hi0), n, peak = bounds[k]
        info[dev] = {"lo": lo, "hi": w.hi, "n": n, "peak_index": peak,
                     "seed": w.seeder.seed([x for x in segs if isinstance(x, dict)], dev),
                     "tail_seg": w.seeder.tail_seg, "length": window,
                     "dump_live": w.seeder.live_at_dump(),
                     "t0": w.t0 if type(w.t0) is int else None}
    obj["_gpumon_window"] = info
    return obj


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
    if not isinstance(traces, list) or not all(isinstance(t, (list, PackedTrace))
                                               for t in traces):
        raise SnapshotError(f"{where}: 'device_traces' is not a list of per-device event lists")
    obj["segments"] = segs
    obj["device_traces"] = traces
    return obj
