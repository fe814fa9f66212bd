"""A synthetic snapshot of any length (10 million events and more), written straight to disk as
torch's pickler writes a `_dump_snapshot` file, without ever holding the events in memory.

`training_snapshot` (synth.py) builds the whole dict, which at 10M events would take ~4 GiB;
this writer emits the pickle opcodes itself, one event at a time, in torch's layout: protocol
4, every event dict memoized, its keys memoized once and referred to after, and (as with
stacks='all') a fresh frame list per event holding shared, memoized frame dicts. The loop it
records is a training loop that is already running when the recording starts: parameters
allocated before the trace (blocks of the segments at the dump), activations of the step
before the trace freed in its first events, forward (activations and temporaries), backward
(gradients, activations freed with free_requested + free_completed as torch records them),
AdamW state made in the first step and kept, a cache tensor that lives across most of the
trace, and one step (`peak_step`) whose activations are larger: the peak is there.

    write_long_trace(path, 10_000_000)
"""
from __future__ import annotations

import struct

_HIDDEN = 1 << 18
_BASE = 0x7F0000000000


class _Writer:
    def __init__(self, f):
        self.f = f
        self.m = 0                       # the next memo index
        self.strings: dict[str, bytes] = {}
        self.buf: list[bytes] = []

    def memoize(self) -> bytes:
        self.m += 1
        return b"\x94"

    @staticmethod
    def get(i: int) -> bytes:
        return b"h" + bytes([i]) if i < 256 else b"j" + i.to_bytes(4, "little")

    def s(self, x: str) -> bytes:
        """A string: written and memoized the first time, referred to after."""
        r = self.strings.get(x)
        if r is not None:
            return r
        e = x.encode("utf-8")
        out = (b"\x8c" + bytes([len(e)]) if len(e) < 256 else b"X" + struct.pack("<I", len(e))) \
            + e + b"\x94"
        self.strings[x] = self.get(self.m)
        self.m += 1
        return out

    @staticmethod
    def i(v: int) -> bytes:
        if 0 <= v < 256:
            return b"K" + bytes([v])
        if 0 <= v < 65536:
            return b"M" + v.to_bytes(2, "little")
        if -2**31 <= v < 2**31:
            return b"J" + v.to_bytes(4, "little", signed=True)
        n = (v.bit_length() + 8) // 8
        return b"\x8a" + bytes([n]) + v.to_bytes(n, "little", signed=True)

    def obj(self, x) -> bytes:
        """Plain data (dict, list, str, int, bool, None), memoized as the pickler does."""
        if x is None:
            return b"N"
        if x is True:
            return b"\x88"
        if x is False:
            return b"\x89"
        if isinstance(x, int):
            return self.i(x)
        if isinstance(x, str):
            return self.s(x)
        if isinstance(x, dict):
            out = [b"}", self.memoize()]
            if x:
                out.append(b"(")
                for k, v in x.items():
                    out.append(self.obj(k))
                    out.append(self.obj(v))
                out.append(b"u")
            return b"".join(out)
        if isinstance(x, list):
            out = [b"]", self.memoize()]
            if x:
                out.append(b"(")
                out += [self.obj(v) for v in x]
                out.append(b"e")
            return b"".join(out)
        raise TypeError(type(x).__name__)


def _frames(layer: int, kind: str, depth: int = 0) -> list[dict]:
    fn = {"act": f"Block{layer}.forward", "tmp": f"Block{layer}.forward",
          "grad": "backward", "state": "step", "cache": "main", "prev": f"Block{layer}.forward"}
    line = {"act": 40 + layer, "tmp": 60, "grad": 45, "state": 80, "cache": 120, "prev": 40 + layer}
    ufile = "/home/user/proj/model.py" if kind in ("act", "tmp", "prev") else \
        "/home/user/proj/train.py"
    op = {"act": "linear", "tmp": "gelu", "grad": "backward", "state": "zeros_like",
          "cache": "detach", "prev": "linear"}[kind]
    cpp = ["torch::unwind::unwind()", "torch::CapturedTraceback::gather(bool, bool, bool)",
           "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(...)",
           "at::detail::empty_cuda(...)", f"at::_ops::{op}::call(...)"] + \
        [f"c10::impl::BoxedKernelWrapper<...>::call_{k}(...)" for k in range(depth)]
    return ([{"filename": "??", "line": 0, "name": n} for n in cpp] +
            [{"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py",
              "line": 2000, "name": op},
             {"filename": ufile, "line": line[kind], "name": fn[kind]},
             {"filename": "/home/user/proj/train.py", "line": 88, "name": "main"}])


