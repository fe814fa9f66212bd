"""`gpumon view FILE --summary/--json/--html` and its errors, through the real command line."""
import json
import os
import pickle
import re
import subprocess
import sys

import pytest

from gpumon.snapshot.synth import training_snapshot


def gpumon(*args, **kw):
    return subprocess.run([sys.executable, "-m", "gpumon", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL, **kw)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("snaps")
    snap, _ = training_snapshot(steps=3, layers=4, max_entries=400)
    (d / "train.pickle").write_bytes(pickle.dumps(snap))
    oom, _ = training_snapshot(steps=3, layers=6, oom_at_step=1, oom_kind="fragmented",
                               capacity=400 << 20)
    (d / "oom.pickle").write_bytes(pickle.dumps(oom))
    return d


def test_summary_text(files):
    r = gpumon("view", str(files / "train.pickle"), "--summary")
    assert r.returncode == 0, r.stderr
    assert "peak allocated" in r.stdout and "live at the peak" in r.stdout
    assert "optimizer steps" in r.stdout


def test_json(files):
    r = gpumon("view", str(files / "oom.pickle"), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["peak"]["bytes"] > 0 and d["events"] > 0
    assert d["oom"]["kind"] == "fragmented"
    assert d["top_at_peak"] and sum(g["bytes"] for g in d["top_at_peak"]) <= d["peak"]["bytes"]


def test_oom_summary_mentions_verdict(files):
    r = gpumon("view", str(files / "oom.pickle"), "--summary")
    assert "OUT OF MEMORY" in r.stdout and "verdict: fragmented" in r.stdout


def test_html_is_self_contained(files, tmp_path):
    out = tmp_path / "page.html"
    r = gpumon("view", str(files / "train.pickle"), "--html", str(out))
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "<table>" in page
    assert "://" not in page  # no CDN, no link of any kind
    assert not re.search(r"<(script|link|img|iframe)[^>]*(src|href)=", page)
    assert "@import" not in page
    assert not list(tmp_path.glob("*.tmp"))


def test_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"\x80\x04\x95garbage")
    for args in (["view", str(bad), "--summary"], ["view", str(tmp_path / "none.pickle")],
                 ["view", "/etc/hostname" if os.path.exists("/etc/hostname") else str(bad)]):
        r = gpumon(*args)
        assert r.returncode == 1
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("gpumon: "), r.stderr
        assert "Traceback" not in r.stderr


def test_hostile_file_via_cli(tmp_path):
    marker = tmp_path / "ran"
    payload = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
    p = tmp_path / "evil.pickle"
    p.write_bytes(payload)
    r = gpumon("view", str(p), "--summary")
    assert r.returncode == 1 and "refused" in r.stderr and not marker.exists()


def test_no_tty_hint(files):
    r = gpumon("view", str(files / "train.pickle"))
    assert r.returncode == 2 and "--summary" in r.stderr


def test_bad_device(files):
    r = gpumon("view", str(files / "train.pickle"), "--device", "5", "--summary")
    assert r.returncode == 1 and "no device 5" in r.stderr


def test_snapshot_layer_needs_no_torch_or_textual():
    code = ("import sys, gpumon.snapshot, gpumon.snapshot.report, gpumon.snapshot.synth;"
            "bad=[m for m in ('torch','textual') if m in sys.modules]; print(bad); "
            "sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_load_progress_shows_on_a_terminal_after_a_second(monkeypatch):
    import io

    from gpumon.commands.view import _LoadProgress

    class Tty(io.StringIO):
        def isatty(self):
            return True
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.delenv("GPUMON_NO_PROGRESS", raising=False)
    quick = _LoadProgress("/x/s.pickle", after=60)
    quick(10, 100)
    quick.phase("replaying the trace")
    quick.close()
    assert err.getvalue() == ""          # a load under the threshold shows nothing
    slow = _LoadProgress("/x/s.pickle", after=0)
    slow(50, 100)
    slow.bar.refresh()
    assert "reading s.pickle" in err.getvalue()
    slow.phase("replaying the trace")
    slow.bar.refresh()
    assert "replaying the trace" in err.getvalue()
    slow.close()
    plain = io.StringIO()                # not a terminal: never a bar
    monkeypatch.setattr(sys, "stderr", plain)
    p = _LoadProgress("/x/s.pickle", after=0)
    p(50, 100)
    p.close()
    assert plain.getvalue() == ""
