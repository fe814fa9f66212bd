"""Issue 33, items 5 and 6: a sidecar is recognised by its format marker (old ones by their known
keys), anything else beside a snapshot is ignored with a note, parsing is bounded; `diff --grep`
gives the selection's totals and a pattern that matches nothing is one line and exit 1."""
import json
import pickle
import subprocess
import sys

from gpumon.snapshot import Snapshot, open_snapshot
from gpumon.snapshot.diff import diff, diff_text
from gpumon.snapshot.report import load_sidecar
from gpumon.snapshot.synth import training_snapshot
from tests.view.test_diff import A, B, _snap

MB = 1 << 20


def _gpumon(*args, **kw):
    return subprocess.run([sys.executable, "-m", "gpumon", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL, **kw)


def test_the_views_own_json_is_not_taken_for_a_sidecar(tmp_path):
    snap, _ = training_snapshot(steps=2, layers=3)
    f = tmp_path / "X.pickle"
    f.write_bytes(pickle.dumps(snap))
    (tmp_path / "X.pickle.json").write_text(json.dumps(
        {"format": "gpumon-snapshot-meta", "version": 1, "kind": "manual", "pid": 4242}))
    r = _gpumon("view", str(f), "--summary")
    assert "snapshot of pid 4242" in r.stdout
    (tmp_path / "X.pickle.json").unlink()
    r = _gpumon("view", str(f), "--json")
    assert r.returncode == 0
    (tmp_path / "X.json").write_text(r.stdout)       # gpumon view X.pickle --json > X.json
    r = _gpumon("view", str(f), "--summary")
    assert r.returncode == 0, r.stderr
    assert "recorded" not in r.stdout and "pid ?" not in r.stdout
    assert "X.json" in r.stderr and "not a gpumon sidecar" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_old_sidecars_are_still_read_by_their_keys(tmp_path):
    p = tmp_path / "old.pickle"
    (tmp_path / "old.pickle.json").write_text(json.dumps(
        {"kind": "oom", "pid": 12, "oom": {"requested": 5, "device_total": 10}}))
    side, note = load_sidecar(str(p), with_note=True)
    assert side["pid"] == 12 and note is None


def test_sidecar_parsing_is_bounded(tmp_path):
    snap, _ = training_snapshot(steps=2, layers=3)
    f = tmp_path / "deep.pickle"
    f.write_bytes(pickle.dumps(snap))
    (tmp_path / "deep.pickle.json").write_text("[" * 200_000)
    side, note = load_sidecar(str(f), with_note=True)
    assert side == {} and "deep.pickle.json" in note
    for cmd in (("view", str(f), "--summary"), ("diff", str(f), str(f))):
        r = _gpumon(*cmd)
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr and "RecursionError" not in r.stderr
        assert len(r.stderr.strip().splitlines()) <= 1
    (tmp_path / "deep.pickle.json").write_text("[1, 2]")
    side, note = load_sidecar(str(f), with_note=True)
    assert side == {} and "not a gpumon sidecar" in note
    assert open_snapshot(f).sidecar == {}


def test_diff_grep_totals_are_the_selections():
    a, b = _snap(A, "a"), _snap(B, "b")
    d = diff(a, b, query="extra.py")
    assert d["a"]["live"] == 0 and d["b"]["live"] == 20 * MB
    assert d["change"]["live"] == 20 * MB
    # the peaks are the whole files' (the selection has no peak of its own), said so
    assert d["a"]["peak"] == 160 * MB
    txt = diff_text(d)
    assert "matching 'extra.py'" in txt
    live = [ln for ln in txt.splitlines() if ln.startswith("matching at peak")][0]
    assert "+20.00 MiB" in live
    # totals of every level add up to the selection's change
    for lvl in d["by"].values():
        assert sum(r["change"] for r in lvl["rows"]) + lvl["rest"]["change"] == 20 * MB


def test_diff_grep_with_no_match_is_one_line_and_exit_1(tmp_path):
    a, _ = training_snapshot(steps=2, layers=3)
    b, _ = training_snapshot(steps=2, layers=5)
    (tmp_path / "a.pickle").write_bytes(pickle.dumps(a))
    (tmp_path / "b.pickle").write_bytes(pickle.dumps(b))
    r = _gpumon("diff", str(tmp_path / "a.pickle"), str(tmp_path / "b.pickle"),
                "--grep", "no-such-file-anywhere")
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr.startswith("gpumon: ") and len(r.stderr.strip().splitlines()) == 1
    assert "no-such-file-anywhere" in r.stderr
    r = _gpumon("diff", str(tmp_path / "a.pickle"), str(tmp_path / "b.pickle"),
                "--grep", "no-such-file-anywhere", "--json")
    assert r.returncode == 1 and r.stdout == ""


def test_grep_row_of_the_same_file_adds_to_zero():
    s = Snapshot(training_snapshot(steps=2, layers=3)[0], "s")
    d = diff(s, s, query="model.py")
    assert d["change"]["live"] == 0 and d["a"]["live"] > 0
