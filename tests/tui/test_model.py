"""The pure data model: decimation keeps extremes, memory stays bounded, peaks, state."""
import subprocess
import sys

from fakes import GiB, T0, hello, history, sample

from gpumon.model.process import ProcessModel, State, imbalance
from gpumon.model.series import Series


def test_raw_columns_keep_min_and_max():
    s = Series()
    vals = [5, 1, 9, 3, 7, 2, 8, 4]
    for i, v in enumerate(vals):
        s.append(i * 0.1, v)
    cols = s.columns(0.0, 0.8, 2)   # 4 samples per column
    assert cols[0] == (1, 9, 3)
    assert cols[1] == (2, 8, 4)
    assert s.peak == 9 and s.peak_t == 0.2


def test_coarse_tier_keeps_every_spike_of_a_long_run():
    s = Series(raw_capacity=100, buckets=64, bucket_width=0.1)
    n = 360_000  # ten hours at 10 Hz
    for i in range(n):
        v = 1000.0 if i == 123_457 else (0.5 if i == 300_001 else 10.0)
        s.append(i * 0.1, v)
    # bounded: raw tail + buckets, independent of the run length
    assert s.stored_values() <= 2 * 125 + 3 * 64
    cols = s.columns(0.0, n * 0.1, 40)
    assert max(c.hi for c in cols if c) == 1000.0
    assert min(c.lo for c in cols if c) == 0.5
    # the spike is in the column holding its time
    spike_col = int(123_457 * 0.1 / (n * 0.1 / 40))
    assert cols[spike_col].hi == 1000.0
    assert s.count == n and s.peak == 1000.0


def test_memory_does_not_grow_with_run_length():
    sizes = []
    for n in (10_000, 100_000):
        s = Series(raw_capacity=1000, buckets=256)
        for i in range(n):
            s.append(i * 0.1, float(i % 97))
        sizes.append(s.stored_values())
    assert sizes[1] <= sizes[0] * 1.05 + 10


def test_recent_window_uses_raw_samples_after_trim():
    s = Series(raw_capacity=200, buckets=64)
    for i in range(10_000):
        s.append(i * 0.1, float(i))
    cols = s.columns(990.0, 1000.0, 100)  # last 10 s: 100 columns of one sample each
    assert [c.lo for c in cols if c][:3] == [9900.0, 9901.0, 9902.0]
    assert cols[-1].last == 9999.0


def test_columns_outside_data_are_empty_and_none_values_skipped():
    s = Series()
    s.append(10.0, None)
    assert s.count == 0 and s.columns(0, 1, 5) == [None] * 5
    s.append(10.0, 3)
    s.append(9.0, 100)  # out of order: dropped
    assert s.peak == 3
    assert s.columns(0, 5, 5) == [None] * 5


def test_reset_peak_restarts_from_current():
    s = Series()
    for i, v in enumerate([1, 9, 4]):
        s.append(i, v)
    s.reset_peak()
    assert s.peak == 4
    s.append(3, 6)
    assert s.peak == 6 and s.peak_t == 3


def test_process_model_from_messages():
    p = ProcessModel("k")
    p.apply(hello(pid=7, rank=1, world=2, devices=2))
    assert p.state == State.RUNNING and p.label == "rank 1" and sorted(p.devices) == [0, 1]
    p.apply_all(history(40, devices=2))
    p.apply(sample(40, devices=2, retries=2), recv_t=T0 + 4.05)
    d = p.devices[0]
    assert p.samples == 41 and abs(p.delay_s - 0.05) < 1e-6
    assert d.get("allocated") == d.series["allocated"].last
    assert d.gap() == d.get("reserved") - d.get("allocated")
    assert d.non_pytorch() == d.get("proc_used") - d.get("reserved")
    assert d.retries_rose_t == T0 + 4.0
    # a history re-sent after a reconnect does not duplicate samples
    p.apply_all(history(41, devices=2))
    assert p.samples == 41


def test_recording_events_and_exit():
    p = ProcessModel("k", hello())
    p.apply_all(history(10))
    p.apply({"type": "event", "kind": "recording", "state": "started", "by": "pid:9",
             "who": "alice", "since": T0 + 0.5})
    assert p.recording.active and p.recording.who == "alice"
    p.apply({"type": "event", "kind": "recording", "state": "stopped", "by": "pid:9",
             "since": T0 + 0.5, "until": T0 + 0.9, "path": "/x/s.pickle"})
    assert not p.recording.active and list(p.recording.spans) == [[T0 + 0.5, T0 + 0.9]]
    assert p.recording.last_path == "/x/s.pickle"
    p.mark_exited(3)
    assert p.state == State.EXITED and "3" in p.state_detail
    p.mark_unreachable("x")  # an exited process stays exited
    assert p.state == State.EXITED


def test_imbalance_names_heaviest_and_lightest():
    a, b = ProcessModel("a", hello(pid=1, rank=0)), ProcessModel("b", hello(pid=2, rank=1))
    a.apply_all(history(30))
    b.apply_all(history(30, scale=1.5))
    imb = imbalance([("r0", a.devices[0]), ("r1", b.devices[0])])
    assert imb.high_label == "r1" and imb.low_label == "r0"
    assert imb.spread > 0.4
    assert imbalance([("r0", a.devices[0])]) is None
    assert imb.high == b.devices[0].peak_allocated
    assert b.devices[0].peak_allocated > 20 * GiB


def test_model_imports_neither_textual_nor_torch():
    code = ("import sys, gpumon.model.series, gpumon.model.process; "
            "bad = [m for m in ('textual', 'torch') if m in sys.modules]; "
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_charts_peak_is_torchs_peak_where_it_rose():
    """The ◆ stood on the highest sample (16.7 GiB on the H100 run) while the panel beside it
    said peak 18.3 GiB: max_memory_allocated falls between samples. It goes where the agent's
    peak_allocated rose, at that value; after a reset, where the counter restarted."""
    p = ProcessModel("k", hello())
    figs = [(0.0, 10, 10), (0.1, 12, 15), (0.2, 11, 15), (0.3, 9, 15), (0.4, 14, 16)]
    for t, alloc, peak in figs:
        p.apply({"type": "sample", "seq": int(t * 10), "t": T0 + t, "phase": None, "step": 0,
                 "devices": [{"index": 0, "allocated": alloc, "peak_allocated": peak}]})
    d = p.devices[0]
    assert d.series["allocated"].peak == 14       # the highest sample
    assert d.peak_point == (T0 + 0.4, 16)         # torch's, where it last rose
    p.apply({"type": "sample", "seq": 5, "t": T0 + 0.5, "phase": None, "step": 0,
             "devices": [{"index": 0, "allocated": 8, "peak_allocated": 8}]})   # reset peaks
    assert d.peak_point == (T0 + 0.5, 8)
    nv = ProcessModel("n", hello())               # no allocator figures: the highest sample
    for t, alloc in ((0.0, 3), (0.1, 7), (0.2, 5)):
        nv.apply({"type": "sample", "seq": int(t * 10), "t": T0 + t, "phase": None, "step": 0,
                  "devices": [{"index": 0, "allocated": alloc}]})
    assert nv.devices[0].peak_point == (T0 + 0.1, 7)
