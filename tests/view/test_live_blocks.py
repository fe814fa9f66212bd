"""The walk of the dump's segments for the allocations they hold is one generator
(analysis.live_blocks) that the replay and a window's seed share (it was written twice)."""
import pickle

from gpumon.snapshot import analysis, window
from gpumon.snapshot.analysis import Snapshot, live_blocks
from gpumon.snapshot.load import load_snapshot
from gpumon.snapshot.synth import training_snapshot
from gpumon.snapshot.synth_long import write_long_trace


def test_live_blocks_content():
    segs = [{"device": 0, "address": 4096, "total_size": 8192, "blocks": [
        {"size": 1024, "state": "active_allocated", "requested_size": 1000,
         "frames": [{"filename": "a.py", "line": 3, "name": "f"}]},
        {"size": 2048, "state": "inactive"},
        {"address": 4096 + 3072, "size": 512, "state": "active_allocated",
         "history": [{"real_size": 500, "frames": [{"filename": "b.py", "line": 9,
                                                     "name": "g"}]}]},
        "junk"]},
        {"device": 1, "address": 1 << 30, "total_size": 512,
         "blocks": [{"size": 512, "state": "active_allocated"}]}]
    got = list(live_blocks(segs, 0))
    assert got == [(4096, 1000, [{"filename": "a.py", "line": 3, "name": "f"}], 1024),
                   (4096 + 3072, 500, [{"filename": "b.py", "line": 9, "name": "g"}], 512)]
    assert [g[0] for g in live_blocks(segs)] == [4096, 7168, 1 << 30]


def test_replay_and_window_seed_share_the_walk(monkeypatch, tmp_path):
    calls = []
    real = analysis.live_blocks

    def spy(segments, device=None):
        calls.append(device)
        return real(segments, device)
    monkeypatch.setattr(analysis, "live_blocks", spy)
    snap, _ = training_snapshot(steps=2, layers=2, max_entries=60)
    Snapshot(pickle.loads(pickle.dumps(snap))).trace()
    assert calls, "the replay does not walk the dump's blocks with live_blocks"
    calls.clear()
    p = str(tmp_path / "long.pickle")
    write_long_trace(p, 4000)
    d = load_snapshot(p, window=1000)
    assert d["_gpumon_window"] and 0 in calls, "the window's seed has a walk of its own"
    assert window.Seeder  # (the seed is window.Seeder.seed)
