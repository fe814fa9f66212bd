"""Malformed but plain-data snapshots and sidecars: every one either loads and analyses (summary,
OOM, HTML) or is refused with SnapshotError; nothing else may escape to the user."""
import copy
import json
import math
import os
import pickle
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumon.snapshot import Snapshot, SnapshotError, load, open_snapshot
from gpumon.snapshot import report
from gpumon.snapshot.load import normalize
from gpumon.snapshot.synth import training_snapshot

BASE, _ = training_snapshot(steps=2, layers=2, max_entries=80, oom_at_step=1, oom_kind="full",
                            capacity=120 << 20, seed=1)

odd = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                st.text(max_size=5), st.just([]), st.just({}), st.just([None, 1, "x"]),
                st.just({"filename": 3, "line": "x"}), st.just(float("inf")))


def _paths(obj):
    """Every (container, key) in the snapshot, to pick one to spoil."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield obj, k
            yield from _paths(v)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield obj, i
            yield from _paths(v)


N_PATHS = sum(1 for _ in _paths(BASE))


def _analyse(s: Snapshot):
    summ = report.summary(s)
    report.summary_text(summ)
    report.summary_json(summ)
    report.html_page(s)
    tr = s.trace()
    for i in (-1, 0, tr.peak_index, tr.n - 1):
        tr.groups_at(i, "py")
    tr.decimate(0, tr.n, 37)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(picks=st.lists(st.tuples(st.integers(0, N_PATHS - 1), odd), min_size=1, max_size=6),
       chunk=st.sampled_from([1, 29, 200, 64 << 10]))
def test_spoiled_fields_never_escape(picks, chunk):
    data = copy.deepcopy(BASE)
    paths = list(_paths(data))
    for idx, value in picks:
        if idx < len(paths):
            container, key = paths[idx]
            try:
                container[key] = copy.deepcopy(value)  # st.just shares one object
            except (IndexError, KeyError):
                pass
        paths = list(_paths(data))
    # the file loader (which packs the events while it unpickles them, in chunks of any size)
    # gives the same answer as pickle.loads, or the same one-line refusal
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "fuzz")
        with open(path, "wb") as f:
            pickle.dump(data, f, protocol=4)
        plain = _outcome(lambda: Snapshot(normalize(pickle.loads(pickle.dumps(data))), path))
        saved = load._CHUNK
        load._CHUNK = chunk
        try:
            streamed = _outcome(lambda: open_snapshot(path))
        finally:
            load._CHUNK = saved
    assert streamed == plain


def _outcome(make):
    try:
        s = make()
        _analyse(s)
        return report.summary_json(report.summary(s))
    except SnapshotError as e:
        assert "\n" not in str(e)
        return "refused: " + str(e).split(": ", 1)[-1]


@settings(max_examples=60, deadline=None)
@given(side=st.dictionaries(st.sampled_from(["oom", "simulated", "argv", "kind", "pid", "torch",
                                             "since", "until", "rank"]), odd, max_size=6),
       oom=st.dictionaries(st.sampled_from(["requested", "device_total", "device_free",
                                            "allocated", "reserved", "time", "device"]), odd))
def test_odd_sidecars_never_escape(side, oom):
    if "oom" not in side:
        side["oom"] = oom
    s = Snapshot(copy.deepcopy(BASE), "x", sidecar=side)
    _analyse(s)


def test_sidecar_that_is_not_json_or_not_a_dict_is_ignored(tmp_path):
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps(BASE))
    for text in ("{not json", "[1, 2]", "\xff\xfe", json.dumps({"oom": "x", "simulated": 1})):
        (tmp_path / "s.pickle.json").write_text(text, errors="surrogateescape")
        _analyse(open_snapshot(p))


def test_nan_and_inf_sizes_do_not_crash():
    data = copy.deepcopy(BASE)
    data["device_traces"][0][5]["size"] = math.nan
    data["device_traces"][0][6]["addr"] = math.inf
    data["segments"][0]["total_size"] = math.inf
    _analyse(Snapshot(data, "x"))


def test_simulated_sidecar_labels_every_output(tmp_path):
    p = tmp_path / "snapshot-1-101010.pickle"
    p.write_bytes(pickle.dumps(BASE))
    (tmp_path / "snapshot-1-101010.pickle.json").write_text(json.dumps(
        {"format": "gpumon-snapshot-meta", "kind": "manual", "simulated": True, "pid": 42,
         "argv": ["train.py", "--bs", "8"], "torch": None}))
    s = open_snapshot(p)
    assert report.is_simulated(s)
    text = report.summary_text(report.summary(s))
    assert text.startswith("snapshot") and "SIMULATED" in text.splitlines()[1]
    assert "pid 42 (train.py --bs 8)" in text
    assert "<b>SIMULATED</b>" in report.html_page(s)
    # "simulated": "no" (a string) is not true; a real one says nothing about simulation
    for val in ("no", False):
        (tmp_path / "snapshot-1-101010.pickle.json").write_text(json.dumps({"simulated": val}))
        s = open_snapshot(p)
        assert not report.is_simulated(s) and "SIMULATED" not in report.summary_text(
            report.summary(s))
    # capture's file name says it too, even without a sidecar
    q = tmp_path / "simulated-snapshot-1-101010.pickle"
    q.write_bytes(pickle.dumps(BASE))
    assert report.is_simulated(open_snapshot(q))


def test_the_fuzzed_base_goes_through_the_streaming_load(tmp_path):
    p = tmp_path / "base.pickle"
    p.write_bytes(pickle.dumps(BASE, protocol=4))
    assert type(open_snapshot(p).data["device_traces"][0]).__name__ == "PackedTrace"
