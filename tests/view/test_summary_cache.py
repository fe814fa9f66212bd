"""Issue 33, item 7: `gpumon view FILE --summary` a second time prints what the first printed,
from the view cache, without loading, replaying or analysing the file again (its imports
included); the entry is never trusted when damaged, foreign or stale."""
import json
import os
import pickle
import subprocess
import sys

import pytest

from gpumon.cli import main
from gpumon.snapshot import cache, load
from gpumon.snapshot.synth import snapshot_with_events

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture()
def snap_file(tmp_path):
    p = tmp_path / "run.pickle"
    with open(p, "wb") as f:
        pickle.dump(snapshot_with_events(3000, all_stacks=True), f, protocol=4)
    return str(p)


def _run(capsys, *argv):
    rc = main(["view", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _entries():
    d = cache.cache_dir()
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".summary"))


def _no_read(*a, **k):
    raise AssertionError("read the snapshot again")


def test_warm_summary_is_the_cold_one_byte_for_byte(snap_file, capsys, monkeypatch):
    # a sidecar that is not gpumon's: its note is said on the warm run too
    with open(snap_file + ".json", "w") as f:
        f.write('{"something": "else"}')
    cold = {o: _run(capsys, snap_file, *o) for o in (("--summary",), ("--json",),
                                                     ("--summary", "--top", "3"))}
    assert all(rc == 0 and out for rc, out, _ in cold.values())
    assert "peak allocated" in cold[("--summary",)][1]
    assert "gpumon: note:" in cold[("--summary",)][2]
    assert len(_entries()) == 3      # one for each output: text, JSON, text with --top 3
    monkeypatch.setattr(load, "_read_snapshot", _no_read)
    for o, want in cold.items():
        assert _run(capsys, snap_file, *o) == want
    # another grouping is another summary: not answered from the cache
    with pytest.raises(AssertionError, match="read the snapshot again"):
        main(["view", snap_file, "--summary", "--by", "file"])


def test_a_warm_summary_imports_no_analysis(snap_file):
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-X", "importtime", "-m", "gpumon", "view", snap_file, "--summary"]
    runs = [subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
            for _ in range(2)]
    assert runs[0].returncode == runs[1].returncode == 0
    assert runs[0].stdout == runs[1].stdout and "peak allocated" in runs[1].stdout
    mods = [{line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}
            for r in runs]
    assert "gpumon.snapshot.analysis" in mods[0]
    assert not {m for m in mods[1] if m in ("gpumon.snapshot.analysis", "gpumon.snapshot.load",
                                            "gpumon.snapshot.report", "pickle")}


def test_a_cold_summary_without_sidecar_imports_no_json(snap_file):
    """json (1 ms of every cold summary) is imported only where a sidecar file is there to
    read; the summary text needs none."""
    env = {**os.environ, "PYTHONPATH": ROOT, "GPUMON_VIEW_CACHE": "0"}
    cmd = [sys.executable, "-X", "importtime", "-m", "gpumon", "view", snap_file, "--summary"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "peak allocated" in r.stdout
    mods = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert "gpumon.snapshot.report" in mods and "json" not in mods
    with open(snap_file + ".json", "w") as f:   # a sidecar: read, with json
        f.write('{"something": "else"}')
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "not a gpumon sidecar" in r.stderr
    assert "json" in {line.split("|")[-1].strip() for line in r.stderr.splitlines()
                      if "|" in line}


def test_gpumon_run_as_a_program_leaves_without_teardown(snap_file, capsys):
    """`gpumon view F --summary` as a program (python -m gpumon, the console script) leaves
    once everything is printed, without the interpreter's teardown (6.6 ms of a cold summary:
    freeing the loaded file object by object): the same output and exit status, no atexit
    handler run. Called in a process of its own (a test, a script), main() returns."""
    code = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('TEARDOWN', file=sys.stderr))\n"
            "sys.argv = ['gpumon'] + sys.argv[1:]\n"
            "runpy.run_module('gpumon', run_name='__main__', alter_sys=True)\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "GPUMON_VIEW_CACHE": "0"}
    rc, want, _ = _run(capsys, snap_file, "--summary")   # in this process: it returns
    assert rc == 0
    for argv, status in (([snap_file, "--summary"], 0), ([snap_file + ".no", "--summary"], 1)):
        r = subprocess.run([sys.executable, "-c", code, "view", *argv], capture_output=True,
                           text=True, env=env, cwd=ROOT, timeout=60)
        assert r.returncode == status
        assert "TEARDOWN" not in r.stderr
        if status == 0:
            assert r.stdout == want
        else:
            assert r.stderr.startswith("gpumon: ") and "no such file" in r.stderr