def _events(n_events: int, layers: int, acts: int, peak_step: int | None):
    """(action, addr, size, stack key) of the loop, n_events of them (the ring's last n)."""
    # per step: forward 2 allocs + 2 frees (tmp) per act, backward 1 alloc + 2 + 2 frees
    per_step = layers * acts * 4 + layers * (3 + 2 * acts)
    steps = max(4, n_events // per_step + 3)
    if peak_step is None:
        peak_step = steps * 2 // 3
    out = 0
    stride = 64 << 20

    def addr(slot: int, k: int) -> int:
        return _BASE + slot * (1 << 34) + k * stride

    # the step before the trace: its activations are freed in the first events
    for k in range(layers):
        for a in range(acts):
            yield ("free_requested", addr(1, k * acts + a), _HIDDEN * 2, ("prev", k))
            yield ("free_completed", addr(1, k * acts + a), _HIDDEN * 2, ("prev", k))
            out += 2
    yield ("segment_alloc", addr(6, 0), 256 << 20, None)
    out += 1
    cache = addr(5, 0)
    for step in range(steps):
        par = step % 2
        scale = 3 if step == peak_step else 2
        live = []
        for k in range(layers):
            for a in range(acts):
                p = addr(2 + par, k * acts + a)
                yield ("alloc", p, _HIDDEN * scale + 512 * a, ("act", k))
                live.append((p, _HIDDEN * scale + 512 * a, k))
                t = addr(4, k * acts + a)
                yield ("alloc", t, _HIDDEN, ("tmp", k))
                yield ("free_requested", t, _HIDDEN, ("tmp", k))
                yield ("free_completed", t, _HIDDEN, ("tmp", k))
        for k in reversed(range(layers)):
            g = addr(4, 1 << 12 | k)
            yield ("alloc", g, _HIDDEN * 4, ("grad", k))
            for _ in range(acts):
                p, sz, kk = live.pop()
                yield ("free_requested", p, sz, ("act", kk))
                yield ("free_completed", p, sz, ("act", kk))
            yield ("free_requested", g, _HIDDEN * 4, ("grad", k))
            yield ("free_completed", g, _HIDDEN * 4, ("grad", k))
        if step == 0:
            for k in range(4):
                yield ("alloc", addr(6, 0) + k * (32 << 20), _HIDDEN * 8, ("state", 0))
        elif step == 1:
            yield ("alloc", cache, _HIDDEN * 16, ("cache", 0))
        elif step == steps - 2:
            yield ("free_requested", cache, _HIDDEN * 16, ("cache", 0))
            yield ("free_completed", cache, _HIDDEN * 16, ("cache", 0))
        if step == steps // 2:
            yield ("segment_alloc", addr(7, 0), 64 << 20, None)
            yield ("segment_free", addr(7, 0), 64 << 20, None)


def write_long_trace(path: str, n_events: int, layers: int = 12, acts: int = 6,
                     peak_step: int | None = None, progress=None, depth: int = 0) -> int:
    """Write a snapshot of exactly n_events trace events (the last n_events of the loop, as a
    ring of max_entries keeps them) to `path`. Returns the number written. `depth`: C++
    frames added to every stack (a real stacks='all' file has 30-60: 40k events then take
    ~8 MB)."""
    # the loop's events, then only its last n_events (a ring): count first
    total = sum(1 for _ in _events(n_events, layers, acts, peak_step))
    skip = max(0, total - n_events)
    params = [(_BASE + 0x100000000 + k * (8 << 20), 6 << 20) for k in range(layers)]
    state = [_BASE + 6 * (1 << 34) + k * (32 << 20) for k in range(4)]
    segments = [{"device": 0, "address": a, "total_size": 8 << 20, "allocated_size": s,
                 "active_size": s, "requested_size": s, "stream": 0, "segment_type": "large",
                 "segment_pool_id": [0, 0], "is_expandable": False, "frames": [],
                 "blocks": [{"address": a, "size": s, "requested_size": s,
                             "state": "active_allocated",
                             "frames": [{"filename": "/home/user/proj/model.py", "line": 12,
                                         "name": "__init__"}]},
                            {"address": a + s, "size": (8 << 20) - s, "requested_size": 0,
                             "state": "inactive", "frames": []}]}
                for a, s in params]
    segments.append({"device": 0, "address": state[0], "total_size": 256 << 20,
                     "allocated_size": 4 * _HIDDEN * 8, "active_size": 4 * _HIDDEN * 8,
                     "requested_size": 4 * _HIDDEN * 8, "stream": 0, "segment_type": "large",
                     "segment_pool_id": [0, 0], "is_expandable": False, "frames": [],
                     "blocks": [{"address": a, "size": 32 << 20, "requested_size": _HIDDEN * 8,
                                 "state": "active_allocated" if i < 4 else "inactive",
                                 "frames": []}
                                for i, a in enumerate(state + [state[0] + (128 << 20)])]})
    with open(path, "wb") as f:
        w = _Writer(f)
        f.write(b"\x80\x04}" + w.memoize() + b"(")
        f.write(w.s("segments") + w.obj(segments))
        f.write(w.s("device_traces") + b"]" + w.memoize() + b"(" + b"]" + w.memoize())
        frames_of: dict = {}
        act_b = {}
        t = 1_700_000_000_000_000
        k_action = k_addr = k_size = k_stream = k_time = k_frames = None
        batch: list[bytes] = []
        written = 0
        for ev_i, (action, ad, size, key) in enumerate(_events(n_events, layers, acts,
                                                                 peak_step)):
            if ev_i < skip:
                continue
            if written % 1000 == 0:
                if batch:
                    f.write(b"(" + b"".join(batch) + b"e")
                    batch = []
                if progress is not None and written % 100_000 == 0:
                    progress(written, n_events)
            t += 7 + (ev_i * 7919) % 23
            head = b"}" + w.memoize() + b"("
            if k_action is None:
                parts = [head, w.s("action"), w.s(action), w.s("addr"), w.i(ad), w.s("size"),
                         w.i(size), w.s("stream"), w.i(0), w.s("time_us"), w.i(t),
                         w.s("frames")]
                k_action, k_addr, k_size, k_stream, k_time, k_frames = (
                    w.strings[x] for x in ("action", "addr", "size", "stream", "time_us",
                                           "frames"))
            else:
                a = act_b.get(action)
                if a is None:
                    a = w.s(action)
                    act_b[action] = w.strings[action]
                parts = [head, k_action, a, k_addr, w.i(ad), k_size, w.i(size), k_stream,
                         b"K\x00", k_time, w.i(t), k_frames]
            if key is None:
                parts.append(b"]" + w.memoize())
            else:
                refs = frames_of.get(key)
                if refs is None:  # the frame dicts, written (and memoized) at first use
                    fr = _frames(key[1], key[0], depth)
                    lst = b"]" + w.memoize() + b"("   # the list is memoized before its items
                    first = []
                    refs = []
                    for d in fr:
                        at = w.m
                        first.append(w.obj(d))
                        refs.append(w.get(at))
                    frames_of[key] = b"".join(refs)
                    parts.append(lst + b"".join(first) + b"e")
                else:
                    parts.append(b"]" + w.memoize() + b"(" + refs + b"e")
            parts.append(b"u")
            batch.append(b"".join(parts))
            written += 1
        if batch:
            f.write(b"(" + b"".join(batch) + b"e")
        f.write(b"e")  # device_traces
        f.write(w.s("allocator_settings") + w.obj({"expandable_segments": False}))
        f.write(w.s("external_annotations") + w.obj([]))
        f.write(b"u.")
    return written
