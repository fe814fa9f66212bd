"""The analysis against ground truth from the synthetic allocator, and its invariants."""
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumon.snapshot import Snapshot
from gpumon.snapshot import report
from gpumon.snapshot.analysis import NO_PY_STACK, NO_STACK, is_user_frame
from gpumon.snapshot.synth import SynthAllocator, _stack, training_snapshot


def _snap(**kw):
    data, truth = training_snapshot(**kw)
    return Snapshot(pickle.loads(pickle.dumps(data)), "t.pickle"), truth


@pytest.mark.parametrize("max_entries", [None, 1000, 301, 50])
@pytest.mark.parametrize("record_params", [False, True])
def test_timeline_is_absolute_even_when_the_ring_starts_mid_run(max_entries, record_params):
    s, truth = _snap(steps=4, layers=5, max_entries=max_entries, record_params=record_params)
    tr = s.trace()
    assert list(tr.allocated) == truth
    assert tr.peak == max(truth)
    assert tr.allocated[tr.peak_index] == tr.peak
    assert sum(tr.el_size[j] for j in tr.live_elements(tr.peak_index)) == tr.peak


def test_live_at_end_matches_segments():
    s, truth = _snap(steps=3, layers=4, max_entries=200)
    tr = s.trace()
    seg_req = sum(b["requested_size"] for seg in s.data["segments"] for b in seg["blocks"]
                  if b["state"] == "active_allocated")
    assert tr.allocated[-1] == seg_req == truth[-1]


def test_groups_by_first_user_frame_and_sum_to_live():
    s, _ = _snap(steps=2, layers=4)
    tr = s.trace()
    groups = tr.groups_at(tr.peak_index)
    assert sum(g.bytes for g in groups) == tr.peak
    keys = [g.key for g in groups]
    assert any(k.startswith("model.py:") and "forward" in k for k in keys)
    assert not any("functional.py" in k or "module.py" in k for k in keys)
    assert groups == sorted(groups, key=lambda g: (-g.bytes, g.key))
    assert NO_STACK in keys  # the parameters, allocated before recording started


def test_stackless_allocations_inside_the_window_are_not_called_pre_recording():
    # autograd's backward thread allocates with no Python frame (seen in the GPU fixtures)
    fr = _stack("/p/model.py", 3, "forward", "linear")
    data = {"segments": [{"device": 0, "address": 0, "total_size": 4096, "blocks": [
        {"address": 0, "size": 1024, "requested_size": 1000, "state": "active_allocated",
         "frames": []}]}],
        "device_traces": [[
            {"action": "alloc", "addr": 2048, "size": 512, "frames": [], "time_us": 1},
            {"action": "alloc", "addr": 3072, "size": 256, "frames": fr, "time_us": 2}]]}
    tr = Snapshot(data).trace()
    keys = {g.key: g.bytes for g in tr.groups_at(1)}
    assert keys == {NO_STACK: 1000, NO_PY_STACK: 512, "model.py:3 forward": 256}


def test_search_by_file_and_function():
    s, _ = _snap(steps=2, layers=4)
    tr = s.trace()
    only = tr.groups_at(tr.peak_index, "Block2")
    assert only and all("Block2" in g.key for g in only)
    by_file = tr.groups_at(tr.peak_index, "TRAIN.PY")
    assert by_file and sum(g.bytes for g in by_file) <= tr.peak
    assert tr.groups_at(tr.peak_index, "no-such-thing") == []


def test_user_frame_filter():
    assert is_user_frame("/home/u/proj/train.py")
    assert not is_user_frame("/opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py")
    assert not is_user_frame("<frozen runpy>")
    assert not is_user_frame("/pytorch/c10/cuda/CUDACachingAllocator.cpp")
    assert not is_user_frame("/usr/lib/python3.11/threading.py")


def test_step_boundaries_and_summary():
    s, _ = _snap(steps=3, layers=3)
    steps = s.step_boundaries()
    assert len(steps) == 3 and all(name == "AdamW.step" for _, name in steps)
    assert [e for e, _ in steps] == sorted(e for e, _ in steps)
    summ = report.summary(s)
    assert summ["peak"]["bytes"] == s.trace().peak
    assert summ["steps"] == 3 and summ["oom"] is None
    assert summ["counts"]["alloc"] > 0
    txt = report.summary_text(summ)
    assert "peak allocated" in txt and "dominated by" in txt


def test_segments_and_fragmentation():
    s, _ = _snap(steps=2, layers=4)
    tr = s.trace()
    t = tr.segment_totals()
    assert t["reserved"] == sum(seg["total_size"] for seg in s.data["segments"])
    assert t["allocated"] + t["free"] + t["pending_free"] == t["reserved"]
    assert 0 <= t["fragmentation"] < 1
    assert t["largest_free_block"] == max(
        b["size"] for seg in s.data["segments"] for b in seg["blocks"] if b["state"] == "inactive")


