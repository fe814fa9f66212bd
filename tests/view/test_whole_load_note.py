"""Issue 33, item 8: a pickle whose event lists torch's streaming reader cannot follow (not
memoized: another writer, pickletools.optimize; an old protocol) is read whole, and that is
said in one note with the memory it may take (it was silent: 10M events, 235 s, 7.5 GB)."""
import pickle
import pickletools
import subprocess
import sys

import pytest

from gpumon.snapshot import load, open_snapshot
from gpumon.snapshot.synth import training_snapshot


@pytest.fixture()
def files(tmp_path):
    data, _ = training_snapshot(steps=3, layers=3)
    raw = pickle.dumps(data, protocol=4)
    (tmp_path / "torch.pickle").write_bytes(raw)
    (tmp_path / "optimized.pickle").write_bytes(pickletools.optimize(raw))  # no MEMOIZE
    (tmp_path / "proto2.pickle").write_bytes(pickle.dumps(data, protocol=2))
    return tmp_path


def test_a_file_read_whole_says_so(files, monkeypatch):
    monkeypatch.setattr(load, "WHOLE_LOAD_NOTE_EVENTS", 10)
    a = open_snapshot(files / "torch.pickle")
    assert a.load_note is None                     # streamed: nothing to say
    # without memo entries the stream cannot find the event lists: they come back whole
    c = open_snapshot(files / "optimized.pickle")
    assert c.load_note and "read whole" in c.load_note
    assert list(c.trace().allocated) == list(a.trace().allocated)
    b = open_snapshot(files / "proto2.pickle")
    assert b.load_note and "read whole" in b.load_note and "GiB" in b.load_note
    # the same figures either way
    assert list(b.trace().allocated) == list(a.trace().allocated)


def test_small_files_read_whole_are_not_noted(files):
    assert open_snapshot(files / "proto2.pickle").load_note is None


def test_the_cli_prints_the_note_once(files):
    code = ("import sys; from gpumon.snapshot import load; load.WHOLE_LOAD_NOTE_EVENTS = 10; "
            "from gpumon.cli import main; sys.exit(main())")
    r = subprocess.run([sys.executable, "-c", code, "view", str(files / "proto2.pickle"),
                        "--summary"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("gpumon: note:")]
    assert len(notes) == 1 and "read whole" in notes[0]
