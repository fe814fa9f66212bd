"""The streaming load (load._stream_load: events packed while they are unpickled) gives exactly
what the plain pickle.load gives, in far less memory, and falls back to the plain load for any
file it does not expect."""
import copy
import gzip
import os
import pickle
import tracemalloc
from pathlib import Path

import pytest

from gpumon.snapshot import Snapshot, SnapshotError, load, open_snapshot
from gpumon.snapshot import report
from gpumon.snapshot.packed import PackedTrace
from gpumon.snapshot.synth import snapshot_with_events, training_snapshot

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "snapshots"
REAL = sorted(FIX.glob("*.pickle")) if FIX.is_dir() else []


def _columns(t):
    p = t if isinstance(t, PackedTrace) else PackedTrace(t)
    return (p.action.tolist(), p.addr.tolist(), p.size.tolist(), p.time_us.tolist(),
            [p.frames_table[f] for f in p.fid], p.skipped, p.stream, p.compile_context,
            p.user_metadata, p.odd_action)


def _same_as_pickle_load(path, streamed=True):
    """load_snapshot(path) == pickle.load(path), field by field."""
    got = load.load_snapshot(path)
    with open(path, "rb") as f:
        raw = f.read()
    want = load.loads_plain(gzip.decompress(raw) if raw[:2] == load.GZIP_MAGIC else raw)
    assert {k: v for k, v in got.items() if k != "device_traces"} == \
        {k: v for k, v in want.items() if k != "device_traces"}
    assert len(got["device_traces"]) == len(want["device_traces"])
    for a, b in zip(got["device_traces"], want["device_traces"]):
        if streamed and len(b) > 1:  # a one-event list is written without MARK: left as is
            assert isinstance(a, PackedTrace), "the streaming load was not used"
        assert _columns(a) == _columns(b)
    # and the analysis on top
    assert report.summary_json(report.summary(Snapshot(got, str(path)))) == \
        report.summary_json(report.summary(Snapshot(want, str(path))))
    return got