@pytest.mark.parametrize("kind,expected", [("huge", "huge"), ("full", "full"),
                                           ("fragmented", "fragmented")])
def test_oom_verdicts(kind, expected):
    s, truth = _snap(steps=3, layers=6, oom_at_step=1, oom_kind=kind, capacity=400 << 20)
    tr = s.trace()
    assert tr.action[tr.n - 1] == 8  # the trace ends with the oom
    o = report.oom_info(s)
    assert o["kind"] == expected, o["verdict"]
    assert o["event"] == tr.n - 1
    assert o["live_allocated"] == truth[-1]
    assert o["requested"] > 0 and o["top"]
    assert sum(g["bytes"] for g in o["top"]) <= o["live_allocated"]
    if expected == "fragmented":
        assert o["largest_free_block"] < o["requested"] <= o["cached_free"] + o["device_free"]
        assert o["unusable_reserved"] == o["cached_free"]


def test_oom_sidecar_overrides(tmp_path):
    data, _ = training_snapshot(steps=2, layers=3, oom_at_step=1, oom_kind="huge",
                                capacity=400 << 20)
    s = Snapshot(data, "x", sidecar={"oom": {"device_total": 1 << 40, "requested": 1 << 30}})
    o = report.oom_info(s)
    assert o["device_total"] == 1 << 40 and o["requested"] == 1 << 30


def _old_format(data):
    """Strip what torch 2.1-era dumps may lack: times, frames on blocks, requested_size,
    annotations, allocator settings; blocks carry their stack in `history`."""
    for seg in data["segments"]:
        for b in seg["blocks"]:
            b.pop("address", None)
            fr = b.pop("frames", [])
            req = b.pop("requested_size", b["size"])
            if b["state"] == "active_allocated":
                b["history"] = [{"addr": 0, "real_size": req, "frames": fr}]
    for ev in data["device_traces"]:
        for e in ev:
            e.pop("time_us", None)
    data.pop("external_annotations")
    data.pop("allocator_settings")
    return data


def test_old_format_snapshot_reads_the_same():
    data, truth = training_snapshot(steps=3, layers=4, max_entries=150)
    s = Snapshot(_old_format(data), "old")
    tr = s.trace()
    assert list(tr.allocated) == truth
    assert tr.event_time_s(3) is None
    summ = report.summary(s)
    assert summ["steps"] == 0 and summ["duration_s"] is None
    report.summary_text(summ)
    report.html_page(s)


def test_odd_values_do_not_crash():
    data, _ = training_snapshot(steps=1, layers=2)
    ev = data["device_traces"][0]
    ev.insert(3, "not a dict")
    ev.insert(4, {"action": "mystery", "addr": "x", "size": None, "frames": "nope"})
    ev.append({"action": "alloc", "addr": 2**70, "size": -5})
    data["segments"].append({"blocks": [None, {"size": "big"}]})
    data["external_annotations"] = [None, {"name": 3}]
    s = Snapshot(data, "odd")
    tr = s.trace()
    assert tr.skipped == 1
    report.summary_text(report.summary(s))


def test_multi_device_picks_the_busiest():
    data, _ = training_snapshot(steps=1, layers=2)
    data["device_traces"] = [[], data["device_traces"][0]]
    for seg in data["segments"]:
        seg["device"] = 1
    s = Snapshot(data, "md")
    assert s.default_device == 1 and s.trace().n > 0 and s.trace().segments


ops = st.lists(st.tuples(st.booleans(), st.integers(1, 3 << 20), st.integers(0, 10**6)),
               min_size=1, max_size=120)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, rec_from=st.integers(0, 60), ring=st.one_of(st.none(), st.integers(1, 200)))
def test_property_peak_and_live_sets(ops, rec_from, ring):
    al = SynthAllocator(capacity=1 << 40, seed=1)
    live = []
    frames = [_stack("/u/a.py", 1, "f", "x"), _stack("/u/b.py", 2, "g", "y"), []]
    for k, (is_alloc, size, pick) in enumerate(ops):
        al.recording = k >= rec_from
        if is_alloc or not live:
            live.append(al.malloc(size, frames[pick % 3]))
        else:
            al.free(live.pop(pick % len(live)))
    al.recording = True
    data, truth = al.snapshot(ring)
    s = Snapshot(pickle.loads(pickle.dumps(data)), "p")
    tr = s.trace()
    assert list(tr.allocated) == truth
    if tr.n:
        assert tr.peak == max(truth)
    for i in {tr.peak_index, tr.n - 1, tr.n // 2}:
        live_bytes = sum(tr.el_size[j] for j in tr.live_elements(i))
        assert live_bytes == tr.allocated_at(i)
        assert sum(g.bytes for g in tr.groups_at(i)) == live_bytes
