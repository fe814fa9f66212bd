"""Real snapshots recorded on a GPU (tests/fixtures/snapshots/, made by
scripts/make_snapshot_fixtures.py); skipped until they exist."""
import json
from pathlib import Path

import pytest

from gpumon.snapshot import open_snapshot
from gpumon.snapshot import report

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "snapshots"
FILES = sorted(FIX.glob("*.pickle")) if FIX.is_dir() else []


def _sidecar(p: Path) -> dict:
    j = Path(str(p) + ".json")
    return json.loads(j.read_text()) if j.exists() else {}


@pytest.mark.skipif(not FILES, reason="no GPU-made fixtures in tests/fixtures/snapshots/")
@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_real_snapshot(path):
    s = open_snapshot(path)
    tr = s.trace()
    assert tr.n > 0
    assert min(tr.allocated) >= 0, "the timeline went negative: the replay lost track"
    assert sum(tr.el_size[j] for j in tr.live_elements(tr.peak_index)) == tr.peak
    assert sum(g.bytes for g in tr.groups_at(tr.peak_index)) == tr.peak
    # the end of the timeline is what the segments hold (requested bytes of live blocks)
    live_req = sum(b.get("requested_size", b["size"]) for seg in tr.segments
                   for b in seg.get("blocks", []) if b.get("state") == "active_allocated")
    assert tr.allocated[-1] == live_req
    summ = report.summary(s)
    report.summary_text(summ)
    assert "://" not in report.html_page(s)
    if path.stem != "oom":
        groups = tr.groups_at(tr.peak_index)
        assert any(g.frame is not None for g in groups), "no user frame found in real stacks"


@pytest.mark.skipif(not (FIX / "oom.pickle").exists(), reason="no GPU-made OOM fixture")
def test_real_oom_snapshot():
    p = FIX / "oom.pickle"
    s = open_snapshot(p)
    o = report.oom_info(s)
    assert o is not None and o["event"] == s.trace().n - 1
    assert o["kind"] == "huge"  # the script asks for 10 TiB
    side = _sidecar(p).get("oom") or {}
    if side.get("allocated") is not None:
        # live bytes replayed from the trace vs torch.cuda.memory_allocated() in the observer
        # (the latter counts rounded block sizes, the trace requested sizes: within 1%+1 MiB)
        assert abs(o["live_allocated"] - side["allocated"]) <= side["allocated"] * 0.01 + (1 << 20)


def test_no_fixture_carries_a_maintainers_paths():
    """Frames of the checkout's own files are relative (scripts/make_snapshot_fixtures.py
    sanitises them); the fixtures were made in /work/main."""
    import re
    from pathlib import Path
    d = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots"
    files = sorted(d.glob("*.pickle*"))
    assert files
    for f in files:
        text = f.read_bytes().decode("latin-1")
        assert not re.search(r"/(work|home|root|Users)/", text), f.name
    assert b"scripts/make_snapshot_fixtures.py" in (d / "oom.pickle").read_bytes()
