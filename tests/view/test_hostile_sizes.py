"""Sizes no allocator makes (a hostile or broken file): one `gpumon: FILE: ...` line and exit 1,
never a traceback. A fuzz case had a segment of ~9.2e18 bytes overflow the reserved column."""
import copy
import pickle
import subprocess
import sys

import pytest

from gpumon.snapshot import Snapshot, SnapshotError
from gpumon.snapshot.synth import training_snapshot

BASE, _ = training_snapshot(steps=2, layers=2, max_entries=80, seed=1)


def _spoil(kind):
    d = copy.deepcopy(BASE)
    ev = d["device_traces"][0]
    if kind == "segment_9e18":
        d["segments"][0]["total_size"] = 9_200_000_000_000_000_000
    elif kind == "segment_negative":
        d["segments"][0]["total_size"] = -5
    elif kind == "block_2**70":
        d["segments"][0]["blocks"][0]["size"] = 2**70
    elif kind == "segments_sum":
        for s in d["segments"]:
            s["total_size"] = 2**55
        d["segments"] += [copy.deepcopy(d["segments"][0]) for _ in range(300)]
    elif kind == "event_negative":
        ev[0]["size"] = -4096
    elif kind == "segment_events_sum":
        t = ev[-1]["time_us"]
        ev += [dict(action="segment_alloc", addr=2**40 + k, size=2**55, time_us=t + k,
                    frames=[]) for k in range(300)]
    return d


KINDS = ["segment_9e18", "segment_negative", "block_2**70", "segments_sum", "event_negative",
         "segment_events_sum"]


@pytest.mark.parametrize("kind", KINDS)
def test_refused_in_one_line(kind, tmp_path):
    d = _spoil(kind)
    with pytest.raises(SnapshotError, match="not a real memory snapshot"):
        s = Snapshot(d, "x.pickle")
        s.trace().reserved  # the old code overflowed here (OverflowError)
    p = tmp_path / "bad.pickle"
    p.write_bytes(pickle.dumps(d))
    for extra in (["--summary"], ["--table", "timeline"], ["--html", str(tmp_path / "o.html")]):
        r = subprocess.run([sys.executable, "-m", "gpumon", "view", str(p), *extra],
                           capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 1, (extra, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"gpumon: {p}: device 0: "), r.stderr
        assert "Traceback" not in r.stderr and r.stdout == ""


def test_huge_and_negative_addresses_and_oom_requests_still_load():
    d = copy.deepcopy(BASE)
    ev = d["device_traces"][0]
    ev[5]["addr"] = 2**70          # clamped by the loader's columns
    ev[6]["addr"] = -2**62
    d["segments"][0]["address"] = 2**80
    ev.append(dict(action="oom", addr=0, device_free=1 << 20, size=2**62, time_us=ev[-1]
                   ["time_us"] + 1, frames=[]))  # a request of 4 EiB: absurd but printable
    s = Snapshot(d, "x.pickle")
    tr = s.trace()
    assert tr.peak >= 0 and max(tr.reserved) >= 0
    from gpumon.snapshot import report
    assert report.oom_info(s)["requested"] == 2**62
    report.summary_text(report.summary(s))
    report.html_page(s)
