"""The allocator's state at any event, rebuilt back from the dump, against the synthetic
allocator's own state after every event."""
import pickle

import pytest

from gpumon.snapshot import Snapshot
from gpumon.snapshot.synth import SynthAllocator, _stack


class Recording(SynthAllocator):
    """Keeps (address, total, largest free block, allocated) of every segment after each event."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.states = []

    def _emit(self, **e):
        super()._emit(**e)
        if self.recording:
            st = []
            for seg in self.segments:
                free = [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
                st.append((seg["address"], seg["total_size"], max(free, default=0),
                           sum(b["size"] for b in seg["blocks"] if b["state"] != "inactive")))
            self.states.append(sorted(st))


def _run(keep=None, seed=0):
    al = Recording(capacity=300 << 20, seed=seed)
    fr = _stack("/p/m.py", 1, "f", "empty")
    rng = al.rng
    al.recording = False
    al.malloc(30 << 20, fr)
    al.recording = True
    live = []
    for k in range(300):
        if live and rng.random() < 0.45:
            al.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randint(1, 2000) * 512, rng.randint(1, 40) << 20])
            p = al.malloc(size, fr)
            if p is None:
                al.release_cached()
                continue
            live.append(p)
        if k % 60 == 59:
            al.release_cached()
    data, _ = al.snapshot(keep)
    states = al.states[-keep:] if keep else al.states
    return Snapshot(pickle.loads(pickle.dumps(data))).trace(), states


@pytest.mark.parametrize("keep,seed", [(None, 0), (None, 1), (150, 2)])
def test_segments_at_every_event_match_the_allocator(keep, seed):
    tr, states = _run(keep, seed)
    assert tr.n == len(states)
    checked = 0
    for i in range(0, tr.n, 3):
        if tr.action[i] == 1:
            continue  # free_requested: memory_viz (and the timeline) count the free from here,
            # the allocator's blocks change at the free_completed that follows
        checked += 1
        got = sorted((s.address, s.total, s.largest_free, s.allocated) for s in tr.segments_at(i))
        assert got == states[i], i
        assert sum(s.total for s in tr.segments_at(i)) == tr.reserved[i]
    assert checked > tr.n // 6


def test_at_the_end_it_is_the_dump():
    tr, _ = _run()
    assert tr.segments_at(tr.n - 1) == tr.segment_infos()