@pytest.mark.parametrize("damage", ["garbage", "flip", "truncate", "empty", "other-file"])
def test_a_damaged_entry_is_rebuilt(snap_file, tmp_path, capsys, monkeypatch, damage):
    rc, want, _ = _run(capsys, snap_file, "--summary")
    (entry,) = _entries()
    data = open(entry, "rb").read()
    if damage == "garbage":
        data = b"\x00garbage" * 100
    elif damage == "flip":        # one byte of the text changed: the checksum says so
        k = data.index(b"peak allocated")
        data = data[:k] + b"P" + data[k + 1:]
    elif damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "empty":
        data = b""
    else:                         # a valid entry made for another file, under this one's name
        other = tmp_path / "other.pickle"
        with open(other, "wb") as f:
            pickle.dump(snapshot_with_events(500, all_stacks=True), f, protocol=4)
        _run(capsys, str(other), "--summary")
        (o,) = [e for e in _entries() if e != entry]
        data = open(o, "rb").read()
    with open(entry, "wb") as f:
        f.write(data)
    reads = []
    real = load._read_snapshot
    monkeypatch.setattr(load, "_read_snapshot", lambda *a, **k: reads.append(1) or real(*a, **k))
    assert _run(capsys, snap_file, "--summary") == (0, want, "")
    assert reads == [1]                                   # read the snapshot again
    assert open(entry, "rb").read() != data               # and wrote the entry again
    assert _run(capsys, snap_file, "--summary") == (0, want, "") and reads == [1]


def test_a_changed_file_or_sidecar_is_summarised_again(snap_file, capsys):
    _, first, _ = _run(capsys, snap_file, "--json")
    with open(snap_file, "wb") as f:
        pickle.dump(snapshot_with_events(3500, all_stacks=True), f, protocol=4)
    _, second, _ = _run(capsys, snap_file, "--json")
    assert json.loads(second)["events"] == 3500 != json.loads(first)["events"]
    with open(snap_file + ".json", "w") as f:   # a sidecar appears: its note is new
        f.write("[1]")
    rc, third, err = _run(capsys, snap_file, "--json")
    assert rc == 0 and "gpumon: note:" in err


def test_off_no_entry(snap_file, capsys, monkeypatch):
    monkeypatch.setenv("GPUMON_VIEW_CACHE", "0")
    _run(capsys, snap_file, "--summary")
    assert not os.path.isdir(cache.cache_dir()) or not _entries()


# -- the replay kept for the first screen -------------------------------------------------------

@pytest.fixture()
def big_file(tmp_path):
    p = tmp_path / "big.pickle"
    with open(p, "wb") as f:
        pickle.dump(snapshot_with_events(20_000, all_stacks=True), f, protocol=4)
    assert os.path.getsize(p) >= cache.MIN_BYTES
    return str(p)


def _replays():
    d = cache.cache_dir()
    return [os.path.join(d, n) for n in os.listdir(d) if n.endswith(".replay")]


def _figures(tr):
    return (list(tr.allocated), tr.base, tr.peak, tr.peak_index, list(tr.reserved),
            list(tr.el_start), list(tr.el_end), list(tr.el_size), list(tr.el_fid), tr.n_allocs)


def test_a_kept_replay_gives_the_same_trace(big_file, monkeypatch):
    from gpumon.snapshot import analysis, open_snapshot
    cold = _figures(open_snapshot(big_file).trace())
    assert len(_replays()) == 1
    calls = []
    real = analysis.DeviceTrace._replay
    monkeypatch.setattr(analysis.DeviceTrace, "_replay",
                        lambda self, *a: calls.append(1) or real(self, *a))
    tr = open_snapshot(big_file).trace()
    assert (list(tr.allocated), tr.peak, tr.peak_index, list(tr.reserved)) == \
        cold[0:1] + cold[2:5]
    assert calls == []                           # the first screen's figures: not replayed
    assert _figures(tr) == cold and calls == [1]   # the elements, replayed when asked for


@pytest.mark.parametrize("damage", ["flip", "peak", "truncate"])
def test_a_damaged_replay_is_made_again(big_file, damage):
    from gpumon.snapshot import open_snapshot
    cold = _figures(open_snapshot(big_file).trace())
    (f,) = _replays()
    data = bytearray(open(f, "rb").read())
    k = len(cache._REPLAY_MAGIC) + 4
    if damage == "flip":          # a byte of the column: the checksum says so
        data[-5] ^= 0xFF
    elif damage == "peak":        # a wrong peak with a right checksum: the figures disagree
        body = bytes(data[k:])
        body = body[:8] + (int.from_bytes(body[8:16], "little") + 512).to_bytes(8, "little") + \
            body[16:]
        import zlib
        data = bytearray(cache._REPLAY_MAGIC + zlib.crc32(body).to_bytes(4, "little") + body)
    else:
        data = data[:len(data) // 2]
    with open(f, "wb") as fh:
        fh.write(data)
    assert _figures(open_snapshot(big_file).trace()) == cold
    assert open(f, "rb").read() != bytes(data)     # written again