@pytest.fixture(params=[1, 53, 4096, None], ids=["chunk1", "chunk53", "chunk4k", "default"])
def chunk(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(load, "_CHUNK", request.param)
    return request.param


def _write(tmp_path, data, name="s.pickle", protocol=4):
    p = tmp_path / name
    p.write_bytes(pickle.dumps(data, protocol=protocol))
    return p


@pytest.mark.parametrize("path", REAL, ids=[p.stem for p in REAL])
def test_real_snapshots_stream_exactly(path, chunk):
    _same_as_pickle_load(path)


def test_synthetic_snapshot_streams_exactly(tmp_path, chunk):
    _same_as_pickle_load(_write(tmp_path, snapshot_with_events(3000)))


@pytest.mark.parametrize("protocol", [4, 5])
def test_several_devices_and_an_oom(tmp_path, protocol):
    a, _ = training_snapshot(steps=2, layers=3, seed=1)
    b, _ = training_snapshot(steps=3, layers=2, seed=2, oom_at_step=2, capacity=200 << 20,
                             oom_kind="full")
    data = copy.deepcopy(a)
    data["device_traces"] = [a["device_traces"][0], [], copy.deepcopy(b["device_traces"][0]),
                             [{"action": "alloc", "addr": 1, "size": 2, "time_us": 3}]]
    got = _same_as_pickle_load(_write(tmp_path, data, protocol=protocol))
    assert [type(t).__name__ for t in got["device_traces"]] == \
        ["PackedTrace", "list", "PackedTrace", "list"]


def test_gzip_streams(tmp_path):
    p = tmp_path / "s.pickle.gz"
    p.write_bytes(gzip.compress(pickle.dumps(snapshot_with_events(2000))))
    _same_as_pickle_load(p)


@pytest.mark.parametrize("protocol", [0, 2, 3])
def test_old_protocols_load_whole(tmp_path, protocol):
    data, _ = training_snapshot(steps=2, layers=2)
    got = _same_as_pickle_load(_write(tmp_path, data, protocol=protocol), streamed=False)
    assert isinstance(got["device_traces"][0], list)


def test_event_list_outside_device_traces_loads_whole(tmp_path):
    data, _ = training_snapshot(steps=2, layers=2)
    data = {"early_events": copy.deepcopy(data["device_traces"][0]), **data}
    got = _same_as_pickle_load(_write(tmp_path, data), streamed=False)
    assert got["early_events"][0]["action"]


def test_an_event_referred_to_twice_loads_whole(tmp_path):
    data, _ = training_snapshot(steps=2, layers=2)
    ev = data["device_traces"][0]
    ev.append(ev[5])  # the same dict object twice: pickled as a memo reference
    got = _same_as_pickle_load(_write(tmp_path, data), streamed=False)
    assert got["device_traces"][0][-1] == ev[5]


def test_packed_events_read_back_as_dicts(tmp_path):
    data, _ = training_snapshot(steps=1, layers=2)
    ev = data["device_traces"][0]
    ev[3]["stream"] = 7
    ev[4]["compile_context"] = "torch/_dynamo: f"
    ev[5]["action"] = "free"
    got = load.load_snapshot(_write(tmp_path, data))["device_traces"][0]
    assert isinstance(got, PackedTrace) and len(got) == len(ev)
    for i in (0, 3, 4, 5, len(ev) - 1):
        want = {k: v for k, v in ev[i].items()}
        assert {k: got[i][k] for k in want} == want
    assert [e["size"] for e in got] == [e["size"] for e in ev]
    with pytest.raises(IndexError):
        got[len(ev)]


def test_hostile_object_deep_in_a_streamed_trace_is_refused(tmp_path):
    marker = tmp_path / "PWNED"

    class Reduce:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    data = snapshot_with_events(5000)
    data["device_traces"][0][4000]["frames"] = Reduce()
    p = _write(tmp_path, data)
    with pytest.raises(SnapshotError, match=r"refused: .*system") as ei:
        open_snapshot(p)
    assert "\n" not in str(ei.value)
    assert not marker.exists()


def test_truncated_streamed_file_one_line(tmp_path):
    data = pickle.dumps(snapshot_with_events(5000))
    for cut in (100, len(data) // 2, len(data) - 3):
        p = tmp_path / "cut.pickle"
        p.write_bytes(data[:cut])
        with pytest.raises(SnapshotError) as ei:
            open_snapshot(p)
        assert "\n" not in str(ei.value) and ("truncated" in str(ei.value)
                                              or "corrupt" in str(ei.value))


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_stays_below_the_file_size(tmp_path):
    """The events are packed as they are read: the peak is a fraction of pickle.load's."""
    p = _write(tmp_path, snapshot_with_events(60_000))
    size = p.stat().st_size
    _, plain = _peak(lambda: pickle.loads(p.read_bytes()))
    snap, streamed = _peak(lambda: open_snapshot(p))
    assert isinstance(snap.data["device_traces"][0], PackedTrace)
    assert plain > 4 * size      # what pickle.load costs (so this test can fail)
    assert streamed < 1.5 * size, (streamed / size, plain / size)


def test_fresh_frame_lists_intern_by_content_in_a_batch():
    """torch's pickler writes a new list per event over shared frame dicts: the batch path
    interns them by content (one fid per distinct stack), keeps apart stacks that share their
    first and last frame and length, and matches what one-by-one interning gives."""
    f = [{"filename": "m.py", "line": i, "name": "f"} for i in range(6)]
    stacks = [[f[0], f[1], f[5]], [f[0], f[2], f[5]], [f[3], f[4]], [f[0], f[1], f[5]]]
    events = []
    for i in range(400):
        fr = stacks[i % 4]
        events.append({"action": "alloc", "addr": 64 * i, "size": 512, "time_us": i,
                       "frames": list(fr) if i % 3 else fr})  # fresh lists and shared ones
    batch = PackedTrace(events)
    one_by_one = PackedTrace()
    for e in events:
        one_by_one._add_slow([e])
    assert batch.fid.tolist() == one_by_one.fid.tolist()
    assert len(batch.frames_table) == 1 + 3  # no stack, and the three distinct stacks
    assert [batch.frames_table[x] for x in batch.fid] == [e["frames"] or None for e in events]
    # the next batch, fresh lists again, finds the same fids
    again = [dict(e, frames=list(e["frames"])) for e in events]
    again[7]["frames"] = []  # no stack: fid 0
    batch.add(again)
    want = batch.fid.tolist()[:400]
    want[7] = 0
    assert batch.fid.tolist()[400:] == want


def test_the_collector_is_paused_only_while_a_file_loads(tmp_path, monkeypatch):
    """Loading and replaying turn the cyclic GC off (the data has no cycles; collections set
    off by the allocation count walked it all again) and back on, also after a refused file,
    and leave it off for a caller that had it off."""
    import gc
    seen = []
    real_add = PackedTrace.add
    monkeypatch.setattr(PackedTrace, "add", lambda self, ev: (seen.append(gc.isenabled()),
                                                              real_add(self, ev))[1])
    p = _write(tmp_path, snapshot_with_events(3000))
    assert gc.isenabled()
    s = open_snapshot(p)
    assert seen and not any(seen) and gc.isenabled()
    s.trace()
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(SnapshotError):
        open_snapshot(bad)
    assert gc.isenabled()
    gc.disable()
    try:
        open_snapshot(p)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_batch_with_stackless_events_interns_as_one_by_one():
    """A batch where some events have no stack (a free with Python stacks: no "frames" key,
    or an empty list) still interns the others by content, in order: the same fids as one by
    one, fid 0 for the stackless ones."""
    f = [{"filename": "m.py", "line": i, "name": "f"} for i in range(6)]
    stacks = [[f[0], f[1], f[5]], [f[0], f[2], f[5]], [f[3], f[4]]]
    events = []
    for i in range(300):
        e = {"action": "alloc", "addr": 64 * i, "size": 512, "time_us": i}
        if i % 5 == 1:
            pass                      # no "frames" key
        elif i % 5 == 2:
            e["frames"] = []
        else:
            e["frames"] = list(stacks[(i * 7) % 3])  # fresh lists over shared frames
        events.append(e)
    batch = PackedTrace(events)
    one_by_one = PackedTrace()
    for e in events:
        one_by_one._add_slow([e])
    assert batch.fid.tolist() == one_by_one.fid.tolist()
    assert [batch.fid[i] for i in range(300) if i % 5 in (1, 2)] == [0] * 120
    assert len(batch.frames_table) == 1 + 3
    assert [batch.frames_table[x] for x in batch.fid] == [e.get("frames") or None
                                                         for e in events]


def test_stacks_that_share_a_key_are_found_without_python_per_event(monkeypatch):
    """Real C++ stacks (stacks='all') often share their first frame, last frame and length
    and differ in the middle: a batch of fresh lists over stacks seen before is matched at C
    speed (no intern() call per event, 17,784 of 35,849 events on a real file before), and
    every event gets the fid one-by-one interning gives, also for a stack equal by value to
    another whose first frame is another dict (kept apart, as intern() keeps it)."""
    f = [{"filename": "m.py", "line": i, "name": "f"} for i in range(12)]
    twin = dict(f[0])   # equal to f[0] by value, another object
    stacks = [[f[0], f[k], f[11]] for k in range(1, 9)] + [[twin, f[1], f[11]]]
    seed = [{"action": "alloc", "addr": 64 * i, "size": 512, "time_us": i,
             "frames": list(fr)} for i, fr in enumerate(stacks)]
    events = [{"action": "alloc", "addr": 64 * i, "size": 512, "time_us": i,
               "frames": list(stacks[(i * 5) % len(stacks)])} for i in range(900)]
    one_by_one = PackedTrace()
    for e in seed + events:
        one_by_one._add_slow([e])
    batch = PackedTrace(seed)
    calls = []
    real = PackedTrace.intern
    monkeypatch.setattr(PackedTrace, "intern", lambda self, fr: (calls.append(1),
                                                                 real(self, fr))[1])
    batch.add(events)
    assert not calls
    assert batch.fid.tolist() == one_by_one.fid.tolist()
    assert len(batch.frames_table) == 1 + 9
    assert [batch.frames_table[x] for x in batch.fid[len(seed):]] == \
        [e["frames"] for e in events]
    assert all(batch.frames_table[x][0] is e["frames"][0]
               for x, e in zip(batch.fid[len(seed):], events))


def test_a_batch_without_any_stack_packs_in_columns():
    """Frees of a Python-stacks file have no "frames" key: a batch of only those packs at
    C speed (fid 0 each), as one of some with a stack does."""
    events = [{"action": "free_completed", "addr": 64 * i, "size": 512, "time_us": i}
              for i in range(50)]
    p = PackedTrace()
    assert p._add_fast(events)
    assert p.fid.tolist() == [0] * 50 and p.frames_table == [None]
